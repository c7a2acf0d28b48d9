"""``packing=balanced`` through the real recipe: torchrun, 2 processes, gloo on CPU.

cp_size 1: two DP ranks, each micro-batch one balanced pack with no padding (fill exactly 1).
cp_size 2: one DP rank, each pack's samples padded to multiples of 4 and sharded by
``make_cp_batch_for_te`` (TE's dual-chunk layout) for the portable all-gather attention.
"""

from __future__ import annotations

import json
import math

import pytest
from torchrun import run_torchrun


@pytest.mark.distributed
@pytest.mark.parametrize("cp_size", [1, 2])
def test_balanced_recipe_two_processes(tmp_path, cp_size):
    result = run_torchrun(
        ["-m", "automodel", "finetune", "tiny_llama_sft", "packing=balanced", "trainer.max_steps=3",
         f"parallel.cp_size={cp_size}", "trainer.export_hf=false", "trainer.progress_bar=false",
         f"trainer.output_dir={tmp_path}"],
        nproc=2,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in records), records
    if cp_size == 1:
        assert all(r["fill"] == 1.0 for r in records), records  # a balanced pack has no tail padding
    else:
        assert all(0.9 < r["fill"] < 1.0 for r in records), records  # only per-sample CP padding
