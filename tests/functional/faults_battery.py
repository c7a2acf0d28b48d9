"""The battery of issue 48's cases (bad inputs, signals and faults), run against a source tree:
``python tests/functional/faults_battery.py --tree DIR [--jobs 2] [--only ID ...] [--json OUT]``;
``--markdown BEFORE.json AFTER.json`` prints the table of two runs. The machinery (a case per scratch
directory, ``python -m automodel`` with ``DIR`` first on ``PYTHONPATH``, the outcomes ``clear``,
``late``, ``opaque``, ``silent-wrong``, ``hang``) is issue39_battery.py's. Run it with a Python whose
site-packages hold the dependencies but not an editable install of automodel (an editable install's
import hook wins over ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from issue39_battery import (  # noqa: E402
    CONFIG,
    FAST,
    HANG_S,
    PLANT,
    REWRITE,
    TINY,
    Case,
    Outcome,
    as_from_a_terminal,
    finetune,
    python,
    run_case,
    source,
    with_checkpoint,
)
from signal_points import SIGTERM_AT  # noqa: E402

OUTCOMES = ("clear", "late", "opaque", "silent-wrong", "hang")


def limited(
    tree: Path, args: list[str], work: Path, fsize: int | None = None, address_space: int | None = None
):
    """``python args`` under a file size limit (as a full disk refuses a write) or an address-space limit."""

    def preexec():
        as_from_a_terminal()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        if address_space is not None:
            resource.setrlimit(resource.RLIMIT_AS, (address_space, resource.getrlimit(resource.RLIMIT_AS)[1]))

    environment = {**os.environ, "PYTHONPATH": str(tree), "AUTOMODEL_CACHE": str(work / "cache"),
                   "OMP_NUM_THREADS": "1"}  # fmt: skip
    result = subprocess.run([sys.executable, *args], cwd=work, env=environment, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=preexec, timeout=HANG_S)  # fmt: skip
    return Outcome(result.returncode, result.stdout)


def corpus_text(path: Path, documents: int = 2000) -> Path:
    path.write_text("".join(f"document {i} " + "hello world " * 30 + "\n\n" for i in range(documents)))
    return path


def chat_rows(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


CHAT = [{"messages": [{"role": "user", "content": f"{i} + 1?"}, {"role": "assistant", "content": str(i + 1)}]}
        for i in range(120)]  # fmt: skip
SKIP_AND_LONG = [dict(r) for r in CHAT]
SKIP_AND_LONG[10] = {"messages": [{"role": "bot", "content": "hi"}]}
SKIP_AND_LONG[50] = {
    "messages": [{"role": "user", "content": "hi " * 300}, {"role": "assistant", "content": "1"}]
}
TRAIN_FALSE = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "red", "train": False}]}] * 8  # fmt: skip
CHAT_DATA = ["data=chat_jsonl", "data.tokenizer=tiny"]


# ---- custom runs -------------------------------------------------------------------------------------


def sigterm_at(point: str, command: str):
    """A SIGTERM sent at ``point`` (``module[:Class].function@call``) of ``finetune`` or ``tokenize``."""

    def run(tree: Path, work: Path) -> Outcome:
        (work / "sigterm_at.py").write_text(SIGTERM_AT)
        if command == "tokenize":
            args = ["tokenize", str(corpus_text(work / "corpus.txt", 8000)), str(work / "out.tokens")]
        else:
            args = [
                "finetune",
                "tiny_llama_sft",
                *FAST[:3],
                "trainer.max_steps=1",
                f"trainer.output_dir={work / 'run'}",
            ]
        outcome = python(tree, [str(work / "sigterm_at.py"), point, *args], work)
        left = sorted(str(p.relative_to(work)) for p in work.rglob("*tmp*"))
        return Outcome(outcome.code, outcome.output, {"staging": left})

    return run


def judge_signal(outcome: Outcome) -> str:
    if outcome.code == 143 and "stopped by SIGTERM" in outcome.output and not outcome.extra.get("staging"):
        return "clear" if "Traceback" not in outcome.output else "opaque"
    return (
        "silent-wrong"
        if outcome.code in (-15, 0) and "stopped by SIGTERM" not in outcome.output
        else "opaque"
    )


def sigterm_while_tokenizing(tree: Path, work: Path) -> Outcome:
    import psutil

    corpus = work / "corpus.txt"
    corpus.write_text("".join(f"line {i} " + "hello world " * 20 + "\n" for i in range(300_000)))
    environment = {**os.environ, "PYTHONPATH": str(tree), "AUTOMODEL_CACHE": str(work / "cache")}
    process = subprocess.Popen(
        [sys.executable, "-m", "automodel", "finetune", "tiny_llama_sft", "data=text", f"data.source={corpus}",
         "data.tokenizer=tiny", "data.num_proc=2", *FAST[1:], f"trainer.output_dir={work / 'run'}"],
        cwd=work, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, preexec_fn=as_from_a_terminal,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
    reader.start()
    root = psutil.Process(process.pid)
    while process.poll() is None and len(root.children(recursive=True)) < 3:
        time.sleep(0.05)
    time.sleep(0.5)
    os.killpg(process.pid, signal.SIGTERM)  # a scheduler's preemption of the job's process group
    try:
        process.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        reader.join(5)
        return Outcome(None, "".join(lines))
    reader.join(5)
    return Outcome(process.returncode, "".join(lines))


def damaged_own_checkpoint(tree: Path, work: Path) -> Outcome:
    first = finetune("trainer.max_steps=2")(tree, work)
    if first.code != 0:
        return first
    meta = work / "run" / "checkpoints" / "step_00000002" / "meta.json"
    meta.write_text(meta.read_text()[:40])
    return finetune("trainer.max_steps=2")(tree, work)


def judge_damaged_own(outcome: Outcome) -> str:
    if outcome.code == 0:
        return "silent-wrong"
    if "another run" in outcome.output or "overwrite" in outcome.output:
        return "opaque"
    return "clear" if "holds checkpoints of this run" in outcome.output else "opaque"


def cache_other_user(tree: Path, work: Path) -> Outcome:
    """A stand-in acceptance for a Jamba written where the cache keeps its verdict, then the keys
    removed: as an entry another user (another key) wrote."""
    python(tree, ["-c", PLANT, "stand-in", *FAST, "model.config.model_type=jamba"], work)
    for key in (work / "cache" / "exactness").glob(".key-*"):
        key.unlink()
    return finetune("model.config.model_type=jamba")(tree, work)


def teacher_dir(work: Path, tree: Path, change: str = "") -> Path:
    directory = work / "teacher"
    script = (TINY + f"d = {str(directory)!r}\nmodel.save_pretrained(d)\n"
              "import json, shutil, torch, safetensors.torch\nfrom automodel.assets import TINY_TOKENIZER_DIR\n"
              "for f in TINY_TOKENIZER_DIR.iterdir(): shutil.copy(f, d)\n" + change)  # fmt: skip
    python(tree, ["-c", script], work)
    return directory


def kd_with_teacher(change: str):
    def run(tree: Path, work: Path) -> Outcome:
        teacher = teacher_dir(work, tree, change)
        return finetune(f"kd.teacher={teacher}", "data.tokenizer=tiny", recipe="tiny_llama_kd")(tree, work)

    return run


def token_file_without_meta(tree: Path, work: Path) -> Outcome:
    python(
        tree,
        ["-m", "automodel", "tokenize", "tiny_corpus", str(work / "tokens"), "--txt-samples", "blocks"],
        work,
    )
    (work / "tokens" / "meta.json").unlink(missing_ok=True)
    return finetune(f"data.source={work / 'tokens'}", recipe="tiny_llama_pretrain", fast=["trainer.max_steps=1",
                    "trainer.progress_bar=false", "trainer.export_hf=false"])(tree, work)  # fmt: skip


def under_fsize(command: str):
    def run(tree: Path, work: Path) -> Outcome:
        corpus = corpus_text(work / "corpus.txt")
        if command == "tokenize":
            args = ["-m", "automodel", "tokenize", str(corpus), str(work / "out.tokens")]
        elif command == "token-cache":
            args = ["-m", "automodel", "finetune", "tiny_llama_pretrain", "trainer.max_steps=1",
                    "trainer.progress_bar=false", "trainer.export_hf=false", f"trainer.output_dir={work / 'run'}",
                    f"data.source={corpus}", f"data.cache_dir={work / 'tokens'}", "data.num_proc=null"]  # fmt: skip
        else:  # the pack cache
            args = ["-m", "automodel", "finetune", "tiny_llama_sft", *FAST, f"trainer.output_dir={work / 'run'}",
                    f"packing.cache_dir={work / 'packs'}"]  # fmt: skip
        return limited(tree, args, work, fsize=60_000 if command != "pack-cache" else 20_000)

    return run


def under_address_space(tree: Path, work: Path) -> Outcome:
    return limited(tree, ["-m", "automodel", "finetune", "tiny_llama_sft", *FAST, f"trainer.output_dir={work / 'run'}"],
                   work, address_space=10**9)  # fmt: skip


SMALL_DISK = """
import shutil, sys
from automodel.cli import main

