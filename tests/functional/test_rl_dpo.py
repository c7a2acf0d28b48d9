"""Per-sample log-probs from packed rows and the DPO recipe.

In one process: each family's packed per-sample log-probs (and their gradients) equal each sample
alone in eager attention. In ONE 4-rank torchrun launch (tests/functional/workers/rl_worker.py): the
same under CP 4 and under DP 2 x CP 2.
"""

from __future__ import annotations

import pytest
from torchrun import run_torchrun
from workers.rl_checks import LOGPROB_FAMILIES, check_log_probs


@pytest.mark.parametrize("family", LOGPROB_FAMILIES)
def test_packed_log_probs_equal_each_sample_alone(tmp_path, family):
    assert check_log_probs(family, tmp_path) == []


@pytest.mark.distributed
def test_log_probs_under_cp4_and_dp2_cp2(tmp_path):
    result = run_torchrun(["tests/functional/workers/rl_worker.py", "--workdir", str(tmp_path)], nproc=4, timeout=500)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "rl_worker: 0 failures" in result.stdout, result.stdout[-4000:]
