"""Lose nothing on preemption (issue 39): real signals (``os.kill``) sent to real runs.

A scheduler's SIGTERM (or a first Ctrl-C) finishes the step in flight, writes a checkpoint, logs it
and exits 143 (130); the resume is bit-identical to a run never interrupted (every metric and the
sha256 of the export). A second signal stops at once. Under torchrun a signal to one rank stops every
rank after the same step. ``trainer.checkpoint_on_signal=false`` keeps the default (killed at once).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from signal_points import SIGTERM_AT
from torchrun import REPO_ROOT

from automodel.training.metrics import read_metrics

FAST = [
    "data.split='train[:64]'",
    "packing.packed_sequence_size=256",
    "trainer.progress_bar=false",
    "trainer.max_steps=16",
    "trainer.checkpoint_every=4",
]


def as_from_a_terminal() -> None:
    """In the child before it starts: Ctrl-C's default action, as a terminal gives it (a shell starts
    background jobs, pytest's included, with SIGINT ignored, which their children inherit)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Run:
    """``automodel finetune tiny_llama_sft`` in a process of its own, its stderr read line by line."""

    def __init__(self, output_dir: Path, *overrides: str, torchrun: int = 0, base: list[str] = FAST):
        launcher = (
            ["-m", "torch.distributed.run", "--nproc-per-node", str(torchrun), "--rdzv-backend", "c10d",
             "--rdzv-endpoint", "127.0.0.1:0", "-m", "automodel"] if torchrun else ["-m", "automodel"]
        )  # fmt: skip
        self.process = subprocess.Popen(
            [sys.executable, *launcher, "finetune", "tiny_llama_sft", *base,
             f"trainer.output_dir={output_dir}", *overrides],
            cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=subprocess.STDOUT,
            stdout=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=as_from_a_terminal,
        )  # fmt: skip
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True)
        self._reader.start()

    def wait_for(self, text: str, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert self.process.poll() is None, f"ended before {text!r}:\n{self.output[-4000:]}"
            assert time.monotonic() < deadline, f"no {text!r} in {timeout} s:\n{self.output[-4000:]}"
            time.sleep(0.02)

    def finish(self, timeout: float = 600.0) -> int:
        try:
            self.process.wait(timeout)
        finally:
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGKILL)
        self._reader.join(10)
        return self.process.returncode

    @property
    def output(self) -> str:
        return "".join(self.lines)


def newest_checkpoint(output_dir: Path) -> int:
    steps = [int(p.name.removeprefix("step_")) for p in (output_dir / "checkpoints").glob("step_????????")]
    return max(steps, default=0)


def exported(output_dir: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((output_dir / "hf").glob("*.safetensors"))
    }