real = shutil.disk_usage
shutil.disk_usage = lambda path: real(path)._replace(free=10**6)  # a disk with 1 MB free
sys.exit(main(sys.argv[1:]))
"""


def small_disk(tree: Path, work: Path) -> Outcome:
    (work / "small_disk.py").write_text(SMALL_DISK)
    return python(tree, [str(work / "small_disk.py"), "finetune", "tiny_llama_sft", *FAST[:3], "trainer.max_steps=2",
                         "trainer.export_hf=true", f"trainer.output_dir={work / 'run'}"], work)  # fmt: skip


def judge_small_disk(outcome: Outcome) -> str:
    if outcome.code == 0:
        return "late"  # on that disk the first checkpoint or the export fails, after the training
    if (
        "free" in outcome.output
        and "trainer.output_dir" in outcome.output
        and "Traceback" not in outcome.output
    ):
        return "late" if any(m in outcome.output for m in ("tokenized ", "pack_dataset:")) else "clear"
    return "opaque"


def call(code: str):
    """A library call (``python -c``): its error's last line must name the input."""

    def run(tree: Path, work: Path) -> Outcome:
        return python(tree, ["-c", code], work)

    return run


def judge_call(expect: str):
    def judge(outcome: Outcome) -> str:
        last = outcome.output.strip().splitlines()[-1] if outcome.output.strip() else ""
        if outcome.code == 0:
            return "silent-wrong"
        return "clear" if expect in last else "opaque"

    return judge


