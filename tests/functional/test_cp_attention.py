"""Context-parallel attention through real torchrun runs over gloo: every rank's output and q/k/v
gradients equal the single-process result at its tokens (portable backend, and the TE backend
against the CPU stand-in of Transformer Engine)."""

from __future__ import annotations

import re

import pytest
from torchrun import REPO_ROOT, run_torchrun

WORKER = "tests/functional/workers/cp_attention_worker.py"
# Cases the worker runs on each rank: 3 portable, 3 TE comm types, check-gpu's CP rows, 1 rejected a2a layout.
PASS_LINES_PER_RANK = 8


@pytest.mark.distributed
@pytest.mark.parametrize("cp_size", [2, 4])
def test_cp_attention_matches_single_process(cp_size):
    result = run_torchrun(
        [WORKER, "--seed", str(cp_size)],
        nproc=cp_size,
        env={"PYTHONPATH": str(REPO_ROOT / "tests" / "te_standin")},
        timeout=90,
    )
    assert result.returncode == 0, result.stdout
    # Ranks share one pipe: a line can follow another without its newline, so no anchors.
    passes = re.findall(r"CP-ATTENTION PASS .*?rank=(\d+)", result.stdout)
    assert sorted(map(int, passes)) == sorted(list(range(cp_size)) * PASS_LINES_PER_RANK), result.stdout
    assert f"backend=te cp_comm_type=a2a heads={2 * cp_size}/{cp_size} cp={cp_size}" in result.stdout
