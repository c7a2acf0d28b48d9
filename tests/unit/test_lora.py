"""LoRA with peft on a tiny random-init LlamaForCausalLM: frozen base, PEFT-format export, merge.

FSDP2 over a PeftModel (two gloo ranks) is in tests/functional/test_lora_validation_distributed.py.
"""

from __future__ import annotations

import peft
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from automodel.models.lora import (
    LoraConfig,
    export_adapter,
    merged_state_dict,
    trainable_parameters,
)

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
LORA = LoraConfig(target_modules="q_proj,k_proj,v_proj,o_proj", rank=4, alpha=8)


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(CONFIG).float()


def train(model: torch.nn.Module, steps: int = 4) -> list[float]:
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=generator)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(20).reshape(2, 10) % CONFIG.vocab_size
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_only_adapters_train_and_exports_reload(tmp_path):
    base_state = {k: v.clone() for k, v in tiny_llama().state_dict().items()}
    model = LORA.apply(tiny_llama())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 4 * CONFIG.num_hidden_layers  # A and B on 4 projections per layer

    losses = train(model)
    assert losses[-1] < losses[0]
    for key, tensor in model.state_dict().items():
        if ".lora_" not in key:
            original = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
            assert torch.equal(tensor, base_state[original]), key  # bitwise unchanged

    model.eval()
    export_adapter(model, model.state_dict(), tmp_path / "adapter")
    assert {p.name for p in (tmp_path / "adapter").iterdir()} >= {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    reloaded = peft.PeftModel.from_pretrained(tiny_llama(), tmp_path / "adapter").eval()
    torch.testing.assert_close(logits(reloaded), logits(model), rtol=0, atol=1e-5)

    merged = tiny_llama(seed=5)
    merged.load_state_dict(merged_state_dict(model.state_dict(), LORA))
    torch.testing.assert_close(logits(merged.eval()), logits(model), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"target_modules": ""}, "target_modules is empty"), ({"rank": 0}, "rank"), ({"alpha": 0}, "alpha"),
     ({"dropout": 1.0}, "dropout"), ({"quantize_base": "int4"}, "quantize_base must be null or nf4"),
     ({"nf4_block_size": 63}, "nf4_block_size"), ({"nf4_scaler_block_size": 0}, "nf4_scaler_block_size")],
)  # fmt: skip
def test_bad_lora_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoraConfig(**kwargs)


def test_unknown_target_module_is_named():
    with pytest.raises(ValueError, match="target_modules"):
        LoraConfig(target_modules=["no_such_proj"]).apply(tiny_llama())
