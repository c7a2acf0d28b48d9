"""Small configs for the differential check (:mod:`automodel.models.verify`).

:func:`tiny_config` shrinks transformers' default config of a ``model_type`` in every size (the
supported table's sweep); :func:`width_config` shrinks a run's own config in width only and cuts it
to one layer of each kind, keeping every flag, pattern, window, chunk and length threshold (the
check at setup).
"""

from __future__ import annotations

import copy

from transformers import AutoConfig, PretrainedConfig

WINDOW = 4


# Fields shrunk in every (sub-)config: name -> tiny value. Windows and chunks stay below the
# samples' lengths; vocabulary large enough for every special token we keep.
_TINY = {
    "hidden_size": 32,
    "n_embd": 32,
    "d_model": 32,
    "dim": 32,
    "embed_dim": 32,
    "word_embed_proj_dim": 32,
    "intermediate_size": 64,
    "ffn_dim": 64,
    "n_inner": 64,
    "ffn_hidden_size": 64,
    "decoder_ffn_dim": 64,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "expert_intermediate_size": 16,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "num_layers": 2,
    "n_layers": 2,
    "decoder_layers": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "decoder_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_kv_heads": 2,
    "head_dim": 8,
    "kv_lora_rank": 8,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 8,
    "v_head_dim": 6,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "n_group": 1,
    "topk_group": 1,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "vocab_size": 128,
    "max_position_embeddings": 128,
    "n_positions": 128,
    "sliding_window": WINDOW,
    "window_size": WINDOW,  # GPT-Neo's local attention layers
    "attention_chunk_size": WINDOW,
    "rotary_dim": 4,
}


_ZERO = (
    "attention_dropout",
    "hidden_dropout",
    "dropout",
    "attn_pdrop",
    "resid_pdrop",
    "embd_pdrop",
    "attention_probs_dropout_prob",
    "hidden_dropout_prob",
    "activation_dropout",
    "layerdrop",
    "router_jitter_noise",
    "input_jitter_noise",
)


def tiny_config(model_type: str) -> PretrainedConfig:
    """transformers' default config of ``model_type``, every size field shrunk (sub-configs too),
    dropout off, special token ids inside the vocabulary, ``layer_types`` cut to the layer count
    keeping one layer of each kind, other per-layer lists cut to the layer count (so that
    ``save_pretrained`` accepts the config); ``is_decoder`` on, as a causal LM of an encoder family
    (BertGeneration, RoBERTa) is configured to be used."""
    config = AutoConfig.for_model(model_type, is_decoder=True)
    _shrink(config)
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if isinstance(sub, PretrainedConfig):
            _shrink(sub)
    return config


def width_config(config: PretrainedConfig) -> PretrainedConfig:
    """A run's own ``config`` shrunk in width only (hidden sizes, heads, experts, vocabulary, as in
    :func:`tiny_config`), dropout off, and cut in depth to one layer of each kind
    (:func:`_cut_depth`): every layer kind, flag, pattern, window, chunk, block size and position
    threshold stays as the run will train it."""
    config = copy.deepcopy(config)
    _shrink(config, widths_only=True)
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if isinstance(sub, PretrainedConfig):
            _shrink(sub, widths_only=True)
    _cut_depth(config)
    return config


# what width_config keeps: depth (cut by _cut_depth instead) and every length a run can cross
_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")


_DEPTH_AND_LENGTHS = {
    *_LAYER_COUNTS,
    "max_position_embeddings",
    "n_positions",
    "sliding_window",
    "window_size",
    "attention_chunk_size",
}


# integer fields that set a per-layer pattern at build time (every k-th layer, the first k dense)
_LAYER_PATTERN_INTS = ("interval", "_step", "_freq", "first_k_dense")


