"""Launch real multi-process runs with ``torch.distributed.run`` (torchrun) for functional tests.

Usage from a test module in this folder::

    from torchrun import run_torchrun

    result = run_torchrun(["tests/functional/workers/cp_attention_worker.py", "--seed", "0"], nproc=2)
    assert result.returncode == 0, result.stdout

Several recipe runs share one launch (process start and imports paid once) with ``run_recipes``.

The rendezvous listens on 127.0.0.1 port 0, so the OS picks a free port at bind time (no race with
other tests picking the same port). Workers run with ``OMP_NUM_THREADS=1`` (several ranks share a
few cores) and with the repository root first on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_torchrun(
    script_or_module_args: Sequence[str],
    nproc: int,
    env: Mapping[str, str] | None = None,
    timeout: float = 120.0,
) -> subprocess.CompletedProcess[str]:
    """Run ``torchrun --nproc-per-node nproc <script_or_module_args>`` from the repository root.

    Args:
        script_or_module_args: a script path and its arguments, or ``["-m", "package.module", ...]``.
        nproc: processes on this node (the world size).
        env: variables set on top of this process's environment; a ``PYTHONPATH`` given here is
            placed after the repository root.
        timeout: seconds before the whole process group is killed; then ``returncode`` is -9 and
            ``stdout`` holds the output so far.

    Returns:
        The finished process; ``stdout`` holds stdout and stderr of torchrun and every rank.
    """
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "127.0.0.1:0",
        *script_or_module_args,
    ]
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), (env or {}).get("PYTHONPATH")) if p)
    # A new session lets a timeout kill torchrun and its workers together.
    process = subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        env=child_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun puts its workers in sessions of their own: SIGTERM lets it stop them first.
        os.killpg(process.pid, signal.SIGTERM)
        try:
            output, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
        output += f"\n[run_torchrun] killed after {timeout:.0f} s: {' '.join(command)}"
    return subprocess.CompletedProcess(command, process.returncode, output, None)


def recipe_run(recipe: str, *overrides: str, expect_error: str | None = None) -> dict[str, Any]:
    """One entry of ``run_recipes``: ``automodel finetune recipe overrides...``; with ``expect_error``
    the run must stop with a ``ConfigError`` holding that text."""
    return {"recipe": recipe, "overrides": list(overrides), "expect_error": expect_error}


def run_recipes(
    runs: Mapping[str, Mapping[str, Any]], nproc: int, workdir: Path, timeout: float = 600.0
) -> dict[str, str]:
    """Run ``runs`` (name -> ``recipe_run(...)``) in order, in ONE torchrun launch of ``nproc`` processes.

    Returns:
        Each run's output: rank 0's lines from the run's start to the next run's (with whatever the
        other ranks printed meanwhile). A failed launch fails the calling test with the output's tail.
    """
    spec = Path(workdir) / "recipe_runs.json"
    spec.write_text(json.dumps(runs))
    result = run_torchrun(
        ["tests/functional/workers/recipe_runs.py", str(spec)], nproc=nproc, timeout=timeout
    )
    assert result.returncode == 0, result.stdout[-6000:]
    logs: dict[str, str] = {}
    name = None
    for line in result.stdout.splitlines(keepends=True):
        if line.startswith("RECIPE-RUN "):
            name = line.split()[1]
            logs[name] = ""
        elif name is not None:
            logs[name] += line
    assert list(logs) == list(runs), (list(logs), result.stdout[-6000:])
    return logs
