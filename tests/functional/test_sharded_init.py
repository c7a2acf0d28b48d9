"""From-scratch init shard by shard (``automodel.models.sharded_init``): transformers' own rules per
tensor (constants exactly, random tensors with the same spread, the padding row, GPT-2's scaled
projections), and the same values at world sizes 1, 2 and 4 (torchrun, gloo, FSDP2)."""

from __future__ import annotations

import pytest
import torch
from torchrun import run_torchrun
from transformers import AutoModelForCausalLM
from workers.sharded_init_worker import CONFIGS

from automodel.models import ModelSpec
from automodel.models.build import initialized_model
from automodel.models.hf_io import model_tensors

pytestmark = pytest.mark.distributed

FAMILIES = {
    **CONFIGS,
    "gpt2": dict(model_type="gpt2", vocab_size=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2),
    "gemma2": dict(model_type="gemma2", vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_transformers_rules_per_tensor(family):
    spec = ModelSpec(config=FAMILIES[family])
    ours = initialized_model(spec, spec.hf_config(), seed=0).state_dict()
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(spec.hf_config()).state_dict()
    assert list(ours) == list(reference)
    for name, expected in reference.items():
        value = ours[name]
        if bool((expected == expected.flatten()[0]).all()):  # ones for norms, zero biases: exactly
            assert torch.equal(value, expected), name
            continue
        # random: the same spread (std within 15%: >= 1,024 values each), rows the rule zeroes zero
        assert abs(value.std() / expected.std() - 1) < 0.15, (name, value.std(), expected.std())
        assert abs(value.mean()) < 0.2 * expected.std(), name
        if expected.dim() == 2:
            zero_rows = (expected == 0).all(dim=1)
            assert torch.equal((value == 0).all(dim=1), zero_rows), name
    assert not torch.equal(ours[name], initialized_model(spec, spec.hf_config(), seed=1).state_dict()[name])


def test_the_same_values_at_every_world_size(tmp_path):
    for world in (2, 4):
        result = run_torchrun(["tests/functional/workers/sharded_init_worker.py", str(tmp_path)], nproc=world,
                              timeout=300)  # fmt: skip
        assert result.returncode == 0, result.stdout[-3000:]
    two, four = (torch.load(tmp_path / f"world{w}.pt", weights_only=True) for w in (2, 4))
    for name, config in CONFIGS.items():
        spec = ModelSpec(config=config)
        one = {
            k: v.detach() for k, v in model_tensors(initialized_model(spec, spec.hf_config(), seed=7)).items()
        }
        assert set(two[name]) == set(one) == set(four[name])
        for key, value in one.items():
            assert torch.equal(two[name][key], value) and torch.equal(four[name][key], value), (name, key)
    lora_two, lora_four = two["llama_lora"], four["llama_lora"]
    assert any(".lora_A" in k for k in lora_two)
    for key, value in lora_two.items():
        assert torch.equal(lora_four[key], value), key
