"""Validation and LoRA under two gloo ranks equal one process (one torchrun launch)."""

import pytest
from torchrun import run_torchrun


@pytest.mark.distributed
def test_validation_reduction_and_lora_under_two_ranks():
    result = run_torchrun(["tests/functional/workers/lora_validation_worker.py"], nproc=2, timeout=180)
    assert result.returncode == 0 and "all checks passed" in result.stdout, result.stdout[-4000:]
