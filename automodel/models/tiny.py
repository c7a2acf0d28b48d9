"""Small configs for the differential check (:mod:`automodel.models.verify`).

:func:`tiny_config` shrinks transformers' default config of a ``model_type`` in every size (the
supported table's sweep); :func:`width_config` shrinks a run's own config in width only and cuts it
to one layer of each kind, keeping every flag, pattern, window, chunk and length threshold (the
check at setup).
"""

from __future__ import annotations

import copy
import re
from typing import Any

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
    # linear attention (Gated DeltaNet, KDA): key/value heads and their dims
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_num_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_head_dim": 8,
    # Mamba and Mamba-2 mixers: heads, head dim, state, groups (dividing the heads), time-step rank
    "mamba_n_heads": 8,
    "mamba_num_heads": 8,
    "n_mamba_heads": 8,
    "mamba_d_head": 8,
    "mamba_head_dim": 8,
    "mamba_headdim": 8,
    "mamba_d_ssm": 64,
    "mamba_d_state": 16,
    "ssm_state_size": 16,
    "state_size": 16,
    "mamba_n_groups": 2,
    "mamba_ngroups": 2,
    "n_groups": 2,
    "mamba_dt_rank": 8,
    # Mamba-2's scan chunk: a length, below the samples of the sweep (kept by width_config)
    "chunk_size": 16,
    "mamba_chunk_size": 16,
}

# Mamba-2 splits its inner width (``mamba_d_ssm`` where set, else expand x hidden size) into heads of
# a head dim: (heads, head dim) field pairs whose product the shrink keeps equal to the inner width
_MAMBA_HEADS = (
    ("mamba_n_heads", "mamba_d_head"),
    ("mamba_num_heads", "mamba_head_dim"),
    ("n_mamba_heads", "mamba_headdim"),
    ("num_heads", "head_dim"),
)


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

# unset in a type's default config (a dense default of a MoE class): the sweep's tiny MoE sizes
_UNSET_ROUTING = (
    "num_local_experts",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_group",
    "topk_group",
    "n_shared_experts",
)


def tiny_config(model_type: str) -> PretrainedConfig:
    """transformers' default config of ``model_type``, every size and length shrunk, dropout off,
    unset routing sizes given tiny values, special token ids inside the vocabulary, cut in depth to
    one layer of each kind (:func:`_cut_depth`; sub-configs too); ``is_decoder`` on, as a causal LM
    of an encoder family (BertGeneration, RoBERTa) is configured to be used."""
    config = AutoConfig.for_model(model_type, is_decoder=True)
    for part in _parts(config):
        _shrink(part)
        _cut_depth(part)
    return config


def width_config(config: PretrainedConfig) -> PretrainedConfig:
    """A run's own ``config`` shrunk in width only (hidden sizes, heads, experts, vocabulary, as in
    :func:`tiny_config`, per-layer overrides in proportion) and cut in depth to one layer of each
    kind (:func:`_cut_depth`; sub-configs too): every layer kind, flag, pattern, window, chunk,
    block size, position threshold and random layer (dropout, router jitter) stays as the run will
    train it, and a field the config leaves unset stays unset."""
    config = copy.deepcopy(config)
    for part in _parts(config):
        _shrink(part, widths_only=True)
        _cut_depth(part)
    return config


def depth_config(config: PretrainedConfig) -> PretrainedConfig:
    """``config`` at its own widths, cut in depth to one layer of each kind (:func:`_cut_depth`)."""
    config = copy.deepcopy(config)
    for part in _parts(config):
        _cut_depth(part)
    return config


def _parts(config: PretrainedConfig) -> list[PretrainedConfig]:
    """``config`` and its sub-configs (a composite model's text and vision configs)."""
    subs = [getattr(config, name, None) for name in getattr(config, "sub_configs", {}) or {}]
    return [config, *(sub for sub in subs if isinstance(sub, PretrainedConfig))]


# what width_config keeps: depth (cut by _cut_depth instead) and every length a run can cross
_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")


_DEPTH_AND_LENGTHS = {
    *_LAYER_COUNTS,
    "max_position_embeddings",
    "n_positions",
    "sliding_window",
    "window_size",
    "attention_chunk_size",
    "chunk_size",
    "mamba_chunk_size",
}


