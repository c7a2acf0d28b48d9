"""Tokenizing and packing a text corpus: ``automodel tokenize`` + packing over the memory-mapped
token file (``data=corpus``), against ``datasets.map`` with the fast tokenizer and against
Megatron-style preprocessing (a process pool encoding one document per call, written to a flat
token file), with each path's peak host memory as the corpus grows.

The corpus is generated (no download): ``.txt`` files of one document per line, lognormal lengths
(median ~600 characters, some of 40,000), words of the tiny tasks and numbers; a 16 MiB block of
unique lines is written again and again up to each size. Each path runs in a fresh process; its
peak memory is the largest sum of RSS over the process and its children, sampled every 50 ms
(``datasets.map``'s and the pool's workers included). Every path uses the same fast tokenizer: a
byte-level BPE of 16,384 ids trained on the first 2 MB of the corpus (the shipped tiny one's recipe,
``build_tiny_assets.train_tokenizer``), so that words are one or two tokens as with real tokenizers.

- ``automodel``: ``write_token_file`` with ``num_proc=2`` (this process reads the files as a
  stream and writes flat ids and offsets as they come; two forked workers run the fast
  tokenizer's batch encoder on batches of 1 MB), then the packs of an epoch (documents split into pieces of at most
  2,048 tokens, best-fit decreasing over the lengths) and every pack's row built once.
- ``datasets.map``: ``load_dataset("text")`` (Arrow cache) and ``.map(tokenizer, batched=True,
  num_proc=2)``, the usual Hugging Face preprocessing; no packing.
- ``megatron-style``: ``multiprocessing.Pool(2).imap(encode, lines, 32)`` with one
  ``tokenizer(text)`` per document (Megatron-LM's ``tools/preprocess_data.py`` does this), ids and
  document offsets appended to flat files.

    python -m automodel.benchmarks.tokenize                          # 0.1, 0.5 and 1 GB; baselines at 0.1 and 1 GB
    python -m automodel.benchmarks.tokenize --sizes 0.05 --baselines 0.05   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PATHS = ("automodel", "datasets.map", "megatron-style")
BLOCK_BYTES = 16 << 20
FILE_BYTES = 128 << 20
PACK = 2048


def make_tokenizer(corpus: Path, directory: Path) -> None:
    """A byte-level BPE of 16,384 ids trained on the first 2 MB of ``corpus``, saved for ``load_tokenizer``."""
    from automodel.assets.build_tiny_assets import tokenizer_config, train_tokenizer

    text = next(iter(sorted(corpus.glob("*.txt")))).read_text()[: 2 << 20]
    directory.mkdir()
    train_tokenizer(text.splitlines(), vocab_size=16384).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config()))


def make_corpus(directory: Path, size: int, seed: int = 0) -> int:
    """``.txt`` files of one document per line adding up to ``size`` bytes; returns the documents."""
    import numpy as np

    from automodel.assets.build_tiny_assets import WORDS

    rng = np.random.default_rng(seed)
    vocabulary = np.array(list(WORDS) + [str(n) for n in range(1000)])
    lines, total = [], 0
    while total < BLOCK_BYTES:
        words = rng.choice(vocabulary, size=max(1, int(rng.lognormal(np.log(100), 1.0))))
        line = " ".join(words)[:40_000] + "\n"
        lines.append(line)
        total += len(line)
    block = "".join(lines).encode()
    directory.mkdir(parents=True)
    written, index, documents = 0, 0, 0
    while written < size:
        with open(directory / f"part-{index:04d}.txt", "wb") as f:
            while written < size and f.tell() < FILE_BYTES:
                f.write(block)
                written += len(block)
                documents += len(lines)
        index += 1
    return documents


def _tree_rss() -> int:
    """Bytes of RSS of this process and all its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    total, todo = 0, [os.getpid()]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024
        except (OSError, StopIteration):
            pass
    return total


class PeakMemory:
    """The largest :func:`_tree_rss` seen every 50 ms while running."""

    def __enter__(self) -> PeakMemory:
        self.peak, self.done = _tree_rss(), threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _watch(self) -> None:
        while not self.done.wait(0.05):
            self.peak = max(self.peak, _tree_rss())

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()


def run_automodel(corpus: Path, work: Path, tokenizer_dir: str) -> dict:
    import numpy as np

    from automodel.data.corpus import TokenCorpus, corpus_packs
    from automodel.data.sft import load_tokenizer
    from automodel.data.token_files import write_token_file

    tokenizer = load_tokenizer(tokenizer_dir)
    start = time.perf_counter()
    file = write_token_file(str(corpus), work / "corpus.tokens", tokenizer, num_proc=2)
    tokenized = time.perf_counter()
    samples = TokenCorpus(file, np.arange(file.meta["documents"]), PACK, "split")
    packs = corpus_packs(samples, PACK, algorithm="bfd", seed=0, padding_idx=0, cp_size=1)
    planned = time.perf_counter()
    for first in range(0, len(packs), 256):
        packs[range(first, min(first + 256, len(packs)))]
    built = time.perf_counter()
    return {"tokens": file.meta["tokens"], "documents": file.meta["documents"], "packs": len(packs),
            "tokenize_s": tokenized - start, "plan_s": planned - tokenized, "rows_s": built - planned}  # fmt: skip


