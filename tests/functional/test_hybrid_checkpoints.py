"""Hybrid checkpoints of each published layer layout train through ``automodel finetune``.

A ``save_pretrained`` checkpoint (tiny widths, the family's published layer-type layout: three
Gated DeltaNet layers to one attention layer for Qwen3.5 and Qwen3-Next, Mamba-2 / MoE / attention
for Nemotron-H, attention beside Mamba-2 in every Falcon-H1 layer, Mamba-2 with MoE for Granite
4.0-H, short convolutions and attention for LFM2) trains one step from pre-tokenized samples in one
pack (one of 70 tokens, past the gated delta rule's chunk of 64 and the Mamba-2 chunk of 16): the
step-1 loss equals the token mean of each sample run alone through the transformers class. The
export reloads in plain transformers and generates. LoRA: the adapter, on the mixers' projections,
loads in peft and generates.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import peft
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from automodel.cli import main

COMMON = dict(
    vocab_size=512, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
THREE_TO_ONE = ["linear_attention"] * 3 + ["full_attention"]  # Qwen3.5, Qwen3-Next, OLMo hybrid
MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=16, mamba_chunk_size=16)
LAYOUTS = {
    "qwen3_5": ("qwen3_5_text", {**GDN, "layer_types": THREE_TO_ONE}),
    "qwen3_5_moe": ("qwen3_5_moe_text", {**GDN, **MOE, "layer_types": THREE_TO_ONE}),
    "qwen3_next": ("qwen3_next", {**GDN, **MOE, "layer_types": THREE_TO_ONE}),
    # Nemotron 3's pattern: Mamba-2 and MoE layers, one attention layer
    "nemotron_h": ("nemotron_h", dict(
        layers_block_type=["linear_attention", "moe", "linear_attention", "moe", "linear_attention",
                           "full_attention", "moe"],
        mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=16, chunk_size=16, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16, n_group=1,
        topk_group=1,
    )),
    "falcon_h1": ("falcon_h1", dict(num_hidden_layers=2, mamba_d_ssm=64, **MAMBA2)),
    "granite_4_h": ("granitemoehybrid", dict(
        layer_types=THREE_TO_ONE, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64, **MAMBA2
    )),
    # LFM2's: short convolutions, attention every few layers
    "lfm2": ("lfm2", dict(layer_types=["conv", "conv", "full_attention", "conv", "full_attention"],
                          full_attn_idxs=[2, 4])),
    "olmo_hybrid": ("olmo_hybrid", {**GDN, "layer_types": THREE_TO_ONE}),
}  # fmt: skip
# LoRA on the mixers' projections beside attention's (their Linear names differ per family; peft refuses
# out_proj and conv1d of Mamba mixers, which mamba-ssm's fused kernel reads as plain weights)
LORA_TARGETS = {
    "qwen3_5": "q_proj,k_proj,v_proj,o_proj,in_proj_qkv,in_proj_z,out_proj",
    "nemotron_h": "q_proj,k_proj,v_proj,o_proj,in_proj",
}
LENGTHS = (70, 3, 12, 33)


def checkpoint(directory: Path, model_type: str, fields: dict) -> Path:
    fields = {**COMMON, **fields}
    layout = fields.get("layer_types") or fields.get("layers_block_type")
    if layout:
        fields["num_hidden_layers"] = len(layout)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields)).save_pretrained(directory)
    return directory


def samples(path: Path) -> list[tuple[list[int], list[int]]]:
    """Pre-tokenized samples (``data.format=tokens``), written to ``path``: labels are the next tokens,
    the first and the last position unlabelled."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for n in LENGTHS:
        ids = torch.randint(3, 512, (n,), generator=generator).tolist()
        rows.append((ids, [-100, *ids[2:], -100]))
    path.write_text("".join(json.dumps({"input_ids": x, "labels": y}) + "\n" for x, y in rows))
    return rows


def token_mean_alone(ckpt: Path, rows) -> float:
    """The loss of the samples as the class computes each one alone: the cross-entropy summed over
    every sample's labels, divided by their count."""
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, labels in rows:
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
            labels = torch.tensor(labels)
            total += float(
                torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
            )
            count += int((labels != -100).sum())
    return total / count


def finetune(tmp_path: Path, recipe: str, ckpt: Path, data: Path, *overrides: str) -> Path:
    out = tmp_path / "run"
    code = main([
        "finetune", recipe, "model=hf_checkpoint", f"model.pretrained_path={ckpt}", "model.dtype=float32",
        "data.tokenizer=tiny", f"data.source={data}", "data.format=tokens", "data.max_length=128", "data.val_fraction=null",
        "trainer.eval_every=null",
        "packing.packed_sequence_size=256", "trainer.grad_accum_steps=1", "trainer.max_steps=1",
        "trainer.checkpoint_every=null", "trainer.progress_bar=false", "trainer.tracking.tensorboard=false",
        f"trainer.output_dir={out}", *overrides,
    ])  # fmt: skip
    assert code == 0
    return out


def generates(model) -> None:
    prompt = torch.tensor([[1, 17, 42, 99]])
    out = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 8) and torch.equal(out[:, :4], prompt)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_hybrid_checkpoint_trains_one_exact_step_exports_and_generates(tmp_path, layout, monkeypatch):
    monkeypatch.setenv("AUTOMODEL_CACHE", str(tmp_path / "cache"))
    model_type, fields = LAYOUTS[layout]
    ckpt = checkpoint(tmp_path / "ckpt", model_type, fields)
    rows = samples(tmp_path / "samples.jsonl")
    lora = [f"peft.target_modules=[{LORA_TARGETS[layout]}]"] if layout in LORA_TARGETS else []
    recipe = "tiny_llama_lora" if lora else "tiny_llama_sft"
    out = finetune(tmp_path, recipe, ckpt, tmp_path / "samples.jsonl", *lora)
    (step,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert step["label_tokens"] == sum(n - 2 for n in LENGTHS)  # every sample in the one step
    assert math.isclose(step["loss"], token_mean_alone(ckpt, rows), rel_tol=1e-5), step
    if lora:  # the base's loss at step 1 (B starts at zero); the adapter loads in peft
        base = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
        adapted = peft.PeftModel.from_pretrained(base, out / "adapter")
        adapted_modules = {
            n.split(".lora_A")[0].rsplit(".", 1)[1] for n, _ in adapted.named_parameters() if "lora_A" in n
        }
        assert adapted_modules == set(LORA_TARGETS[layout].split(",")), adapted_modules
        generates(adapted)
    else:
        reloaded = AutoModelForCausalLM.from_pretrained(out / "hf")
        assert reloaded.config.model_type == model_type
        generates(reloaded)
