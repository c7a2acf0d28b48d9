"""Context-parallel attention through real torchrun runs over gloo: every rank's output and q/k/v
gradients equal the single-process result at its tokens (portable backend, the varlen backend
against the CPU stand-in of torch's varlen_attn, and the TE backend against the CPU stand-in of
Transformer Engine)."""

from __future__ import annotations

import os
import re

import pytest
from torchrun import REPO_ROOT, run_torchrun

WORKER = "tests/functional/workers/cp_attention_worker.py"
# Cases the worker runs on each rank per CP group: 3 portable, check-gpu's varlen CP rows, 3 TE comm
# types, check-gpu's TE CP rows, 1 rejected a2a layout.
PASS_LINES_PER_GROUP = 9


@pytest.mark.distributed
def test_cp_attention_matches_single_process():
    """One launch of 4 ranks: CP over all 4, then over the groups [0, 1] and [2, 3]."""
    result = run_torchrun(
        [WORKER, "--seed", "4"],
        nproc=4,
        env={"PYTHONPATH": os.pathsep.join(str(REPO_ROOT / "tests" / d) for d in ("te_standin", "unit"))},
        timeout=120,
    )
    assert result.returncode == 0, result.stdout
    # Ranks share one pipe: a line can follow another without its newline, so no anchors.
    for cp_size in (4, 2):
        passes = re.findall(rf"CP-ATTENTION PASS .*?cp={cp_size} rank=(\d+)", result.stdout)
        assert sorted(map(int, passes)) == sorted(list(range(4)) * PASS_LINES_PER_GROUP), result.stdout
        assert f"backend=te cp_comm_type=a2a heads={2 * cp_size}/{cp_size} cp={cp_size}" in result.stdout
