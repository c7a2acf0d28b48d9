"""Which transformers model types train exactly on the THD path, and the checks run at setup.

Support is decided by a differential check, not by hand: ``automodel families --verify``
(:mod:`automodel.models.verify`) runs every type of transformers' causal-LM table through the
project's packed step against each sample alone, and writes ``supported.json`` beside this
module. Setup reads it: a type listed as verified runs (on the backends that compute its
features); any other type is refused with the reason the check recorded. A type verified with
``dense_mask`` runs its own attention under a block-diagonal mask
(:meth:`automodel.attention.metadata.ThdAttentionMetadata.block_causal_mask`), one process per row
(no context parallelism). Config-level rules come on top: ``dynamic`` / ``longrope`` RoPE depend on the whole row's length, and a window or chunk
that a backend cannot apply is refused unless every sample fits in it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from transformers import PretrainedConfig

from automodel.attention.hf import FEATURES
from automodel.config import ConfigError
from automodel.models.verify import BACKEND_LACKS, read_table

REFUSED_ROPE_TYPES = ("dynamic", "longrope")


@cache
def supported_table() -> dict[str, dict]:
    """``model_type`` -> its entry in ``supported.json`` (status, reason or features and backends)."""
    return read_table()["types"]


def uses_dense_mask(config: PretrainedConfig) -> bool:
    """Whether the type runs its own attention code under a block-diagonal dense mask: the check
    found the registered THD attention never called or not exact for it, and the dense mask exact."""
    return "dense_mask" in supported_table().get(config.model_type, {}).get("features", [])


def verified_types() -> dict[str, dict]:
    return {name: entry for name, entry in supported_table().items() if entry["status"] == "verified"}


@dataclass(frozen=True)
class AttentionNeeds:
    """What a model's attention layers restrict beyond causal-within-a-sample, read from the config."""

    window: int | None
    chunk: int | None


def attention_needs(config: PretrainedConfig) -> AttentionNeeds:
    """The window and chunk the layers apply (a ``sliding_window`` field alone is no proof: Qwen2
    keeps one with ``use_sliding_window: false``; ``layer_types`` says which layers slide or chunk)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        window = None
    if layer_types is None and getattr(config, "use_sliding_window", True) is False:
        window = None
    chunk = getattr(config, "attention_chunk_size", None)
    if layer_types is None or "chunked_attention" not in layer_types:
        chunk = None
    return AttentionNeeds(window, chunk)


def rope_types(config: PretrainedConfig) -> set[str]:
    params = getattr(config, "rope_parameters", None) or {}
    per_layer = params.values() if all(isinstance(v, dict) for v in params.values()) and params else [params]
    return {p.get("rope_type", "default") for p in per_layer}


def check_supported_type(config: PretrainedConfig, backend: str) -> dict:
    """The type's entry in the supported table; a :class:`ConfigError` with the recorded reason
    unless the differential check verified it, naming the feature that ``backend`` (resolved)
    cannot compute (a checkpoint's own model class in ``auto_map`` is refused earlier, by
    :meth:`automodel.models.spec.ModelSpec.hf_config`, before its configuration code runs)."""
    entry = supported_table().get(config.model_type)
    if entry is None or entry["status"] != "verified":
        why = "it is not in transformers' causal-LM table" if entry is None else entry["reason"]
        raise ConfigError(
            f"model_type {config.model_type!r} (model.pretrained_path / model.config) is refused on the THD path: "
            f"{why}; `automodel families` lists the supported types"
        )
    lacking = sorted(BACKEND_LACKS[backend] & set(entry.get("features", [])))
    if lacking:
        raise ConfigError(
            f"{config.model_type} uses attention {', '.join(lacking)}, which model.attention_backend={backend!r} "
            "cannot compute; set model.attention_backend=portable"
        )
    return entry


def check_model_config(
    config: PretrainedConfig,
    backend: str,
    *,
    cp_size: int = 1,
    vocab_needed: int | None = None,
    max_sample_tokens: int | None = None,
) -> None:
    """Refuse at setup what would fail mid-run or train wrongly, as a :class:`ConfigError` naming the
    field and the fix.

    Args:
        backend: the resolved attention backend (``portable``, ``te`` or ``varlen``).
        cp_size: ``parallel.cp_size``.
        vocab_needed: the tokenizer's size (``len(tokenizer)``); None skips that check.
        max_sample_tokens: the longest sample the data can produce (``data.max_length``), if known.
    """
    model_type = config.model_type
    entry = check_supported_type(config, backend)
    bad_rope = rope_types(config) & set(REFUSED_ROPE_TYPES)
    if bad_rope:
        raise ConfigError(
            f"{model_type}: rope_type {sorted(bad_rope)} depends on the whole packed row's length, so packing "
            "would change it; use a checkpoint with default, linear, yarn or llama3 RoPE"
        )
    if vocab_needed is not None and vocab_needed > config.vocab_size:
        raise ConfigError(
            f"the tokenizer (data.tokenizer) has {vocab_needed} tokens but {model_type}'s vocab_size is "
            f"{config.vocab_size}; use the checkpoint's own tokenizer"
        )
    # A window or chunk applies only where the backend computes it and the check verified it for the type.
    needs, verified = attention_needs(config), set(entry.get("features", []))
    if "sliding_window" in entry.get("ignores", []):  # the check ran with one set: no layer applies it
        needs = AttentionNeeds(None, needs.chunk)
    restrictions = (
        ("sliding_window", needs.window, FEATURES[backend].window, "window" in verified),
        ("attention_chunk_size", needs.chunk, backend == "portable", "chunk" in verified),
    )
    for name, size, computed, checked in restrictions:
        if (
            size is None
            or (computed and checked)
            or (max_sample_tokens is not None and max_sample_tokens <= size)
        ):
            continue
        why = (
            f"which model.attention_backend={backend!r} cannot apply"
            if checked
            else "which the differential check did not verify for this type"
        )
        fix = "or model.attention_backend=portable" if checked else "(then it never applies)"
        raise ConfigError(
            f"{model_type} has {name}={size}, {why}, and samples may have {max_sample_tokens or 'any number of'} "
            f"tokens; set data.max_length <= {size} {fix}"
        )
    if "dense_mask" in verified and cp_size > 1:
        raise ConfigError(
            f"parallel.cp_size={cp_size} but {model_type}'s attention is its own code, run under one dense "
            "block-diagonal mask of the whole row, which cannot be sharded; use parallel.cp_size=1"
        )
    if "dense_mask" in verified and getattr(config, "alibi", False):
        raise ConfigError(
            f"{model_type} with alibi=true builds its ALiBi bias from a [batch, tokens] padding mask, which a "
            "packed row's block-diagonal mask replaces; use a checkpoint with rotary positions (alibi: false)"
        )
    if cp_size > 1 and not FEATURES[backend].context_parallel:
        raise ConfigError(
            f"parallel.cp_size={cp_size} but model.attention_backend={backend!r} cannot shard a sequence; use "
            "te or portable, or parallel.cp_size=1"
        )