def steps_of(output_dir: Path) -> list[tuple]:
    return [
        (r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in read_metrics(output_dir / "metrics.jsonl")
    ]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    output_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    run = Run(output_dir)
    assert run.finish() == 0, run.output[-4000:]
    return output_dir


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_finishes_the_step_checkpoints_and_the_resume_is_bit_identical(
    tmp_path, uninterrupted, signum
):
    """``kill -TERM`` after step 6 of 16 (checkpoints every 4): was exit -15 with step 4 the newest
    checkpoint; now the step in flight ends, its checkpoint is written, exit 143 (SIGINT: 130)."""
    output_dir = tmp_path / "run"
    run = Run(output_dir)
    run.wait_for("step 6/16")
    os.kill(run.process.pid, signum)
    assert run.finish() == 128 + signum, run.output[-4000:]
    stopped = newest_checkpoint(output_dir)
    assert stopped in (6, 7), run.output[-4000:]  # the step in flight when the signal came
    name = signal.Signals(signum).name
    assert f"{name} received: finishing this step, then writing a checkpoint" in run.output
    assert (
        f"stopped by {name} after step {stopped}; checkpoint {output_dir / 'checkpoints' / f'step_{stopped:08d}'} "
        "written: run the same command to resume from it"
    ) in run.output, run.output[-4000:]
    assert "Traceback" not in run.output

    resumed = Run(output_dir)
    assert resumed.finish() == 0, resumed.output[-4000:]
    assert (
        f"resumed from {output_dir / 'checkpoints' / f'step_{stopped:08d}'} at step {stopped}"
        in resumed.output
    )
    assert steps_of(output_dir) == steps_of(uninterrupted)
    assert exported(output_dir) == exported(uninterrupted) != {}


def test_a_second_signal_stops_at_once(tmp_path):
    """SIGTERM, then Ctrl-C before the step ends: no checkpoint of the stopping step, exit 130 with one
    line (no traceback)."""
    output_dir = tmp_path / "run"
    run = Run(output_dir, "trainer.export_hf=false")
    run.wait_for("step 5/16")
    os.kill(run.process.pid, signal.SIGTERM)
    run.wait_for("SIGTERM received")
    os.kill(run.process.pid, signal.SIGINT)
    assert run.finish() == 130, run.output[-4000:]
    assert newest_checkpoint(output_dir) == 4
    assert "automodel finetune: interrupted" in run.output and "Traceback" not in run.output, run.output[
        -3000:
    ]


def test_checkpoint_on_signal_false_stops_at_once(tmp_path):
    """Was killed by the signal's default action: exit -15, no word."""
    output_dir = tmp_path / "run"
    run = Run(output_dir, "trainer.export_hf=false", "trainer.checkpoint_on_signal=false")
    run.wait_for("step 5/16")
    os.kill(run.process.pid, signal.SIGTERM)
    assert run.finish() == 143, run.output[-4000:]
    assert newest_checkpoint(output_dir) == 4
    assert "automodel finetune: stopped by SIGTERM; nothing half-written is left" in run.output, run.output[
        -4000:
    ]
    assert "Traceback" not in run.output


def test_under_torchrun_a_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """SIGTERM to rank 1 alone: the flag all-reduced at each step boundary stops rank 0 too, after the
    same step, and both write that checkpoint (it needs every rank's shards); the resume finishes."""
    output_dir = tmp_path / "run"
    run = Run(output_dir, "trainer.export_hf=false", torchrun=2)
    run.wait_for("step 5/16")
    workers = psutil.Process(run.process.pid).children(recursive=True)
    (rank_1,) = [p for p in workers if p.environ().get("RANK") == "1"]
    rank_1.send_signal(signal.SIGTERM)
    run.finish()
    stopped = newest_checkpoint(output_dir)
    assert stopped in (5, 6), run.output[-4000:]
    meta = json.loads((output_dir / "checkpoints" / f"step_{stopped:08d}" / "meta.json").read_text())
    assert (meta["step"], meta["world_size"]) == (stopped, 2)
    # rank 0 prints the run's warnings; both ranks stopped after that step with SIGTERM's code
    assert run.output.count(f"stopped by SIGTERM after step {stopped}") == 1, run.output[-4000:]
    # the rank that exits last may get torchrun's own SIGTERM (-15) on its way out, after its line
    codes = re.findall(r"exitcode\s*: (-?\d+)", run.output)
    assert "143" in codes and set(codes) <= {"143", "-15"}, run.output[-4000:]

    resumed = Run(output_dir, "trainer.export_hf=false", torchrun=2)
    assert resumed.finish() == 0, resumed.output[-4000:]
    assert [r[0] for r in steps_of(output_dir)] == list(range(1, 17))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_tokenizing_is_one_line_not_a_multiprocess_traceback(tmp_path, signum):
    """The terminal's Ctrl-C reaches the whole process group: each ``data.num_proc`` worker printed a
    KeyboardInterrupt traceback and the run ended in datasets' ``multiprocess`` TimeoutError (or hung).
    A scheduler's SIGTERM of the group ended it with exit -15 and no word (and, once this process
    handled it, a worker killed holding the task queue's lock left the pool's cleanup waiting forever)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i} " + "hello world " * 20 + "\n" for i in range(300_000)))
    text = ["data=text", f"data.source={corpus}", "data.tokenizer=tiny", "data.num_proc=2"]
    run = Run(tmp_path / "run", *text, base=[o for o in FAST if not o.startswith("data.")])
    root = psutil.Process(run.process.pid)
    deadline = time.monotonic() + 600
    while len(root.children(recursive=True)) < 3:  # the pool's 2 workers and its queue manager: tokenizing
        assert run.process.poll() is None and time.monotonic() < deadline, run.output[-4000:]
        time.sleep(0.02)
    time.sleep(0.5)
    os.killpg(run.process.pid, signum)  # as a terminal, or a scheduler, does
    assert run.finish(timeout=120) == 128 + signum, run.output[-4000:]
    what = "interrupted" if signum == signal.SIGINT else "stopped by SIGTERM"
    assert f"automodel finetune: {what} (while tokenizing)" in run.output, run.output[-4000:]
    for text in ("Traceback", "TimeoutError", "KeyboardInterrupt"):
        assert text not in run.output, run.output[-4000:]


DCP_WRITE_INTERRUPTED = """
import os, signal, sys
import torch.distributed.checkpoint.filesystem as filesystem
from automodel.cli import main

real_fsync, calls = os.fsync, []


def fsync(fd):  # the terminal's Ctrl-C arrives while DCP writes the first checkpoint's shards
    calls.append(fd)
    if len(calls) == {call}:
        os.kill(os.getpid(), signal.SIGINT)
    return real_fsync(fd)


filesystem.os = type(os)("os_with_a_ctrl_c")
filesystem.os.__dict__.update(os.__dict__, fsync=fsync)
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("on_signal", ["true", "false"])
def test_ctrl_c_during_a_checkpoint_write_is_not_reported_as_a_full_disk(tmp_path, on_signal):
    """Was "could not write the checkpoint ... needs 306,288,936 bytes and 56,293,810,176 are free".
    With checkpoint_on_signal (default) the write completes and the run stops after it; without, the
    write is abandoned (no partial checkpoint) and the run ends as interrupted."""
    script = tmp_path / "interrupted_write.py"
    script.write_text(DCP_WRITE_INTERRUPTED.replace("{call}", "1"))
    output_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, str(script), "finetune", "tiny_llama_sft", *FAST, "trainer.export_hf=false",
         f"trainer.output_dir={output_dir}", f"trainer.checkpoint_on_signal={on_signal}"],
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True, text=True,
        timeout=900, preexec_fn=as_from_a_terminal,
    )  # fmt: skip
    assert result.returncode == 130, result.stderr[-4000:]
    assert "bytes" not in result.stderr and "free space" not in result.stderr, result.stderr[-4000:]
    assert "Traceback" not in result.stderr, result.stderr[-4000:]
    assert not list((output_dir / "checkpoints").glob("*.tmp"))
    if on_signal == "true":
        assert newest_checkpoint(output_dir) == 4, result.stderr[-4000:]
        assert "stopped by SIGINT after step 4" in result.stderr
    else:
        assert newest_checkpoint(output_dir) == 0
        assert "automodel finetune: interrupted (the checkpoint of step 4 was not written)" in result.stderr


