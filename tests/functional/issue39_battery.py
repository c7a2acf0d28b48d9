"""The battery of issue 39's cases, run against a source tree: ``python tests/functional/issue39_battery.py
--tree DIR [--jobs 2] [--only ID ...] [--json OUT]``. Each case runs ``python -m automodel`` (``DIR``
first on ``PYTHONPATH``) as a user would, in a scratch directory, and is classified:

- ``clear``: the intended answer, one line naming the field (or, for the cases meant to go on, the run
  going on with its warning), before any tokenizing or packing;
- ``late``: named, but after the data work (tokenizing, packing);
- ``opaque``: a traceback, or a message that names the wrong thing or gives a wrong fix;
- ``silent-wrong``: exit 0 (or lost work) without a word;
- ``hang``: no answer within the case's timeout.

docs/bad-inputs.md holds the table: each case as the issue reports it on 4c87eea (:data:`REPORTED`)
and as this script finds it on the branch (``--markdown AFTER.json``; ``--markdown BEFORE.json
AFTER.json`` compares two runs).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

FAST = [
    "data.split='train[:64]'",
    "packing.packed_sequence_size=256",
    "trainer.progress_bar=false",
    "trainer.export_hf=false",
    "trainer.max_steps=3",
]
DATA_WORK = ("tokenized ", "pack_dataset:")  # log lines of the data work
HANG_S = 240


@dataclass
class Outcome:
    code: int | None  # None: timed out
    output: str
    extra: dict = field(default_factory=dict)


@dataclass
class Case:
    id: str
    item: int
    what: str
    command: str  # as a user would type it (scratch paths shortened)
    expect: str  # the text of the intended answer
    kind: str = "refuse"  # refuse: stop naming it; proceed: go on, saying it; custom: judge(outcome)
    run: Callable[[Path, Path], Outcome] | None = None
    judge: Callable[[Outcome], str] | None = None


def as_from_a_terminal() -> None:
    """In the child: Ctrl-C's default action, as a terminal gives it (a battery started in the
    background has SIGINT ignored, which its children inherit, and a run keeps an ignored signal)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def python(
    tree: Path, args: list[str], work: Path, env: dict | None = None, timeout: float = HANG_S
) -> Outcome:
    environment = {**os.environ, "PYTHONPATH": str(tree), "AUTOMODEL_CACHE": str(work / "cache"),
                   "OMP_NUM_THREADS": "1", **(env or {})}  # fmt: skip
    process = subprocess.Popen([sys.executable, *args], cwd=work, env=environment, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               preexec_fn=as_from_a_terminal)  # fmt: skip
    try:
        output, _ = process.communicate(timeout=timeout)
        return Outcome(process.returncode, output)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return Outcome(None, output)


def finetune(*overrides: str, recipe: str = "tiny_llama_sft", fast: list[str] = FAST, setup=None, **kwargs):
    """``automodel finetune recipe FAST overrides`` ("{work}" in an override: the scratch directory),
    after ``setup(work)``."""

    def run(tree: Path, work: Path) -> Outcome:
        if setup is not None:
            setup(work)
        args = [o.replace("{work}", str(work)) for o in overrides]
        return python(tree, ["-m", "automodel", "finetune", recipe, *fast, f"trainer.output_dir={work / 'run'}",
                             *args], work, **kwargs)  # fmt: skip

    return run


def classify(case: Case, outcome: Outcome) -> str:
    if outcome.code is None:
        return "hang"
    if case.judge is not None:
        return case.judge(outcome)
    text, late = outcome.output, any(marker in outcome.output for marker in DATA_WORK)
    if case.kind == "proceed":
        if outcome.code == 0:
            return "clear" if case.expect in text else "silent-wrong"
        return "opaque"
    if "Traceback" in text:
        return "late" if late and case.expect in text else "opaque"
    if outcome.code == 0:
        return "silent-wrong"
    if case.expect not in text:
        return "opaque"
    return "late" if late else "clear"


# ---- fixtures made in the scratch directory, with the tree's own code where the format is the tree's ---------