# integer fields that set a per-layer pattern at build time (every k-th layer, the first k dense)
_LAYER_PATTERN_INTS = (
    "interval",
    "sparse_step",  # decoder_sparse_step; not a Mamba's time_step_rank, a width
    "layer_step",
    "_freq",
    "first_k_dense",
    "period",
    "offset",
    "every_n",
    "group_size",
)


# widths by a part of their name, for the fields _TINY does not list (Llama 4's intermediate_size_mlp)
_FAMILY_WIDTHS = {"vocab": _TINY["vocab_size"], "hidden_size": _TINY["hidden_size"], "intermediate": 64}


def is_width(name: str) -> bool:
    """Whether a config field is a width :func:`width_config` shrinks (hidden and intermediate sizes,
    heads, experts, vocabulary, routing sizes), not a length, a layer count or a flag."""
    return (name in _TINY and name not in _DEPTH_AND_LENGTHS) or any(key in name for key in _FAMILY_WIDTHS)


def length_fields(config: PretrainedConfig) -> dict[str, int]:
    """Every integer of ``config`` (nested ones as ``rope_parameters.original_max_position_embeddings``)
    that could be a length in tokens, by dotted name: windows, chunks, floors, position limits, block
    and top-k sizes, and each block size times each top-k count (MiniMax-M3 keeps the top 16 blocks
    of 128 keys: 2,048). Not lengths: widths (:func:`is_width`), layer counts and indices, token ids,
    RoPE bases. The check at setup crosses each one the run can reach (:func:`check_lengths`)."""

    def numbers(node: dict, prefix: str = ""):
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                yield from numbers(value, f"{name}.")
            elif (
                _is_int(value)
                and value >= 2
                and not _NOT_A_LENGTH.search(str(key))
                and not is_width(str(key))
            ):
                yield name, value

    found = dict(numbers(config_fields(config)))
    tops = {k: v for k, v in found.items() if "top" in k.rsplit(".", 1)[-1]}
    blocks = {k: v for k, v in found.items() if "block" in k.rsplit(".", 1)[-1] and k not in tops}
    for block, size in blocks.items():
        for top, count in tops.items():
            found[f"{block}*{top}"] = size * count
    return found


_NOT_A_LENGTH = re.compile(r"layer|token_id|theta|base|seed|^num_|^n_|_idx$|interval|_step|_freq|first_k")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def config_fields(config: PretrainedConfig) -> dict[str, Any]:
    """Every field of ``config`` by name, as the object holds it (Dory serializes its layers in
    another form than it keeps them), plus the names ``attribute_map`` aliases (GPT-2's
    ``hidden_size`` for ``n_embd``). Where the attribute cannot be read (a per-layer field of a
    heterogeneous config raises) or is a sub-config, ``config.to_dict()``'s value: the global one,
    a dict."""
    fields = {}
    for name, serialized in config.to_dict().items():
        try:
            value = getattr(config, name)
        except (AttributeError, RuntimeError):  # transformers' AmbiguousGlobalPerLayerAttributeError
            value = serialized
        fields[name] = (
            serialized if isinstance(value, PretrainedConfig) or name == "per_layer_config" else value
        )
    for alias, name in getattr(config, "attribute_map", {}).items():
        if name in fields:
            fields.setdefault(alias, fields[name])
    return fields


def layer_overrides(config: PretrainedConfig) -> dict[int, dict[str, Any]]:
    """A heterogeneous config's per-layer overrides (transformers' ``per_layer_config``), by layer."""
    return {int(i): values for i, values in (config.to_dict().get("per_layer_config") or {}).items()}