def run_datasets_map(corpus: Path, work: Path, tokenizer_dir: str) -> dict:
    import datasets

    from automodel.data.sft import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    files = sorted(str(p) for p in corpus.glob("*.txt"))
    start = time.perf_counter()
    rows = datasets.load_dataset("text", data_files=files, split="train", cache_dir=str(work / "hf"))
    loaded = time.perf_counter()
    tokenized = rows.map(lambda batch: tokenizer(batch["text"]), batched=True, num_proc=2,
                         remove_columns=["text"])  # fmt: skip
    done = time.perf_counter()
    tokens = sum(len(ids) for batch in tokenized.iter(10_000) for ids in batch["input_ids"])
    return {
        "tokens": tokens,
        "documents": len(tokenized),
        "load_s": loaded - start,
        "tokenize_s": done - loaded,
    }


_tokenizer = None


def _load(tokenizer_dir: str) -> None:
    from automodel.data.sft import load_tokenizer

    global _tokenizer
    _tokenizer = load_tokenizer(tokenizer_dir)


def _encode(line: str) -> list[int]:
    return _tokenizer(line.rstrip("\n"))["input_ids"] + [_tokenizer.eos_token_id]


def run_megatron_style(corpus: Path, work: Path, tokenizer_dir: str) -> dict:
    import multiprocessing

    import numpy as np

    def lines():
        for file in sorted(corpus.glob("*.txt")):
            with open(file, encoding="utf-8") as f:
                yield from f

    start = time.perf_counter()
    tokens = documents = 0
    with (
        multiprocessing.get_context("fork").Pool(2, _load, (tokenizer_dir,)) as pool,
        open(work / "m.bin", "wb") as ids,
        open(work / "m.idx", "wb") as offsets,
    ):
        for encoded in pool.imap(_encode, lines(), 32):
            ids.write(np.asarray(encoded, np.uint16).tobytes())
            tokens += len(encoded)
            documents += 1
            offsets.write(np.int64(tokens).tobytes())
    return {"tokens": tokens, "documents": documents, "tokenize_s": time.perf_counter() - start}


RUNNERS = {"automodel": run_automodel, "datasets.map": run_datasets_map, "megatron-style": run_megatron_style}


def child(path: str, corpus: Path, work: Path, tokenizer_dir: str) -> None:
    with PeakMemory() as memory:
        result = RUNNERS[path](corpus, work, tokenizer_dir)
    print(json.dumps({**result, "peak_bytes": memory.peak}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="automodel bench tokenize", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", type=float, nargs="+", default=[0.1, 0.5, 1.0], help="corpus sizes in GB (1e9 bytes)"
    )
    parser.add_argument(
        "--baselines", type=float, nargs="*", default=[0.1, 1.0], help="sizes the other paths run at"
    )
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], Path(args.child[1]), Path(args.child[2]), args.child[3])
        return 0
    print(f"{'path':15} {'GB':>5} {'docs':>10} {'tokens':>13} | {'seconds':>8} {'MB/s':>6} {'Mtok/s':>6} | "
          f"{'peak RSS':>9} | detail")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            corpus = Path(tmp) / f"corpus-{size}"
            make_corpus(corpus, int(size * 1e9))
            nbytes = sum(p.stat().st_size for p in corpus.glob("*.txt"))
            tokenizer_dir = Path(tmp) / "tokenizer"
            if not tokenizer_dir.exists():  # one tokenizer for every size (the corpus repeats one block)
                make_tokenizer(corpus, tokenizer_dir)
            for path in args.paths:
                if path != "automodel" and size not in args.baselines:
                    continue
                work = Path(tmp) / f"work-{path}-{size}"
                work.mkdir()
                env = {**os.environ, "TOKENIZERS_PARALLELISM": "true"}
                done = subprocess.run([sys.executable, "-m", "automodel.benchmarks.tokenize", "--child", path,
                                       str(corpus), str(work), str(tokenizer_dir)], capture_output=True, text=True,
                                      env=env)  # fmt: skip
                if done.returncode != 0:
                    print(done.stdout[-2000:], done.stderr[-3000:], file=sys.stderr)
                    return 1
                r = json.loads(done.stdout.strip().splitlines()[-1])
                seconds = sum(v for k, v in r.items() if k.endswith("_s"))
                detail = f"load avg {os.getloadavg()[0]:.1f}; " + ", ".join(
                    f"{k[:-2]} {v:.1f} s" for k, v in r.items() if k.endswith("_s")
                )
                if "packs" in r:
                    detail += f", {r['packs']:,} packs of {PACK}"
                print(f"{path:15} {nbytes / 1e9:5.2f} {r['documents']:>10,} {r['tokens']:>13,} | {seconds:8.1f} "
                      f"{nbytes / 1e6 / seconds:6.1f} {r['tokens'] / 1e6 / seconds:6.2f} | "
                      f"{r['peak_bytes'] / 2**20:6.0f} MiB | {detail}", flush=True)  # fmt: skip
                subprocess.run(["rm", "-rf", str(work)])
            subprocess.run(["rm", "-rf", str(corpus)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
