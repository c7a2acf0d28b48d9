"""``bench gpu``'s LoRA row and ``--overrides``: the recipe each case runs, and the LoRA FLOP count."""

from __future__ import annotations

import argparse

import pytest
import torch
from transformers import AutoModelForCausalLM

from automodel.benchmarks.gpu import (
    LLAMA3_1_8B,
    Case,
    case_recipe,
    length_mix,
    lora_flops_per_step,
    write_samples,
)
from automodel.training.finetune import FinetuneRecipe


def args(**extra) -> argparse.Namespace:
    return argparse.Namespace(**{"warmup": 1, "steps": 2, "profile": False, "overrides": [], **extra})


def test_the_lora_row_trains_rank_16_adapters_on_every_linear_of_the_8b_shape(tmp_path):
    data = tmp_path / "samples.jsonl"
    write_samples(data, length_mix(10, 4096))
    cfg = case_recipe(Case("llama3.1-8b", 4096, "varlen", lora=True), data, 4096, args(), tmp_path)
    assert (cfg.peft.rank, cfg.peft.target_modules, cfg.peft.quantize_base) == (16, "all-linear", None)
    assert cfg.packing.packed_sequence_size == 4096 and cfg.model.attention_backend == "varlen"
    assert dict(cfg.model.config) == {**LLAMA3_1_8B, "rope_scaling": dict(LLAMA3_1_8B["rope_scaling"])}
    recipe = FinetuneRecipe(cfg)  # every section built and checked, no model yet
    assert recipe.lora.rank == 16
    with torch.device("meta"):  # the shape has Llama 3.1 8B's published parameter count
        assert (
            AutoModelForCausalLM.from_config(recipe.model_spec.hf_config()).num_parameters() == 8_030_261_248
        )


def test_the_other_rows_have_no_adapters_and_overrides_come_last(tmp_path):
    cfg = case_recipe(
        Case("tiny", 256, "portable"), tmp_path / "s.jsonl", 128,
        args(profile=True, overrides=["model.compile=true", "optim.fused=true", "optim.warmup_steps=3"]), tmp_path,
    )  # fmt: skip
    assert cfg.get("peft") is None
    assert cfg.model.compile is True and cfg.optim.fused is True
    assert cfg.optim.warmup_steps == 3  # the bench's own warmup_steps=0 is overridden
    assert cfg.trainer.max_steps == 1 + 2 + 1  # warm-up, measured, and the profiled step


def test_lora_flops_by_hand():
    # 4 x 10 parameters x 7 real tokens
    assert lora_flops_per_step(10, {"real_tokens": 7, "label_tokens": 3}) == 280
    assert lora_flops_per_step(8_030_261_248, {"real_tokens": 4096}) == pytest.approx(1.3157e14, rel=1e-4)