TINY = ("from transformers import AutoConfig, AutoModelForCausalLM\nfrom automodel.config import load_recipe\n"
        "fields = dict(load_recipe('tiny_llama_sft').model.config)\n"
        "model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop('model_type'), **fields))\n")  # fmt: skip


def checkpoint(work: Path, tree: Path, change: str = "") -> Path:
    """The recipe's tiny Llama saved by save_pretrained, then ``change`` (Python, ``d`` the directory)."""
    script = (TINY + f"d = {str(work / 'checkpoint')!r}\nmodel.save_pretrained(d)\n"
              "import json, torch, safetensors.torch\n" + change)  # fmt: skip
    python(tree, ["-c", script], work)
    return work / "checkpoint"


def with_checkpoint(change: str, *overrides: str) -> Callable[[Path, Path], Outcome]:
    def run(tree: Path, work: Path) -> Outcome:
        path = checkpoint(work, tree, change)
        return finetune("model=hf_checkpoint", f"model.pretrained_path={path}", *overrides)(tree, work)

    return run


REWRITE = "f = d + '/model.safetensors'\nt = safetensors.torch.load_file(f)\n{}\nsafetensors.torch.save_file(t, f, metadata={{'format': 'pt'}})\n"
CONFIG = "c = json.load(open(d + '/config.json'))\n{}\njson.dump(c, open(d + '/config.json', 'w'))\n"

PLANT = """
import glob, json, os, sys
import automodel.models.support as support
from automodel.config import load_recipe
from automodel.models.setup import config_checks
from automodel.models.verify import Verdict, backends_for
from automodel.training.run import recipe_class
cfg = load_recipe("tiny_llama_sft", sys.argv[2:])
recipe = recipe_class(cfg)(cfg)
if sys.argv[1] == "stand-in":  # where the cache keeps this config's verdict: one stand-in acceptance written there
    support.verify_config = lambda *a, **k: Verdict("verified", backends=backends_for([]), max_error=0.0)
sample_tokens, row_tokens = recipe.batching.length_bounds(recipe.data.max_length, 1)
config_checks(recipe.model_spec, cp_size=1, max_sample_tokens=sample_tokens, row_tokens=row_tokens)
print(max(glob.glob(os.environ["AUTOMODEL_CACHE"] + "/exactness/*.json"), key=os.path.getmtime))
"""


def planted(content: str | None, *overrides: str, copy_real: bool = False, fifo: bool = False):
    """The cache entry of the run's config replaced by ``content`` (or a real llama verdict, or a FIFO)."""

    def run(tree: Path, work: Path) -> Outcome:
        fast = [o for o in FAST]
        real = None
        if copy_real:
            lines = python(tree, ["-c", PLANT, "real", *fast], work).output.strip().splitlines()
            real = Path(lines[-1]).read_text()
        path = Path(
            python(tree, ["-c", PLANT, "stand-in", *fast, *overrides], work).output.strip().splitlines()[-1]
        )
        path.unlink()
        if fifo:
            os.mkfifo(path)
        else:
            path.write_text(real if copy_real else content)
        return finetune(*overrides)(tree, work)

    return run


