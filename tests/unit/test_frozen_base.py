"""LoRA's frozen base storage: bf16 base against the float32-master one under FSDP2 mixed precision,
NF4 sizes and shapes (QLoRA)."""

from __future__ import annotations

import peft
import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from automodel.models.frozen_base import (
    dequantized,
    nf4_quantizable,
    quantize_frozen_base,
    store_frozen_base,
    stored_bytes,
)
from automodel.models.parallelize import apply_fsdp

CONFIG = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64)  # fmt: skip
LORA = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")


class Lm(nn.Module):
    """A peft-wrapped Llama with the ``decoder_layers`` apply_fsdp shards one by one."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.hf = peft.get_peft_model(LlamaForCausalLM(CONFIG), LORA)

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.hf.get_base_model().model.layers

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=ids, labels=ids).loss


def adapter_gradients(model: nn.Module, steps: int = 3) -> list[dict[str, torch.Tensor]]:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    grads = []
    for _ in range(steps):
        model(ids).backward()
        grads.append(
            {n: p.grad.full_tensor().clone() for n, p in model.named_parameters() if p.requires_grad}
        )
        optimizer.step()
        optimizer.zero_grad()
    return grads


def test_bf16_base_matches_float32_master_adapter_gradients(one_process_group):
    mesh = one_process_group
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    master = Lm()  # before: every parameter float32, FSDP2 casts the base to bf16 for compute
    for layer in master.decoder_layers:
        fully_shard(layer, mesh=mesh, mp_policy=bf16)
    fully_shard(master, mesh=mesh, mp_policy=bf16)
    stored = Lm()
    store_frozen_base(stored, torch.bfloat16)
    apply_fsdp(stored, mesh, torch.bfloat16)

    frozen = [(n, p) for n, p in stored.named_parameters() if not p.requires_grad]
    assert {p.dtype for _, p in frozen} == {torch.bfloat16}
    assert {p.dtype for p in stored.parameters() if p.requires_grad} == {
        torch.float32
    }  # adapters: fp32 masters
    numel = sum(p.numel() for _, p in frozen)
    assert sum(stored_bytes(p) for _, p in frozen) == 2 * numel
    assert sum(stored_bytes(p) for p in master.parameters() if not p.requires_grad) == 4 * numel

    for step, (a, b) in enumerate(zip(adapter_gradients(stored), adapter_gradients(master), strict=True)):
        for name in b:
            torch.testing.assert_close(a[name], b[name], rtol=1.6e-2, atol=1e-6, msg=f"step {step} {name}")


@pytest.mark.parametrize(
    ("shape", "block", "scaler_block", "shards", "expected"),
    [((128, 128), 64, 256, 1, True),  # 256 blocks = 1 scaler group
     ((64, 128), 64, 256, 1, False),  # 128 blocks: half a scaler group
     ((128, 128), 64, 256, 2, False),  # one scaler group cannot be split between 2 shards
     ((128, 128), 64, 32, 2, True),  # 8 groups of 32 blocks, 4 per shard
     ((3, 128, 128), 64, 32, 1, False)],  # not a Linear weight
)  # fmt: skip
def test_nf4_quantizable(shape, block, scaler_block, shards, expected):
    assert nf4_quantizable(torch.Size(shape), block, scaler_block, shards) is expected


def test_quantize_frozen_base_without_fsdp():
    model = Lm()
    store_frozen_base(model, torch.float32)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    kept = quantize_frozen_base(model, model.decoder_layers, block_size=64, scaler_block_size=256)
    # 128 x 128 (q, o) and 256 x 128 (mlp) quantize; k and v (64 x 128) are half a scaler group
    assert kept == [f"{i}.self_attn.{p}_proj.base_layer.weight (64, 128)" for i in range(2) for p in "kv"]
    q = model.decoder_layers[0].self_attn.q_proj.base_layer.weight
    # 16384 values: 8192 bytes of 4-bit pairs, 256 int8 block scales, 1 float32 scale of those, a
    # float32 mean, and the 16-entry float32 NF4 code table
    assert stored_bytes(q) == 8192 + 256 + 4 + 4 + 16 * 4
    state = dequantized(dict(model.named_parameters()))
    name = "hf.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    error = (state[name] - original[name]).abs().max() / original[name].abs().max()
    assert state[name].dtype == torch.float32 and 0 < error < 0.15  # 4-bit: within a code step of the max
    for name in original:
        if ".lora_" in name or "proj.base_layer" not in name:
            assert torch.equal(state[name], original[name]), name  # embeddings, norms, adapters untouched
    ids = torch.randint(0, CONFIG.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    model(ids).backward()  # dequantized on the fly; gradients reach the adapters
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_bf16_nf4_dequantizes_in_float32():
    from torchao.quantization import to_nf4

    weight = torch.randn(128, 128, generator=torch.Generator().manual_seed(0))
    nf4 = to_nf4(weight.to(torch.bfloat16))
    exact = to_nf4(weight).get_original_weight()  # float32 throughout (other scales: a reference only)
    values = dequantized({"w": nf4})["w"]
    in_bf16 = nf4.get_original_weight()
    assert values.dtype == torch.float32 and in_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(
        values, in_bf16.float(), rtol=8e-3, atol=0
    )  # the same values, up to bf16 rounding
    assert not torch.equal(values, in_bf16.float())  # but not rounded to bf16
    assert (values - weight).abs().max() <= 1.05 * (
        exact - weight
    ).abs().max()  # as close as a float32 base's