def _cut_depth(config: PretrainedConfig) -> None:
    """Keep one layer of each kind: the first layer of each value of every per-layer list
    (``layer_types``, ``no_rope_layers``, ``mlp_layer_types``...) and of each per-layer override
    (``per_layer_config``: Gemma 4's head sizes), the first layer in and the first out of each index
    list (``moe_layers``, ``full_attn_idxs``), the first layers up to one period of each pattern
    integer (every k-th layer, the first k dense), which the class reads by layer index, and for
    each other layer count (``num_kv_shared_layers``, ``max_window_layers``) the layers on both sides
    of its boundary counted from the start and from the end, as many kept within its count from the
    start as from the end (:func:`_balance`), so that the new count means the same layers whichever
    end the class counts from. Per-layer lists keep the chosen layers' entries, index lists and
    per-layer overrides their new indices."""
    fields = config_fields(config)
    layers = fields.get("num_hidden_layers")
    if not _is_int(layers) or layers < 2:
        return
    lists = {k: v for k, v in fields.items() if not k.endswith("token_id") and isinstance(v, list)}
    index_lists = {
        k: v for k, v in lists.items()
        if v and ("layer" in k or "idx" in k) and v == sorted(set(v))
        and all(_is_int(i) and 0 <= i < layers for i in v)
    }  # fmt: skip
    per_layer = {k: v for k, v in lists.items() if len(v) == layers and k not in index_lists}
    overrides = layer_overrides(config)
    keep = {0, 1}
    for values in [*per_layer.values(), [overrides.get(i, {}) for i in range(layers)]]:
        kinds = [repr(v) for v in values]
        keep |= {kinds.index(kind) for kind in set(kinds)}
    for values in index_lists.values():
        keep |= {values[0], next((i for i in range(layers) if i not in values), 0)}
    counts = {}
    for name, value in fields.items():
        if not _is_int(value) or name in _LAYER_COUNTS or "vocab" in name or name.startswith("hidden_size"):
            continue
        if any(p in name for p in _LAYER_PATTERN_INTS):
            keep |= set(range(min(value + 1, layers)))
        elif "layer" in name and 0 < value < layers and name not in _TINY:
            counts[name] = value
    chosen = sorted(_balance(keep, layers, counts.values()))
    config.num_hidden_layers = len(chosen)
    for name, values in per_layer.items():
        setattr(config, name, [values[i] for i in chosen])
    for name, values in index_lists.items():
        setattr(config, name, [chosen.index(i) for i in values if i in chosen])
    for name, value in counts.items():
        setattr(config, name, sum(i < value for i in chosen))
    if overrides:
        config.per_layer_config = {chosen.index(i): v for i, v in overrides.items() if i in chosen}


def _balance(keep: set[int], layers: int, counts) -> set[int]:
    """``keep`` plus the layers that make every count ``v`` in ``counts`` keep as many layers among
    the first ``v`` as among the last ``v``, and the layers on both sides of both boundaries.

    Example (35 layers, Gemma 3n's last 15 sharing keys and values, keep {0, 1, 4, 10}): the
    boundaries add 14, 15, 19, 20; the first 15 then hold 5 kept layers and the last 15 one, so
    21, 22, 23 and 24 join: the new count is 5 from either end."""
    keep = set(keep)
    for v in counts:
        keep |= {v - 1, v, layers - v - 1, layers - v} & set(range(layers))
    settled = False
    while not settled:  # each pass only adds layers: at most `layers` passes
        settled = True
        for v in counts:
            head, tail = set(range(v)), set(range(layers - v, layers))
            short, extra = len(keep & head) - len(keep & tail), []
            if short < 0:
                extra = sorted(head - tail - keep)[:-short]
            elif short > 0:
                extra = sorted(tail - head - keep)[:short]
            if extra:
                keep |= set(extra)
                settled = False
    return keep