def sigterm_after_step_6(tree: Path, work: Path) -> Outcome:
    environment = {**os.environ, "PYTHONPATH": str(tree), "AUTOMODEL_CACHE": str(work / "cache")}
    process = subprocess.Popen(
        [sys.executable, "-m", "automodel", "finetune", "tiny_llama_sft", *FAST[:-1], "trainer.max_steps=16",
         "trainer.checkpoint_every=4", f"trainer.output_dir={work / 'run'}"],
        cwd=work, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    lines = []
    for line in process.stdout:
        lines.append(line)
        if "step 6/16" in line:
            process.send_signal(signal.SIGTERM)
    process.wait()
    steps = [int(p.name[5:]) for p in (work / "run" / "checkpoints").glob("step_????????")]
    return Outcome(process.returncode, "".join(lines), {"newest": max(steps, default=0)})


def judge_sigterm(outcome: Outcome) -> str:
    if outcome.code == 143 and outcome.extra["newest"] >= 6 and "written" in outcome.output:
        return "clear"
    return "silent-wrong" if outcome.extra["newest"] < 6 else "opaque"


INTERRUPTED_WRITE = """
import os, signal, sys
import torch.distributed.checkpoint.filesystem as filesystem
from automodel.cli import main
real, calls = os.fsync, []
def fsync(fd):
    calls.append(fd)
    if len(calls) == 1:
        os.kill(os.getpid(), signal.SIGINT)
    return real(fd)
filesystem.os = type(os)("os_with_a_ctrl_c")
filesystem.os.__dict__.update(os.__dict__, fsync=fsync)
sys.exit(main(sys.argv[1:]))
"""


def ctrl_c_in_checkpoint_write(tree: Path, work: Path) -> Outcome:
    script = work / "interrupted_write.py"
    script.write_text(INTERRUPTED_WRITE)
    return python(tree, [str(script), "finetune", "tiny_llama_sft", *FAST[:-1], "trainer.max_steps=8",
                         "trainer.checkpoint_every=4", f"trainer.output_dir={work / 'run'}"], work)  # fmt: skip


def judge_ctrl_c_write(outcome: Outcome) -> str:
    if "bytes and" in outcome.output or "Traceback" in outcome.output:
        return "opaque"
    return "clear" if outcome.code == 130 else "silent-wrong"


def ctrl_c_while_tokenizing(tree: Path, work: Path) -> Outcome:
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
    os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(HANG_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        reader.join(5)
        return Outcome(None, "".join(lines))
    reader.join(5)
    return Outcome(process.returncode, "".join(lines))


def judge_ctrl_c_tokenizing(outcome: Outcome) -> str:
    if any(t in outcome.output for t in ("Traceback", "TimeoutError")):
        return "opaque"
    return "clear" if outcome.code == 130 else "silent-wrong"


def torchrun(tree: Path, work: Path, args: list[str], launcher: list[str] | None = None, **kwargs) -> Outcome:
    launcher = launcher or ["-m", "torch.distributed.run"]
    return python(tree, [*launcher, "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                         "127.0.0.1:0", *args], work, **kwargs)  # fmt: skip


def automodel_under_torchrun(tree: Path, work: Path, args: list[str]) -> Outcome:
    """``automodel torchrun ... ARGS`` where the tree has it, else ``torchrun ... -m automodel ARGS``
    (what a user had)."""
    if "def _torchrun" in (tree / "automodel" / "cli.py").read_text():
        return torchrun(tree, work, args, launcher=["-m", "automodel", "torchrun"])
    return torchrun(tree, work, ["-m", "automodel", *args])


def cp_alignment(tree: Path, work: Path) -> Outcome:
    return automodel_under_torchrun(tree, work, ["finetune", "tiny_llama_sft", *FAST, "parallel.cp_size=2",
                                                 "packing.packed_sequence_size=258",
                                                 f"trainer.output_dir={work / 'run'}"])  # fmt: skip


def input_error_under_torchrun(tree: Path, work: Path) -> Outcome:
    args = ["finetune", "tiny_llama_sft", *FAST, "optim.lr=-1", f"trainer.output_dir={work / 'run'}"]
    return automodel_under_torchrun(tree, work, args)


def judge_input_error_under_torchrun(outcome: Outcome) -> str:
    once = outcome.output.count("optim.lr must be a finite positive number") == 1
    clean = "Traceback" not in outcome.output and "ChildFailedError" not in outcome.output
    return "clear" if once and clean and outcome.code == 2 else "opaque"


def never_joins(tree: Path, work: Path) -> Outcome:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    return finetune("parallel.timeout_minutes=0.1", env=env)(tree, work)


def frozen_peer(tree: Path, work: Path) -> Outcome:
    import psutil

    environment = {**os.environ, "PYTHONPATH": str(tree), "AUTOMODEL_CACHE": str(work / "cache"),
                   "OMP_NUM_THREADS": "1"}  # fmt: skip
    process = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", "127.0.0.1:0", "-m", "automodel", "finetune", "tiny_llama_sft", *FAST[:-1],
         "trainer.max_steps=50", "parallel.timeout_minutes=1", f"trainer.output_dir={work / 'run'}"],
        cwd=work, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    lines, frozen, started = [], None, time.monotonic()
    for line in process.stdout:
        lines.append(line)
        if "step 3/50" in line and frozen is None:
            workers = psutil.Process(process.pid).children(recursive=True)
            frozen = next(p for p in workers if p.environ().get("RANK") == "1")
            frozen.suspend()
            started = time.monotonic()
        if frozen is not None and time.monotonic() - started > HANG_S:
            break
    with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):  # torchrun may have ended them first
        if frozen is not None:
            frozen.kill()
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    return Outcome(process.returncode, "".join(lines))


def judge_frozen_peer(outcome: Outcome) -> str:
    if "rank(s) [1] did not answer" in outcome.output:
        return "clear"
    return "opaque" if "Traceback" in outcome.output else "hang"


def source(content: bytes, name: str = "data.jsonl", *overrides: str):
    def run(tree: Path, work: Path) -> Outcome:
        (work / name).write_bytes(content)
        return finetune(f"data.source={work / name}", *overrides)(tree, work)

    return run


def recipe_file(text: str):
    def run(tree: Path, work: Path) -> Outcome:
        (work / "recipe.yaml").write_text(text)
        return python(tree, ["-m", "automodel", "finetune", str(work / "recipe.yaml")], work)

    return run


def tokenizer_without_vocabulary(tree: Path, work: Path) -> Outcome:
    shutil.copytree(tree / "automodel" / "assets" / "tiny_tokenizer", work / "tokenizer")
    (work / "tokenizer" / "tokenizer.json").unlink()
    return finetune(f"data.tokenizer={work / 'tokenizer'}")(tree, work)


def read_only_hf_home(tree: Path, work: Path) -> Outcome:
    (work / "data.csv").write_text(
        "prompt,completion\n" + "".join(f"{i} plus 1?, {i + 1}\n" for i in range(64))
    )
    return finetune(f"data.source={work / 'data.csv'}", env={"HF_HOME": "/sys/kernel/automodel_hf"})(
        tree, work
    )


NESTED = json.dumps({"prompt": "a", "completion": " b"}) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n"

CASES = [
    # 1. the exactness cache
    Case("cache-planted", 1, "a planted {\"status\": \"verified\"} under a Jamba's name",
         "echo '{\"status\": \"verified\"}' > <cache entry>; automodel finetune ... model.config.model_type=jamba",
         "is refused on the THD path", run=planted('{"status": "verified"}', "model.config.model_type=jamba")),
    Case("cache-copied", 1, "a real llama verdict copied under a Jamba's name", "cp <llama entry> <jamba entry>",
         "is refused on the THD path", run=planted(None, "model.config.model_type=jamba", copy_real=True)),
    *(Case(f"cache-{name}", 1, f"{content} as the entry", f"echo '{content}' > <cache entry>", "ignored",
           kind="proceed", run=planted(content)) for name, content in
      (("list", "[]"), ("object", "{}"), ("string", '"verified"'))),
    Case("cache-refusal", 1, "a planted refusal under a valid config's name",
         "echo '{\"status\": \"refused\", ...}' > <cache entry>", "ignored", kind="proceed",
         run=planted('{"status": "refused", "reason": "planted"}')),
    Case("cache-fifo", 1, "a FIFO as the entry", "mkfifo <cache entry>", "not a regular file", kind="proceed",
         run=planted(None, fifo=True)),
    # 2. checkpoints
    Case("gemma-over-llama", 2, "config.json's model_type gemma over Llama weights",
         "model=hf_checkpoint model.pretrained_path=<llama with model_type: gemma>", "says model_type 'gemma'",
         run=with_checkpoint(CONFIG.format("c['model_type'] = 'gemma'"))),
    # 3. runs that cannot learn
    Case("eps", 3, "optim.eps=1e30", "optim.eps=1e30", "nothing can be learned", run=finetune("optim.eps=1e30")),
    Case("rms-norm-eps", 3, "model.config.rms_norm_eps=1e30", "model.config.rms_norm_eps=1e30",
         "nothing can be learned", run=finetune("model.config.rms_norm_eps=1e30")),
    Case("warmup", 3, "optim.warmup_steps=1e12, max_steps 3", "optim.warmup_steps=1000000000000",
         "nothing can be learned", run=finetune("optim.warmup_steps=1000000000000")),
    Case("dpo-beta", 3, "dpo.beta=1e-30", "automodel finetune tiny_llama_dpo dpo.beta=1e-30", "nothing can be learned",
         run=finetune("dpo.beta=1e-30", recipe="tiny_llama_dpo", fast=["data.split='train[:64]'", "trainer.max_steps=2",
                                                                      "trainer.progress_bar=false", "trainer.export_hf=false"])),
    Case("lora-alpha", 3, "peft.alpha=1e-30", "+peft=lora peft.alpha=1e-30", "nothing can be learned",
         run=finetune("+peft=lora", "peft.alpha=1e-30")),
    # 4. signals
    Case("sigterm", 4, "kill -TERM after step 6 of 16 (checkpoint_every 4)", "trainer.max_steps=16 trainer.checkpoint_every=4; kill -TERM",
         "written", kind="custom", run=sigterm_after_step_6, judge=judge_sigterm),
    Case("ctrl-c-checkpoint", 4, "Ctrl-C while DCP writes a checkpoint", "SIGINT inside DCP's write",
         "", kind="custom", run=ctrl_c_in_checkpoint_write, judge=judge_ctrl_c_write),
    Case("ctrl-c-tokenizing", 4, "Ctrl-C while tokenizing (data.num_proc=2)", "kill -INT -<process group> while tokenizing",
         "", kind="custom", run=ctrl_c_while_tokenizing, judge=judge_ctrl_c_tokenizing),
    # 5. hangs
    Case("layers", 5, "num_hidden_layers=1e12", "model.config.num_hidden_layers=1000000000000", "num_hidden_layers=1000000000000",
         run=finetune("model.config.num_hidden_layers=1000000000000")),
    Case("pack-1e12", 5, "packed_sequence_size=1e12", "packing.packed_sequence_size=1000000000000",
         "1000000000000 tokens", run=finetune("packing.packed_sequence_size=1000000000000")),
    Case("pack-1e8", 5, "packed_sequence_size=1e8", "packing.packed_sequence_size=100000000", "100000000 tokens",
         run=finetune("packing.packed_sequence_size=100000000")),
    Case("grad-accum", 5, "grad_accum_steps=1e12", "trainer.grad_accum_steps=1000000000000",
         "1000000000000 micro-batches", run=finetune("trainer.grad_accum_steps=1000000000000")),
    # 6. sizes, and checks that fired after the data work
    *(Case(f"size-{name}", 6, f"{name}=1e12", f"model.config.{name}=1000000000000", f"{name}=1000000000000",
           run=finetune(f"model.config.{name}=1000000000000"))
      for name in ("vocab_size", "hidden_size", "intermediate_size", "head_dim")),
    Case("lora-rank", 6, "peft.rank=1e12", "+peft=lora peft.rank=1000000000000", "peft.rank=1000000000000",
         run=finetune("+peft=lora", "peft.rank=1000000000000")),
    Case("lora-target", 6, "a LoRA target no module has", "+peft=lora peft.target_modules=[qproj]", "qproj",
         run=finetune("+peft=lora", "peft.target_modules=[qproj]")),
    Case("extra-tensor", 6, "a checkpoint tensor the model has no place for", "<checkpoint + q_norm.weight>",
         "q_norm.weight", run=with_checkpoint(REWRITE.format("t['model.layers.0.self_attn.q_norm.weight'] = torch.ones(32)"))),
    Case("nan-weight", 6, "a NaN weight in the checkpoint", "<checkpoint with one NaN>", "NaN",
         run=with_checkpoint(REWRITE.format("t['model.layers.1.mlp.down_proj.weight'][3, 5] = float('nan')"))),
    Case("cache-dir-file", 6, "packing.cache_dir that is a file", "packing.cache_dir=<a file>", "cache_dir=",
         run=finetune("packing.cache_dir={work}/a_file", setup=lambda work: (work / "a_file").write_text(""))),
    Case("cp-alignment", 6, "packed_sequence_size=258 with cp_size 2", "automodel torchrun --nproc-per-node 2 finetune ... parallel.cp_size=2 packing.packed_sequence_size=258 (torchrun -m automodel ... before)",
         "must be a multiple of", run=cp_alignment),
    # 7. wrong fixes
    Case("max-positions-0", 7, "max_position_embeddings=0", "model.config.max_position_embeddings=0", "must be at least 1",
         run=finetune("model.config.max_position_embeddings=0")),
    Case("max-positions--1", 7, "max_position_embeddings=-1", "model.config.max_position_embeddings=-1", "must be at least 1",
         run=finetune("model.config.max_position_embeddings=-1")),
    Case("value-error", 7, "a transformers validator's value error", "+model.config.layer_types=[bogus,bogus,bogus,bogus]",
         "fix that value", run=finetune("+model.config.layer_types=[bogus,bogus,bogus,bogus]")),
    Case("tokenizer-json", 7, "a tokenizer directory without tokenizer.json", "data.tokenizer=<dir without tokenizer.json>",
         "holds no tokenizer file", run=tokenizer_without_vocabulary),
    Case("hf-home", 7, "a read-only HF_HOME", "HF_HOME=/sys/kernel/x automodel finetune ... data.source=data.csv",
         "set HF_HOME", run=read_only_hf_home),
    Case("weight-decay", 7, "optim.weight_decay=1e9", "optim.weight_decay=1e9", "optim.weight_decay=1000000000.0",
         run=finetune("optim.weight_decay=1e9")),
    # 8. raw tracebacks
    Case("delete-trainer", 8, "~trainer", "~trainer", "deletes the trainer section", run=finetune("~trainer")),
    Case("pad-token", 8, "pad_token_id=99999", "+model.config.pad_token_id=99999", "pad_token_id=99999",
         run=finetune("+model.config.pad_token_id=99999")),
    Case("mix-weight", 8, "a mix weight of 1e12", "data=mix data.sources=[{source: tiny_sft, weight: 1e12}]", "data.weight=1e+12",
         run=finetune("data=mix", "data.tokenizer=tiny", "data.sources=[{source: tiny_sft, weight: 1e12}]", fast=FAST[1:])),
    Case("dtype", 8, "model.config.dtype: float8_bogus", "+model.config.dtype=float8_bogus", "float8_bogus",
         run=finetune("+model.config.dtype=float8_bogus")),
    Case("index", 8, "an index json without weight_map", "<checkpoint + model.safetensors.index.json without weight_map>",
         "has no weight_map", run=with_checkpoint("open(d + '/model.safetensors.index.json', 'w').write('{}')")),
    Case("nested-json", 8, "a JSON row nested 100,000 deep", "data.source=<jsonl with [[[[...]]]] on line 2>",
         "nested deeper", run=source(NESTED.encode())),
    Case("defaults", 8, "a defaults list with an int", "automodel finetune recipe.yaml (defaults: [model: tiny_llama, 42])",
         "defaults list", run=recipe_file("defaults:\n  - model: tiny_llama\n  - 42\n")),
    Case("timeout", 8, "parallel.timeout_minutes=1e30", "parallel.timeout_minutes=1e30", "parallel.timeout_minutes",
         run=finetune("parallel.timeout_minutes=1e30")),
    Case("never-joins", 8, "a rank that never joins", "RANK=0 WORLD_SIZE=2 MASTER_ADDR=... automodel finetune ... parallel.timeout_minutes=0.1",
         "did not all join", run=never_joins),
    Case("frozen-peer", 8, "a frozen peer (SIGSTOP of rank 1 at step 3)", "torchrun --nproc-per-node 2 ... parallel.timeout_minutes=1; kill -STOP <rank 1>",
         "", kind="custom", run=frozen_peer, judge=judge_frozen_peer),
    Case("torchrun-input-error", 8, "an input error under torchrun (prints once, exit 2)",
         "automodel torchrun --nproc-per-node 2 finetune ... optim.lr=-1 (torchrun -m automodel ... before)",
         "", kind="custom", run=input_error_under_torchrun, judge=judge_input_error_under_torchrun),
]  # fmt: skip


# Each case as issue 39 reports it on 4c87eea (its battery, before this work): the before column of the table.
REPORTED = {
    **dict.fromkeys(["cache-planted", "cache-copied", "gemma-over-llama", "eps", "rms-norm-eps", "warmup",
                     "dpo-beta", "lora-alpha", "sigterm"], "silent-wrong"),
    **dict.fromkeys(["cache-fifo", "layers", "pack-1e12", "pack-1e8", "grad-accum"], "hang"),
    **dict.fromkeys(["lora-target", "extra-tensor", "nan-weight", "cache-dir-file", "cp-alignment"], "late"),
    **dict.fromkeys(["cache-list", "cache-object", "cache-string", "cache-refusal", "ctrl-c-checkpoint",
                     "ctrl-c-tokenizing", "size-vocab_size", "size-hidden_size", "size-intermediate_size",
                     "size-head_dim", "lora-rank", "max-positions-0", "max-positions--1", "value-error",
                     "tokenizer-json", "hf-home", "weight-decay", "delete-trainer", "pad-token", "mix-weight", "dtype",
                     "index", "nested-json", "defaults", "timeout", "never-joins", "frozen-peer",
                     "torchrun-input-error"], "opaque"),
}  # fmt: skip


def run_case(case: Case, tree: Path) -> tuple[str, str, float]:
    with tempfile.TemporaryDirectory(prefix=f"battery-{case.id}-") as scratch:
        start = time.monotonic()
        outcome = case.run(tree, Path(scratch))
        seconds = time.monotonic() - start
    tail = " ".join(outcome.output.strip().splitlines()[-1:])[:300] if outcome.output.strip() else ""
    return classify(case, outcome), tail, seconds


OUTCOMES = ("clear", "late", "opaque", "silent-wrong", "hang")


def markdown(before: dict, after: dict) -> str:
    """The table of docs/bad-inputs.md: each case, its command, the outcome before and after, and the
    counts per item."""
    rows = ["| item | case | command | before | after |", "|---|---|---|---|---|"]
    for case in CASES:
        old, new = before.get(case.id, ["-"])[0], after.get(case.id, ["-"])[0]
        rows.append(f"| {case.item} | {case.what} | `{case.command.replace('|', '/')}` | {old} | {new} |")
    counts = ["| item | before | after |", "|---|---|---|"]
    for item in sorted({c.item for c in CASES}):
        ids = [c.id for c in CASES if c.item == item]
        tally = [
            ", ".join(f"{k} {n}" for k in OUTCOMES if (n := sum(r.get(i, ["-"])[0] == k for i in ids)))
            for r in (before, after)
        ]
        counts.append(f"| {item} | {tally[0]} | {tally[1]} |")
    total = [
        ", ".join(f"{k} {sum(v[0] == k for v in r.values())}" for k in OUTCOMES) for r in (before, after)
    ]
    counts.append(f"| all {len(CASES)} | {total[0]} | {total[1]} |")
    return "\n".join(rows) + "\n\n" + "\n".join(counts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, help="the source tree whose automodel to run")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only", nargs="*", help="case ids")
    parser.add_argument("--json", type=Path, help="write {case id: [outcome, last line, seconds]}")
    parser.add_argument("--markdown", nargs="+", type=Path, metavar="JSON",
                        help="print the table of [BEFORE] AFTER --json results instead of running (before: the "
                             "issue's report)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.markdown:
        results = [json.loads(path.read_text()) for path in args.markdown[-2:]]
        before = results[0] if len(results) == 2 else {case: [outcome] for case, outcome in REPORTED.items()}
        print(markdown(before, results[-1]), end="")
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
            print(f"{case.id:22} {results[case.id][0]:13} {results[case.id][2]:6.0f} s  {results[case.id][1][:120]}",
                  flush=True)  # fmt: skip
            if args.json:  # as they finish: a later case that fails keeps the ones before
                args.json.write_text(json.dumps(results, indent=1))
    counts = {
        k: sum(r[0] == k for r in results.values())
        for k in ("clear", "late", "opaque", "silent-wrong", "hang")
    }
    print(" ".join(f"{k} {v}" for k, v in counts.items()), f"of {len(results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
