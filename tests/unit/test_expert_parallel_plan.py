"""``parallel.ep_size`` at setup: the plan read from transformers' MoE classes (no family named
here beyond the configs built), and the refusals, each one line naming the key. The distributed
runs are in tests/functional/test_expert_parallel.py."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from automodel.distributed.parallel import ParallelConfig, init_distributed
from automodel.models import ModelSpec
from automodel.models.expert_parallel import check_expert_parallel, expert_parallel_checks, expert_plan

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, vocab_size=64)  # fmt: skip
MOE = {
    "qwen3_moe": dict(num_experts=6, moe_intermediate_size=16, decoder_sparse_step=1),
    "mixtral": dict(num_local_experts=6),
    "olmoe": dict(num_experts=6),
}


def meta_model(model_type: str, **fields):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **TINY, **fields))


@pytest.mark.parametrize("model_type", sorted(MOE))
def test_the_plan_lists_every_layers_experts_and_their_number(model_type):
    plan = expert_plan(meta_model(model_type, **MOE[model_type]))
    assert plan.num_experts == 6
    assert plan.modules == ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")
    assert sorted(n for n, style in plan.rules.items() if style == "grouped_gemm") == [
        f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("down_proj", "gate_up_proj")
    ]
    assert check_expert_parallel(meta_model(model_type, **MOE[model_type]), 3) == plan


def test_a_dense_model_is_refused_naming_the_key():
    with pytest.raises(
        ValueError, match=r"^parallel.ep_size=2: llama \(LlamaForCausalLM\) has no experts to split"
    ):
        check_expert_parallel(meta_model("llama"), 2)
    assert expert_plan(meta_model("llama")) is None


def test_an_ep_size_that_does_not_divide_the_experts_is_refused_with_the_sizes_that_do():
    with pytest.raises(
        ValueError,
        match=r"^parallel.ep_size=4 must divide the 6 experts of each MoE layer of qwen3_moe; use ep_size in "
        r"\[1, 2, 3, 6\]",
    ):
        check_expert_parallel(meta_model("qwen3_moe", **MOE["qwen3_moe"]), 4)


def test_ep_size_one_needs_no_plan():
    assert check_expert_parallel(meta_model("llama"), 1) is None


def test_compile_under_expert_parallelism_is_refused_naming_both_keys():
    spec = ModelSpec(config={"model_type": "qwen3_moe", **TINY, **MOE["qwen3_moe"]}, compile=True)
    with pytest.raises(ValueError, match=r"^parallel.ep_size=2 with model.compile=true is not verified yet"):
        expert_parallel_checks(spec, spec.hf_config(), 2)


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "2"])
def test_ep_size_must_be_a_positive_int(value):
    with pytest.raises(ValueError, match=rf"^parallel.ep_size must be a positive int, got {value!r}"):
        ParallelConfig(ep_size=value)


def test_an_ep_size_that_does_not_divide_the_world_is_refused_before_the_group_forms(monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(
        ValueError, match=r"^parallel.ep_size=2 must divide the world size 1 \(processes launched\)"
    ):
        init_distributed(ParallelConfig(ep_size=2))