def corrupt_data_state(tree: Path, work: Path) -> Outcome:
    first = finetune("trainer.max_steps=2")(tree, work)
    if first.code != 0:
        return first
    data = work / "run" / "checkpoints" / "step_00000002" / "data.json"
    data.write_text("x" * len(data.read_text()))  # the size meta.json records, the content not JSON
    return finetune("trainer.max_steps=3")(tree, work)


def checkpoint_config(change: str, *overrides: str):
    return with_checkpoint(CONFIG.format(change), *overrides)


CSV_HEADER = b"prompt,completion\n"
SURROGATE = b'{"prompt": "a", "completion": " b"}\n{"prompt": "\\ud800x", "completion": " c"}\n'


def self_including(tree: Path, work: Path) -> Outcome:
    (work / "loop.yaml").write_text("defaults:\n  - loop\n  - _self_\ntrainer:\n  max_steps: 1\n")
    return python(tree, ["-m", "automodel", "finetune", str(work / "loop.yaml")], work)


KD = dict(recipe="tiny_llama_kd")
DPO_FAST = [
    "data.split='train[:64]'",
    "trainer.progress_bar=false",
    "trainer.export_hf=false",
    "trainer.max_steps=2",
]

CASES = [
    # 1. the crash in the bad-row path
    Case("skip-and-long", 1, "on_bad_row=skip, one row skipped, another longer than max_length",
         "data.on_bad_row=skip data.max_length=64 (row 11 bad, row 51 of 300 words)", "skipped 1 of 64 rows",
         kind="proceed", run=source(chat_rows(SKIP_AND_LONG), "chat.jsonl", *CHAT_DATA, "data.on_bad_row=skip",
                                    "data.max_length=64")),
    # 2. learns nothing, exit 0; the learning check's causes
    Case("loss-divisor-huge", 2, "trainer.loss_divisor=1e30", "trainer.loss_normalization=sum trainer.loss_divisor=1e30",
         "trainer.loss_divisor=1e+30", run=finetune("trainer.loss_normalization=sum", "trainer.loss_divisor=1e30")),
    Case("kd-temperature", 2, "kd.temperature=1e-30", "automodel finetune tiny_llama_kd +peft=lora kd.teacher=base kd.temperature=1e-30",
         "kd.temperature=1e-30", run=finetune("+peft=lora", "kd.teacher=base", "kd.temperature=1e-30", **KD)),
    Case("lr-tiny", 2, "optim.lr=1e-30 (was blamed on the warmup)", "optim.lr=1e-30", "because of: optim.lr=1e-30",
         run=finetune("optim.lr=1e-30")),
    Case("clip-tiny", 2, "optim.max_grad_norm=1e-30 (was blamed on the warmup)", "optim.max_grad_norm=1e-30",
         "because of: optim.max_grad_norm=1e-30", run=finetune("optim.max_grad_norm=1e-30")),
    Case("loss-divisor-tiny", 2, "trainer.loss_divisor=1e-30 (was 'lower optim.lr' at step 1)",
         "trainer.loss_normalization=sum trainer.loss_divisor=1e-30", "trainer.loss_divisor=1e-30",
         run=finetune("trainer.loss_normalization=sum", "trainer.loss_divisor=1e-30")),
    # 3. model.verify=false past the config's lengths
    *(Case(f"verify-false-{t}", 3, f"model.verify=false, {t} at 2,100-token samples",
           f"model.config.model_type={t} model.verify=false data.max_length=2100 packing.packed_sequence_size=4096",
           "model.verify=false uses the supported table's verdict",
           run=finetune(f"model.config.model_type={t}", "model.verify=false", "data.max_length=2100",
                        "packing.packed_sequence_size=4096", "model.config.max_position_embeddings=8192"))
      for t in ("deepseek_v32", "glm_moe_dsa")),
    # 4. the exactness cache
    Case("cache-other-user", 4, "an acceptance for a Jamba written with another user's key",
         "<stand-in acceptance written by another user> automodel finetune ... model.config.model_type=jamba",
         "is refused on the THD path", run=cache_other_user),
    # 5. messages that named the wrong cause
    Case("full-token-cache", 5, "a refused write under the corpus token cache", "ulimit -f 58; automodel finetune tiny_llama_pretrain data.source=corpus.txt data.cache_dir=tokens",
         "could not write the token cache entry", run=under_fsize("token-cache")),
    Case("full-tokenize-output", 5, "a refused write under automodel tokenize's OUTPUT", "ulimit -f 58; automodel tokenize corpus.txt out.tokens",
         "could not write the token file", run=under_fsize("tokenize")),
    Case("teacher-too-large", 5, "a teacher no machine holds", "kd.teacher=<config.json with intermediate_size 1e12>",
         "the teacher kd.teacher=", run=kd_with_teacher(
             "c = json.load(open(d + '/config.json')); c['intermediate_size'] = 10**12; json.dump(c, open(d + '/config.json', 'w'))")),
    Case("damaged-own-checkpoint", 5, "this run's only checkpoint damaged (meta.json cut)", "<meta.json cut>; the same command",
         "", kind="custom", run=damaged_own_checkpoint, judge=judge_damaged_own),
    Case("train-false", 5, "every assistant turn train: false", "data=chat_jsonl data.source=<train: false rows>",
         "mark no token to learn", run=source(chat_rows(TRAIN_FALSE), "chat.jsonl", *CHAT_DATA)),
    Case("max-length-1", 5, "data.max_length=1", "data.max_length=1", "data.max_length=1",
         run=finetune("data.max_length=1")),
    Case("token-file-no-meta", 5, "a token file that lost its meta.json", "automodel finetune tiny_llama_pretrain data.source=<token file without meta.json>",
         "meta.json is missing", run=token_file_without_meta),
    # 6. opaque before
    Case("collater-dict", 6, "a dict given to the collater", "packed_sequence_thd_collater({...})", "list of",
         kind="custom", run=call("from automodel.data import packed_sequence_thd_collater as c\n"
                                 "c({'input_ids': [1, 2], 'labels': [2, 3], 'position_ids': [0, 1], 'seq_lens': [2], 'seq_lens_padded': [2]})"),
         judge=judge_call("list of")),
    Case("non-ascii-key", 6, "a non-ASCII override key", "'trainér.max_steps=3'", "trainér", run=finetune("trainér.max_steps=3")),
    Case("columns-list", 6, "data.columns as a list", "data.columns=[prompt,completion]", "data.columns",
         run=finetune("data.columns=[prompt,completion]")),
    Case("split-abc", 6, "data.split='train[:abc]'", "\"data.split='train[:abc]'\"", "train[:abc]",
         run=finetune("data.split='train[:abc]'", fast=FAST[1:])),
    Case("mix-mapping", 6, "mix sources as a mapping", "data=mix data.sources={a: {source: tiny_sft}}", "data.sources",
         run=finetune("data=mix", "data.tokenizer=tiny", "data.sources={a: {source: tiny_sft}}", fast=FAST[1:])),
    Case("dpo-bfd", 6, "DPO data with packing=bfd", "automodel finetune tiny_llama_dpo packing=bfd", "use packing=preference",
         run=finetune("packing=bfd", recipe="tiny_llama_dpo", fast=DPO_FAST)),
    Case("config-json-types", 6, "a string hidden_size in a checkpoint's config.json", "<config.json hidden_size: \"128\">",
         "hidden_size", run=checkpoint_config("c['hidden_size'] = '128'")),
    Case("config-json-dtype", 6, "dtype: float8_bogus in config.json", "<config.json dtype: float8_bogus>", "float8_bogus",
         run=checkpoint_config("c['dtype'] = 'float8_bogus'")),
    Case("recipe-includes-itself", 6, "a recipe whose defaults include itself", "automodel finetune loop.yaml (defaults: [loop])",
         "loop", run=self_including),
    Case("header-only-csv", 6, "a header-only CSV", "data.source=<prompt,completion and no row>", "data.csv",
         run=source(CSV_HEADER, "data.csv")),
    Case("lone-surrogate", 6, "a lone surrogate in a JSON row", "data.source=<row 2: \\ud800>", "line 2",
         run=source(SURROGATE)),
    Case("corrupt-data-state", 6, "a corrupt data-state file", "<checkpoint's data.json cut>; resume", "data.json",
         run=corrupt_data_state),
    Case("empty-tokenizer", 6, "data.tokenizer=''", "data.tokenizer=''", "data.tokenizer=''",
         run=finetune("data.tokenizer=''")),
    Case("hidden-act", 6, "an unknown hidden_act", "+model.config.hidden_act=gelu_foo", "fix hidden_act=",
         run=finetune("+model.config.hidden_act=gelu_foo")),
    Case("address-space", 6, "ulimit -v 1 GB", "ulimit -v 976562; automodel finetune ...", "ulimit -v",
         run=under_address_space),
    # 7. signals outside the training loop
    Case("sigterm-setup", 7, "SIGTERM during setup", "kill -TERM <run> at the learning check", "", kind="custom",
         run=sigterm_at("automodel.training.finetune:FinetuneRecipe._learning_checks@1", "finetune"), judge=judge_signal),
    Case("sigterm-export", 7, "SIGTERM during the export", "kill -TERM <run> while it writes hf.tmp/", "", kind="custom",
         run=sigterm_at("automodel.models.hf_io:_SafetensorsFile.write@2", "finetune"), judge=judge_signal),
    Case("sigterm-tokenize", 7, "SIGTERM during automodel tokenize", "kill -TERM <automodel tokenize> mid-write", "",
         kind="custom", run=sigterm_at("automodel.data.token_files._encode_batch@2", "tokenize"), judge=judge_signal),
    Case("sigterm-tokenizing", 7, "SIGTERM of the group while data.num_proc=2 workers tokenize",
         "kill -TERM -<process group> while tokenizing", "stopped by SIGTERM", kind="custom",
         run=sigterm_while_tokenizing, judge=lambda o: "clear" if o.code == 143 and "stopped by SIGTERM" in o.output
         and "Traceback" not in o.output else ("hang" if o.code is None else "silent-wrong" if o.code == -15 else "opaque")),
    # 8. found late
    Case("nan-teacher", 8, "a NaN in the teacher's weights", "kd.teacher=<checkpoint with one NaN>", "NaN",
         run=kd_with_teacher(REWRITE.format("t['model.layers.1.mlp.down_proj.weight'][3, 5] = float('nan')"))),
    Case("small-disk", 8, "a disk too small for the checkpoints and export", "<1 MB free under trainer.output_dir>",
         "", kind="custom", run=small_disk, judge=judge_small_disk),
    Case("pack-cache-path", 8, "a refused write under packing.cache_dir", "ulimit -f 20; ... packing.cache_dir=packs",
         "could not write the pack cache entry", run=under_fsize("pack-cache")),
    Case("dpo-positions", 8, "DPO samples past max_position_embeddings (no bound before tokenizing: measured after)",
         "automodel finetune tiny_llama_dpo model.config.max_position_embeddings=16", "max_position_embeddings is 16",
         run=finetune("model.config.max_position_embeddings=16", recipe="tiny_llama_dpo", fast=DPO_FAST)),
]  # fmt: skip


