"""Tiny random-init checkpoints of every verified family, a packed batch, and the reference:
each sample run alone through the same transformers class with eager attention.

Used by tests/functional/test_hf_families.py (one process) and hf_families_worker.py (torchrun).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM

from automodel.attention import ThdAttentionMetadata
from automodel.distributed.cp_sharding import make_cp_batch_for_te
from automodel.models.verify import perturb_constants, sample_pairs

COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
    attention_dropout=0.0,
    bos_token_id=1,
    eos_token_id=2,  # inside the tiny vocabulary (setup refuses ids outside it)
)
WINDOW = 4  # shorter than most samples, so a wrong window shows
FAMILIES = {
    "llama": dict(
        tie_word_embeddings=True,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
    ),
    "qwen2": dict(),
    "qwen3": dict(),
    "mistral": dict(sliding_window=WINDOW),
    "gemma2": dict(
        sliding_window=WINDOW,
        attn_logit_softcapping=0.5,
        final_logit_softcapping=3.0,
        query_pre_attn_scalar=8,
    ),
    "gemma3_text": dict(
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=8
    ),
    "phi3": dict(sliding_window=WINDOW, pad_token_id=0),
    "olmo2": dict(),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1),
    "gpt_oss": dict(
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "granite": dict(
        logits_scaling=2.0, attention_multiplier=0.2, embedding_multiplier=3.0, residual_multiplier=0.5
    ),
    "smollm3": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # MLA (value head dim 6 != query/key 12) with MoE and a router bias; chunked attention; a logit scale
    "deepseek_v3": dict(
        num_key_value_heads=4,
        head_dim=4,
        kv_lora_rank=8,
        q_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=8,
        v_head_dim=6,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=16,
        first_k_dense_replace=1,
    ),
    "llama4_text": dict(
        attention_chunk_size=WINDOW,
        layer_types=["chunked_attention", "full_attention"],
        num_local_experts=4,
        num_experts_per_tok=1,
        intermediate_size_mlp=64,
    ),
    "cohere2": dict(
        logit_scale=0.3, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]
    ),
    # hybrids: stateful token mixers run per sample beside the attention (a Gated DeltaNet; Mamba-2 with MoE
    # and a scan chunk of 4, so that state crosses chunks inside a sample; a short convolution)
    "qwen3_5_text": dict(
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    ),
    "nemotron_h": dict(
        layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
        mamba_num_heads=8,
        mamba_head_dim=8,
        n_groups=2,
        ssm_state_size=16,
        chunk_size=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=16,
        n_group=1,
        topk_group=1,
    ),
    "lfm2": dict(layer_types=["conv", "full_attention"], full_attn_idxs=[1]),
    # its own attention code (no AttentionInterface): run under a dense block-diagonal mask, one process per row
    # (head_dim is a read-only property of its config: None leaves it out)
    "falcon": dict(new_decoder_architecture=True, num_kv_heads=2, bias=True, head_dim=None),
}
# the packed samples: the verifier's own (REAL_LENS tokens, the first two of each a prompt, -100)
samples = sample_pairs


def make_checkpoint(family: str, directory: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    fields = {k: v for k, v in {**COMMON, **FAMILIES[family]}.items() if v is not None}
    config = AutoConfig.for_model(family, **fields)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    perturb_constants(model, seed)  # sinks, norms, biases, router biases: each starts constant
    path = directory / family
    model.save_pretrained(path)
    return path


def collated(sample_list, pad_multiple: int) -> dict:
    """One pack as ``packed_sequence_thd_collater`` returns it: each sample padded to ``pad_multiple``,
    positions counting through the padding."""
    ids, labels, positions, lens, padded = [], [], [], [], []
    for x, y in sample_list:
        p = -(-len(x) // pad_multiple) * pad_multiple
        ids.append(torch.cat([x, torch.zeros(p - len(x), dtype=x.dtype)]))
        labels.append(torch.cat([y, torch.full((p - len(x),), -100)]))
        positions.append(torch.arange(p))
        lens.append(len(x))
        padded.append(p)
    return {
        "input_ids": torch.cat(ids)[None],
        "labels": torch.cat(labels)[None],
        "position_ids": torch.cat(positions)[None],
        "seq_lens": torch.tensor([lens]),
        "seq_lens_padded": torch.tensor([padded]),
    }


def shard(batch: dict, cp_size: int, cp_rank: int, cp_group=None) -> dict:
    thd = make_cp_batch_for_te(None, batch, cp_size=cp_size, cp_rank=cp_rank)
    thd["attn_meta"] = ThdAttentionMetadata.from_batch(thd, cp_group=cp_group)
    return thd


def reference(path: Path, sample_list) -> tuple[float, dict[str, torch.Tensor], AutoModelForCausalLM]:
    """Token-mean loss and gradients with each sample run alone, eager attention, float32."""
    model = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32
    ).train()
    n_labels = sum(int((y != -100).sum()) for _, y in sample_list)
    total = 0.0
    for x, y in sample_list:
        logits = model(x[None]).logits[0]
        loss = (
            torch.nn.functional.cross_entropy(logits.float(), y, ignore_index=-100, reduction="sum")
            / n_labels
        )
        loss.backward()
        total += float(loss.detach())
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return total, grads, model


def full_grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.hf.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[name] = g.full_tensor() if isinstance(g, DTensor) else g
    return out


# the gated delta rule computes in float32 whatever the model's dtype, and the gradients of its decay
# parameters (A_log, dt_bias) are sums of cancelling per-token terms: 2e-5 apart in float32 (the float64
# differential check: 2e-7)
FAMILY_RTOL = {"qwen3_5_text": 1e-4}


def compare(
    family: str, loss: float, grads: dict, ref_loss: float, ref_grads: dict, rtol: float | None = None
) -> list[str]:
    """Mismatches as readable lines (empty when equal): loss relative, each gradient relative to its
    norm; ``rtol`` 1e-5 unless :data:`FAMILY_RTOL` names the family."""
    rtol = rtol or FAMILY_RTOL.get(family, 1e-5)
    errors = []
    if abs(loss - ref_loss) > rtol * abs(ref_loss):
        errors.append(f"{family}: loss {loss} != reference {ref_loss}")
    if set(grads) != set(ref_grads):
        errors.append(f"{family}: gradient names differ: {sorted(set(grads) ^ set(ref_grads))[:4]}")
    for name in set(grads) & set(ref_grads):
        diff = float((grads[name] - ref_grads[name]).norm())
        scale = float(ref_grads[name].norm())
        if diff > rtol * max(scale, 1e-8):
            errors.append(f"{family}: grad {name} rel err {diff / max(scale, 1e-12):.2e}")
    return errors
