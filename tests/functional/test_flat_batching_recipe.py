"""VeOmni's batching modes (packing=rmpad, packing=dyn_bsz) in the real recipe, through torchrun (gloo)."""

from __future__ import annotations

import json
import math

import pytest
from torchrun import run_torchrun

FAST = ["data.split='train[:400]'", "trainer.max_steps=3", "trainer.progress_bar=false", "trainer.export_hf=false"]


@pytest.mark.distributed
@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(["packing=rmpad"], id="rmpad-dp2"),
        pytest.param(["packing=dyn_bsz", "packing.max_tokens_per_micro_batch=1024"], id="dyn_bsz-dp2"),
        pytest.param(
            ["packing=dyn_bsz", "packing.max_tokens_per_micro_batch=1024", "packing.pad_packed_input=true",
             "parallel.cp_size=2"],
            id="dyn_bsz-static-cp2",
        ),
    ],
)
def test_recipe_trains_with_veomni_batching(tmp_path, overrides):
    result = run_torchrun(
        ["-m", "automodel", "finetune", "tiny_llama_sft", f"trainer.output_dir={tmp_path}", *FAST, *overrides],
        nproc=2, timeout=90,
    )
    assert result.returncode == 0, result.stdout[-4000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in records), records
    assert all(r["label_tokens"] > 0 for r in records)
