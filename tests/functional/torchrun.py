"""Launch real multi-process runs with ``torch.distributed.run`` (torchrun) for functional tests.

Usage from a test module in this folder::

    from torchrun import run_torchrun

    result = run_torchrun(["tests/functional/workers/cp_attention_worker.py", "--seed", "0"], nproc=2)
    assert result.returncode == 0, result.stdout

The rendezvous listens on 127.0.0.1 port 0, so the OS picks a free port at bind time (no race with
other tests picking the same port). Workers run with ``OMP_NUM_THREADS=1`` (several ranks share a
few cores) and with the repository root first on ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

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