def _scaled(value: int, before: int, after: int) -> int:
    """A per-layer width ``value`` when the config's own ``before`` became ``after``, in proportion."""
    return max(1, value * after // before)


def _mamba_heads(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """The Mamba-2 head count or head dim that keeps heads x head dim equal to the inner width
    after the shrink, for each pair of :data:`_MAMBA_HEADS` whose product was the inner width before
    (a pair that was not, such as an attention's heads and head dim, is left alone)."""

    def inner(fields: dict[str, Any]) -> int | None:
        if _is_int(fields.get("mamba_d_ssm")):
            return fields["mamba_d_ssm"]
        expand = next((fields[n] for n in ("mamba_expand", "expand") if _is_int(fields.get(n))), None)
        hidden = fields.get("hidden_size")
        return expand * hidden if expand is not None and _is_int(hidden) else None

    width_before, width_after, changed = inner(before), inner(after), {}
    for heads, dim in _MAMBA_HEADS:
        values = before.get(heads), before.get(dim), after.get(heads), after.get(dim)
        if width_before is None or width_after is None or not all(_is_int(v) for v in values):
            continue
        if values[0] * values[1] != width_before or values[2] * values[3] == width_after:
            continue
        if width_after % values[2] == 0 and width_after >= values[2]:
            changed[dim] = width_after // values[2]
        else:
            changed[heads] = max(1, width_after // values[3])
    return changed


def _shrink(config: PretrainedConfig, widths_only: bool = False) -> None:
    """Every width of ``config`` down to :data:`_TINY`'s (per-layer lists element by element,
    per-layer overrides in proportion), special token ids inside the new vocabulary. With
    ``widths_only`` (a run's own config) every other field stays as it is: no unset field is filled,
    query and key/value heads that are equal stay equal, dropout and router noise stay. Without it
    (transformers' default config of a type, for the sweep) also the layers, windows and lengths,
    dropout and router noise off, and unset head and routing sizes filled."""
    fields = config_fields(config)
    depth = {
        "num_hidden_layers",
        getattr(config, "attribute_map", {}).get("num_hidden_layers"),
    }  # _cut_depth's
    sizes = {
        k: v for k, v in _TINY.items() if k not in depth and not (widths_only and k in _DEPTH_AND_LENGTHS)
    }
    for name, current in fields.items():  # family-specific names: *vocab*, hidden_size_*, *intermediate*
        if _is_int(current) and name not in sizes and is_width(name):
            sizes[name] = _FAMILY_WIDTHS[next(key for key in _FAMILY_WIDTHS if key in name)]
    new = {}
    for name, value in sizes.items():
        current = fields.get(name)
        if _is_int(current) and current > value:
            new[name] = value
        elif isinstance(current, list) and current and all(_is_int(v) for v in current):
            new[name] = [min(v, value) for v in current]  # one per layer (Gemma 3n's intermediate sizes)
    shrunk = {**fields, **new}
    heads = shrunk.get("num_attention_heads")
    if widths_only and fields.get("num_key_value_heads") == fields.get("num_attention_heads") is not None:
        new["num_key_value_heads"] = heads  # multi-head attention stays multi-head
    if fields.get("linear_num_key_heads") == fields.get("linear_num_value_heads") is not None:
        new["linear_num_value_heads"] = shrunk["linear_num_key_heads"]  # as many value heads as key heads
    new.update(_mamba_heads(fields, {**fields, **new}))
    if not widths_only:
        if "head_dim" in fields and fields["head_dim"] is None and _is_int(heads):
            new["head_dim"] = shrunk["hidden_size"] // heads
        if "num_key_value_heads" in fields and fields["num_key_value_heads"] is None:
            new["num_key_value_heads"] = _TINY["num_key_value_heads"]
        for name in _UNSET_ROUTING:  # a default config's unset expert counts and routing sizes
            if name in fields and fields[name] is None:
                new[name] = _TINY[name]
    if _is_int(shrunk.get("kv_lora_rank")) and "num_key_value_heads" in fields:
        new["num_key_value_heads"] = heads  # MLA: one key/value head per query head
    if _is_int(shrunk.get("qk_rope_head_dim")):  # MLA: RoPE is sized by head_dim
        if "qk_head_dim" in fields:
            new["qk_head_dim"] = shrunk["qk_nope_head_dim"] + shrunk["qk_rope_head_dim"]
        if "head_dim" in fields:
            new["head_dim"] = shrunk["qk_rope_head_dim"]
    vocab = shrunk.get("vocab_size")
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id"):
        value = fields.get(name)
        if _is_int(vocab) and _is_int(value) and value >= vocab:
            new[name] = vocab - 1 - ("bos" in name)
        elif _is_int(vocab) and isinstance(value, list):
            new[name] = [v for v in value if v < vocab] or [vocab - 1]
    if not widths_only:
        for name, value in fields.items():  # dropout and router noise off: both runs deterministic
            if isinstance(value, float) and (name in _ZERO or "dropout" in name or "pdrop" in name):
                new[name] = 0.0
    # per-layer widths in proportion to the global one (Gemma 4's wider full-attention heads)
    overrides = {
        i: {k: _scaled(v, fields[k], new[k]) if _is_int(v) and _is_int(new.get(k)) and _is_int(fields.get(k))
            else min(v, sizes[k]) if _is_int(v) and k in sizes else v for k, v in values.items()}
        for i, values in layer_overrides(config).items()
    }  # fmt: skip
    for name, value in new.items():
        setattr(config, name, value)
    if overrides:
        config.per_layer_config = overrides