def _cut_depth(config: PretrainedConfig) -> None:
    """Keep one layer of each kind: the first layer of each value of every per-layer list
    (``layer_types``, ``no_rope_layers``, ``mlp_layer_types``...), the first layer in and the first
    out of each index list (``moe_layers``, ``full_attn_idxs``), and the first layers up to one
    period of each pattern integer (every k-th layer, the first k dense), which the class reads by
    layer index. Per-layer lists keep the chosen layers' entries, index lists their new indices."""
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 2:
        return
    fields = {k: v for k, v in config.to_dict().items() if not k.endswith("token_id") and isinstance(v, list)}
    index_lists = {
        k: v for k, v in fields.items()
        if v and ("layer" in k or "idx" in k) and v == sorted(set(v))
        and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in v)
    }  # fmt: skip
    per_layer = {k: v for k, v in fields.items() if len(v) == layers and k not in index_lists}
    keep = {0, 1}
    for values in per_layer.values():
        kinds = [repr(v) for v in values]
        keep |= {kinds.index(kind) for kind in set(kinds)}
    for values in index_lists.values():
        keep |= {values[0], next((i for i in range(layers) if i not in values), 0)}
    for name, value in config.to_dict().items():
        if (
            isinstance(value, int)
            and not isinstance(value, bool)
            and any(p in name for p in _LAYER_PATTERN_INTS)
        ):
            keep |= set(range(min(value + 1, layers)))
    chosen = sorted(i for i in keep if i < layers)
    config.num_hidden_layers = len(chosen)
    for name, values in per_layer.items():
        setattr(config, name, [values[i] for i in chosen])
    for name, values in index_lists.items():
        setattr(config, name, [chosen.index(i) for i in values if i in chosen])


def _shrink(config: PretrainedConfig, widths_only: bool = False) -> None:
    counts = {
        name: getattr(config, name) for name in _LAYER_COUNTS if isinstance(getattr(config, name, None), int)
    }
    sizes = {k: v for k, v in _TINY.items() if not (widths_only and k in _DEPTH_AND_LENGTHS)}
    for name, current in config.to_dict().items():  # family-specific names: *vocab*, hidden_size_*
        if isinstance(current, int) and ("vocab" in name or name.startswith("hidden_size")):
            sizes.setdefault(name, _TINY["vocab_size"] if "vocab" in name else _TINY["hidden_size"])
    for name, value in sizes.items():
        current = getattr(config, name, None)
        if isinstance(current, int) and not isinstance(current, bool) and current > value:
            setattr(config, name, value)
    if (
        hasattr(config, "head_dim")
        and config.head_dim is None
        and isinstance(config.num_attention_heads, int)
    ):
        config.head_dim = config.hidden_size // config.num_attention_heads
    if getattr(config, "num_key_value_heads", None) is None and hasattr(config, "num_key_value_heads"):
        config.num_key_value_heads = _TINY["num_key_value_heads"]
    for name in (
        "num_local_experts",
        "n_routed_experts",
        "num_experts_per_tok",
        "n_group",
        "topk_group",
        "n_shared_experts",
    ):
        # unset expert counts and routing sizes of a tiny MoE
        if hasattr(config, name) and getattr(config, name) is None:
            setattr(config, name, _TINY[name])
    if isinstance(getattr(config, "kv_lora_rank", None), int) and hasattr(config, "num_key_value_heads"):
        config.num_key_value_heads = config.num_attention_heads  # MLA: one key/value head per query head
    if isinstance(getattr(config, "qk_rope_head_dim", None), int):  # MLA: RoPE is sized by head_dim
        if hasattr(config, "qk_head_dim"):
            config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        if hasattr(config, "head_dim"):
            config.head_dim = config.qk_rope_head_dim
    for name, value in config.to_dict().items():  # dropout and router noise off: both runs deterministic
        if isinstance(value, float) and (name in _ZERO or "dropout" in name or "pdrop" in name):
            setattr(config, name, 0.0)
    vocab = getattr(config, "vocab_size", None)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id"):
        value = getattr(config, name, None)
        if isinstance(vocab, int) and isinstance(value, int) and value >= vocab:
            setattr(config, name, vocab - 1 - ("bos" in name))
        elif isinstance(vocab, int) and isinstance(value, list):
            setattr(config, name, [v for v in value if v < vocab] or [vocab - 1])
    if widths_only:
        return
    layers = getattr(config, "num_hidden_layers", None)
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layers, int) and isinstance(layer_types, list) and len(layer_types) != layers:
        kinds = list(dict.fromkeys(layer_types))  # first-appearance order
        config.num_hidden_layers = max(layers, len(kinds))
        config.layer_types = (kinds * config.num_hidden_layers)[: config.num_hidden_layers]
    for (
        count,
        before,
    ) in counts.items():  # per-layer lists (GPT-Neo's attention_layers): one entry per layer kept
        after = getattr(config, count)
        for name, value in config.to_dict().items():
            if name != "layer_types" and isinstance(value, list) and len(value) == before > after:
                setattr(config, name, value[:after])
    for name in ("mlp_layer_types", "mlp_only_layers"):
        value = getattr(config, name, None)
        if isinstance(value, list) and isinstance(layers, int) and len(value) > config.num_hidden_layers:
            setattr(config, name, value[: config.num_hidden_layers])
