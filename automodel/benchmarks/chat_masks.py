"""Chat tokenization cost: ``automodel bench chat_masks`` (``python -m automodel.benchmarks.chat_masks``).

Tokenizes chat rows with ``tokenize_sft_dataset`` in this process (``num_proc`` none) and prints rows
and tokens per CPU second of this process (the median of ``--repeat`` runs: on a busy machine wall time
also counts waiting for a core) and the wall time, for:

- ``tiny_sft``: the 3,000 one-turn chats of the shipped set, with the tiny template's generation blocks;
- ``tiny_sft located``: the same with the blocks stripped, the mask located from the rendering;
- ``4-turn located``: 750 conversations of 4 turns each (4 rows of the set), blocks stripped;
- ``tiny_tools``: the 600 shipped tool-calling chats (tool calls, results, reasoning; no blocks).

``--no-gc`` runs with the garbage collector off, to see its share of the CPU time.

It reads only ``tokenize_sft_dataset``, ``load_tokenizer`` and ``load_sft_source``, so the same file
runs against another checkout to compare: copy it out of the package first (``cp
automodel/benchmarks/chat_masks.py /tmp/ && PYTHONPATH=<checkout> python /tmp/chat_masks.py``; run in
place, this folder's ``tokenize.py`` shadows the standard library's). A case that checkout cannot run
is printed as such.
"""

from __future__ import annotations

import argparse
import gc
import re
import statistics
import time

import datasets

from automodel.data.sft import load_tokenizer, tokenize_sft_dataset
from automodel.data.sources import load_sft_source

GENERATION_TAGS = re.compile(r"\{%-?\s*(end)?generation\s*-?%\}")


def cases() -> dict[str, tuple[datasets.Dataset, object]]:
    """name -> (rows in memory, tokenizer)."""
    marked = load_tokenizer("tiny")
    located = load_tokenizer("tiny")
    located.chat_template = GENERATION_TAGS.sub("", marked.chat_template)
    chats = load_sft_source("tiny_sft")[0]["messages"]
    turns = [[m for chat in chats[i : i + 4] for m in chat] for i in range(0, len(chats), 4)]
    found = {
        "tiny_sft": (datasets.Dataset.from_dict({"messages": chats}), marked),
        "tiny_sft located": (datasets.Dataset.from_dict({"messages": chats}), located),
        "4-turn located": (datasets.Dataset.from_dict({"messages": turns}), located),
    }
    try:
        tools = load_sft_source("tiny_tools")[0].to_dict()
        found["tiny_tools"] = (datasets.Dataset.from_dict(tools), load_tokenizer("tiny_tools"))
    except ValueError as error:  # a checkout without the tool-calling set
        print(f"tiny_tools: not run ({' '.join(str(error).split())[:100]})")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m automodel.benchmarks.chat_masks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-gc", action="store_true", help="the garbage collector off: what it costs")
    args = parser.parse_args(argv)
    if args.no_gc:
        gc.disable()
    datasets.disable_progress_bars()
    print(f"{'case':<18} {'rows':>6} {'tokens':>9} {'rows/cpu s':>11} {'tokens/cpu s':>13} {'wall s':>7}")
    for name, (rows, tokenizer) in cases().items():
        cpu, wall = [], []
        for _ in range(args.repeat):
            start, start_cpu = time.perf_counter(), time.process_time()
            try:
                out = tokenize_sft_dataset(rows, tokenizer, format="messages")
            except ValueError as error:
                print(f"{name:<18} failed: {' '.join(str(error).split())[:120]}")
                break
            cpu.append(time.process_time() - start_cpu)
            wall.append(time.perf_counter() - start)
        else:
            tokens, median = sum(len(ids) for ids in out["input_ids"]), statistics.median(cpu)
            print(f"{name:<18} {len(rows):>6,} {tokens:>9,} {len(rows) / median:>11,.0f} {tokens / median:>13,.0f} "
                  f"{statistics.median(wall):>7.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