@pytest.mark.parametrize("where", ["setup", "export", "tokenize"])
def test_a_sigterm_outside_the_training_loop_is_one_line_and_leaves_no_staging(tmp_path, where):
    """Was exit -15 with no word, and the export's ``hf.tmp/`` or ``automodel tokenize``'s
    ``<output>.tmp-<pid>/`` left behind."""
    script = tmp_path / "sigterm_at.py"
    script.write_text(SIGTERM_AT)
    output_dir = tmp_path / "run"
    finetune = [
        "finetune",
        "tiny_llama_sft",
        *FAST[:3],
        "trainer.max_steps=1",
        f"trainer.output_dir={output_dir}",
    ]
    if where == "tokenize":
        corpus = tmp_path / "corpus.txt"
        corpus.write_text(
            "".join(f"line {i} " + "hello world " * 20 + "\n" for i in range(30_000))
        )  # 3 batches
        point, command = (
            "automodel.data.token_files._encode_batch@2",
            ["tokenize", str(corpus), str(tmp_path / "tok")],
        )
    else:
        point = ("automodel.training.finetune:FinetuneRecipe._learning_checks@1" if where == "setup"
                 else "automodel.models.hf_io:_SafetensorsFile.write@2")  # fmt: skip
        command = finetune
    result = subprocess.run(
        [sys.executable, str(script), point, *command], cwd=REPO_ROOT, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}, timeout=600,
    )  # fmt: skip
    assert result.returncode == 143, result.stderr[-4000:]
    name = "tokenize" if where == "tokenize" else "finetune"
    assert f"automodel {name}: stopped by SIGTERM; nothing half-written is left" in result.stderr, (
        result.stderr[-4000:]
    )
    assert "Traceback" not in result.stderr, result.stderr[-4000:]
    assert sorted(p.name for p in tmp_path.glob("*tmp*")) == [], sorted(tmp_path.iterdir())
    assert not (output_dir / "hf.tmp").exists() and not (output_dir / "hf").exists()
