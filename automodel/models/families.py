"""Which transformers model types train exactly on the THD path, and the checks run at setup.

A model type is on the allow-list only when a test shows a packed row equals each sample run alone
(tests/unit/test_hf_families.py). Others are refused: some never call the attention interface
(bloom, mpt, falcon), some ignore ``position_ids`` (BART-family decoders), hybrids carry state
across samples in their recurrent layers (Qwen3-Next, LFM2), and ``dynamic`` / ``longrope`` RoPE
depend on the whole row's length.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

from automodel.attention.hf import FEATURES

# model_type -> how it was verified (the README table is generated from the same facts)
VERIFIED_MODEL_TYPES = {
    "llama": "Llama 3 (tied embeddings, llama3 RoPE)",
    "qwen2": "Qwen2 / Qwen2.5",
    "qwen3": "Qwen3",
    "mistral": "Mistral (sliding window)",
    "gemma2": "Gemma 2 (softcap, alternating windows)",
    "gemma3_text": "Gemma 3 text (per-layer windows)",
    "phi3": "Phi-3 (sliding window)",
    "olmo2": "OLMo 2",
    "qwen3_moe": "Qwen3-MoE",
    "gpt_oss": "GPT-OSS (attention sinks, windows)",
    "granite": "Granite (own scaling, logits_scaling)",
    "smollm3": "SmolLM3",
}
REFUSED_ROPE_TYPES = ("dynamic", "longrope")


@dataclass(frozen=True)
class AttentionNeeds:
    """What a model's attention layers pass to the attention function."""

    window: int | None
    softcap: float | None
    sinks: bool


def attention_needs(config: PretrainedConfig) -> AttentionNeeds:
    """Read from the config what the layers will pass (a ``sliding_window`` field alone is no proof:
    Qwen2 keeps one with ``use_sliding_window: false``; ``layer_types`` says which layers slide)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        window = None
    return AttentionNeeds(window, getattr(config, "attn_logit_softcapping", None), config.model_type == "gpt_oss")


def rope_types(config: PretrainedConfig) -> set[str]:
    params = getattr(config, "rope_parameters", None) or {}
    per_layer = params.values() if all(isinstance(v, dict) for v in params.values()) and params else [params]
    return {p.get("rope_type", "default") for p in per_layer}


def check_model_config(
    config: PretrainedConfig,
    backend: str,
    *,
    cp_size: int = 1,
    vocab_needed: int | None = None,
    max_sample_tokens: int | None = None,
) -> None:
    """Refuse at setup what would fail mid-run or train wrongly; each error names the field and the fix.

    Args:
        backend: the resolved attention backend (``portable``, ``te`` or ``varlen``).
        cp_size: ``parallel.cp_size``.
        vocab_needed: the tokenizer's size (``len(tokenizer)``).
        max_sample_tokens: the longest sample the data can produce (``data.max_length``), if known.
    """
    model_type = config.model_type
    if model_type not in VERIFIED_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} (model.pretrained_path / model.config) is not verified on the THD path; "
            f"supported: {sorted(VERIFIED_MODEL_TYPES)}"
        )
    bad_rope = rope_types(config) & set(REFUSED_ROPE_TYPES)
    if bad_rope:
        raise ValueError(
            f"{model_type}: rope_type {sorted(bad_rope)} depends on the whole packed row's length, so packing "
            "would change it; use a checkpoint with default, linear, yarn or llama3 RoPE"
        )
    if vocab_needed is not None and vocab_needed > config.vocab_size:
        raise ValueError(
            f"the tokenizer (data.tokenizer) has {vocab_needed} tokens but {model_type}'s vocab_size is "
            f"{config.vocab_size}; use the checkpoint's own tokenizer"
        )
    features, needs = FEATURES[backend], attention_needs(config)
    for need, present in (("softcap", needs.softcap is not None), ("sinks", needs.sinks)):
        if present and not getattr(features, need):
            raise ValueError(
                f"{model_type} uses attention {need}, which model.attention_backend={backend!r} cannot compute; "
                "set model.attention_backend=portable"
            )
    if needs.window is not None and not features.window:
        if max_sample_tokens is None or max_sample_tokens > needs.window:
            raise ValueError(
                f"{model_type} has sliding_window={needs.window}, which model.attention_backend={backend!r} cannot "
                f"apply, and samples may have {max_sample_tokens or 'any number of'} tokens; set data.max_length "
                f"<= {needs.window} or model.attention_backend=portable"
            )
    if cp_size > 1 and not features.context_parallel:
        raise ValueError(
            f"parallel.cp_size={cp_size} but model.attention_backend={backend!r} cannot shard a sequence; use "
            "te or portable, or parallel.cp_size=1"
        )