def markdown(before: dict, after: dict) -> str:
    rows = ["| item | case | command | before | after |", "|---|---|---|---|---|"]
    for case in CASES:
        old, new = before.get(case.id, ["-"])[0], after.get(case.id, ["-"])[0]
        rows.append(f"| {case.item} | {case.what} | `{case.command.replace('|', '/')}` | {old} | {new} |")
    total = [
        ", ".join(f"{k} {sum(v[0] == k for v in r.values())}" for k in OUTCOMES) for r in (before, after)
    ]
    return "\n".join(rows) + f"\n\nall {len(CASES)}: before {total[0]}; after {total[1]}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown(*(json.loads(p.read_text()) for p in args.markdown)), end="")
        return 0
    if args.tree is None:
        parser.error("--tree is required to run the cases")
    cases = [c for c in CASES if not args.only or c.id in args.only]
    results = {}
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(run_case, case, args.tree.resolve()): case for case in cases}
        for future in concurrent.futures.as_completed(futures):
            case = futures[future]
            results[case.id] = future.result()
            print(f"{case.id:24} {results[case.id][0]:13} {results[case.id][2]:6.0f} s  {results[case.id][1][:150]}",
                  flush=True)  # fmt: skip
            if args.json:
                args.json.write_text(json.dumps(results, indent=1))
    print(" ".join(f"{k} {sum(r[0] == k for r in results.values())}" for k in OUTCOMES), f"of {len(results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
