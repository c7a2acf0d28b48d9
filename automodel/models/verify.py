"""The differential check that decides which transformers model types the THD path supports.

For a ``model_type`` it builds a tiny random config from transformers' own defaults (hidden sizes,
layers, heads, experts and vocabulary shrunk; windows and attention chunks shorter than the
samples, so a wrong one shows), perturbs every parameter that starts constant (norm weights,
biases, sinks, scales) so every feature matters, and compares the project's packed step (its
model builder, the registered THD attention, the chunked loss with the family's logit transform)
with each sample run alone through the same class in its own attention (SDPA where the class has
it, else eager): the loss, the logits and every gradient (float64 model on both sides, the loss
head in float32; relative error <= ``RTOL``). Where the registered attention is never called or
not exact, the type's own attention under a block-diagonal dense mask is checked the same way
(feature ``dense_mask``); recurrent or convolutional token mixers are refused without it.

``python -m automodel families --verify`` runs it over every type of transformers' causal-LM
table and writes ``automodel/models/supported.json``, which setup reads
(:func:`automodel.models.families.check_model_config`): a type is trained only when it is listed
as verified there. Each other type is listed with why: refused (a named reason) or not buildable
tiny (the error of building it).

Shape legend: T = packed tokens, V = vocabulary.
"""

from __future__ import annotations

import contextlib
import copy
import json
import signal
import sys
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from automodel.attention.hf import (
    FEATURES,
    THD_ATTENTION,
    mask_restrictions,
    register_thd_attention,
    thd_attention_forward,
)
from automodel.attention.metadata import ThdAttentionMetadata
from automodel.loss import transform_logits

SUPPORTED_TABLE = Path(__file__).with_name("supported.json")
RTOL = 1e-5
GRAD_FLOOR = 1e-9  # of the largest gradient's norm: the scale below which a gradient is zero
REAL_LENS = (7, 12, 5, 9)  # packed sample lengths; windows and chunks below are shorter than most
WINDOW = 4
PAD_MULTIPLE = 4

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


class NotBuildable(Exception):
    """transformers' own model cannot run the tiny config."""


@dataclass
class Verdict:
    """One model type's entry in the supported table."""

    status: str  # "verified" | "refused" | "not_buildable"
    reason: str = ""
    features: list[str] = field(default_factory=list)
    backends: list[str] = field(default_factory=list)
    ignores: list[str] = field(default_factory=list)  # config fields the type carries but never applies
    max_error: float | None = None


# ---------------------------------------------------------------------------------------------
# tiny configs and models


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


@torch.no_grad()
def perturb_constants(model: nn.Module, seed: int = 0) -> None:
    """Give every parameter (and float persistent buffer such as a router's bias) that holds one
    value throughout a random spread around it, so norms, biases, sinks and scales all matter."""
    g = torch.Generator().manual_seed(seed)
    persistent = set(model.state_dict())
    tensors = list(model.named_parameters()) + [
        (n, b) for n, b in model.named_buffers() if n in persistent and b.is_floating_point()
    ]
    for _, tensor in tensors:
        if tensor.numel() and tensor.is_floating_point() and bool((tensor == tensor.flatten()[0]).all()):
            tensor.add_(0.3 * torch.randn(tensor.shape, generator=g, dtype=tensor.dtype))


# ---------------------------------------------------------------------------------------------
# the packed step vs each sample alone


def sample_pairs(
    vocab: int, seed: int = 0, lengths: tuple[int, ...] = REAL_LENS
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Seeded ``(input_ids, labels)`` of ``lengths`` tokens each, the first two unlabelled (a prompt)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(1, vocab, (n,), generator=g)
        labels = torch.randint(1, vocab, (n,), generator=g)
        labels[:2] = -100
        out.append((ids, labels))
    return out


def check_lengths(sample_tokens: int, row_tokens: int | None = None) -> tuple[int, ...]:
    """Sample lengths of one packed row for the check on a run's own config: a short sample first
    (so the next one starts mid-row), then samples as long as the run's longest, filling a row of
    ``row_tokens`` (else two long samples), so that every length threshold the run can reach (a
    window, a chunk, a block-sparse top-k, a row-index scale) is crossed in the row and in a sample."""
    longest = max(1, int(sample_tokens))
    row = row_tokens or 2 * _padded(longest) + _padded(min(7, longest))
    lengths, used = [min(7, longest)], _padded(min(7, longest))
    while row - used >= PAD_MULTIPLE:
        lengths.append(min(longest, (row - used) // PAD_MULTIPLE * PAD_MULTIPLE))
        used += _padded(lengths[-1])
    return tuple(lengths)


def _padded(n: int) -> int:
    return -(-n // PAD_MULTIPLE) * PAD_MULTIPLE


def packed_row(samples) -> tuple[dict, ThdAttentionMetadata]:
    """The samples as the run lays them out: :func:`build_row` (each padded to ``PAD_MULTIPLE``, as
    for two CP ranks) -> :func:`packed_sequence_thd_collater` -> :func:`make_cp_batch_for_te` (one
    rank), and the layout the trainer gives the model."""
    from automodel.data.collate import build_row, packed_sequence_thd_collater
    from automodel.distributed.cp_sharding import make_cp_batch_for_te

    row = build_row(
        [{"input_ids": x.numpy(), "labels": y.numpy()} for x, y in samples], cp_size=PAD_MULTIPLE // 2
    )
    thd = make_cp_batch_for_te(None, packed_sequence_thd_collater([row]))
    return thd, ThdAttentionMetadata.from_batch(thd)


@dataclass
class _Calls:
    """What the registered attention function saw during one forward."""

    modules: set = field(default_factory=set)
    features: set = field(default_factory=set)


@contextlib.contextmanager
def _recording() -> Iterator[_Calls]:
    """The registered THD function, wrapped to record which modules call it and what they pass."""
    calls = _Calls()

    def recorded(module, query, key, value, attention_mask, *args, **kwargs):
        calls.modules.add(id(module))
        window, chunk = mask_restrictions(module, kwargs.get("sliding_window"))
        for name, present in (
            ("window", window is not None),
            ("chunk", chunk is not None),
            ("softcap", kwargs.get("softcap") is not None),
            ("sinks", kwargs.get("s_aux") is not None),
            ("mla", value.shape[-1] != query.shape[-1]),
        ):
            if present:
                calls.features.add(name)
        return thd_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)

    register_thd_attention(recorded)
    try:
        yield calls
    finally:
        register_thd_attention()


def _reference(config: PretrainedConfig, state: dict, samples) -> tuple[float, torch.Tensor, dict]:
    """Token-mean loss, logits ``[T_real, V]`` and gradients, each sample run alone through the
    class's own ``forward`` (its own attention, head and logit transform) and a float64
    cross-entropy of those logits: nothing of the project's model wrapper, data path or loss."""
    from automodel.models.build import own_attention_implementation

    # a copy: from_config sets the config's attention implementation, which the packed model shares.
    # SDPA where the class has it: transformers' eager attention takes the softmax in float32, whose
    # rounding (1e-7, up to 1e-5 after cancelling gradients: glm4) would read as a layout error.
    config = copy.deepcopy(config)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation=own_attention_implementation(config), dtype=torch.float64
    ).train()
    model.load_state_dict(state, strict=False)
    n_labels = sum(int((y != -100).sum()) for _, y in samples)
    total, logits = 0.0, []
    for x, y in samples:
        try:
            logits_LV = model(input_ids=x[None], use_cache=False).logits[0]
        except Exception as error:  # transformers' own model cannot run this config
            raise NotBuildable(_one_line(error)) from error
        loss = F.cross_entropy(logits_LV.double(), y, ignore_index=-100, reduction="sum") / n_labels
        loss.backward()
        total += float(loss.detach())
        logits.append(logits_LV.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return total, torch.cat(logits), grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm()) / max(float(b.norm()), 1e-12)


def packed_step_errors(
    config: PretrainedConfig,
    *,
    lengths: tuple[int, ...] = REAL_LENS,
    seed: int = 0,
    dense_mask: bool = False,
    compile: bool = False,
):
    """``(errors, calls, max_error)``: one packed row of ``lengths`` samples through the run's data
    path (:func:`packed_row`) and the project's model and loss (with ``dense_mask``, the type's own
    attention under a block-diagonal mask; with ``compile``, its decoder layers compiled as
    ``model.compile`` does) against each sample alone (:func:`_reference`). ``errors`` lists each
    mismatch (empty when exact): the loss, the logits of the worst token (each token against its
    own norm) and each gradient against its own norm."""
    from automodel.models.build import build_model, logit_transform
    from automodel.models.spec import ModelSpec

    config = copy.deepcopy(config)
    # float64 on both sides, so a difference is the layout's, not rounding's; torch's grouped GEMM has
    # no float64 kernel, so MoE experts run transformers' eager loop (the same per-token maths)
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    source = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float64)
    perturb_constants(source, seed)
    state = source.state_dict()
    buffers = dict(source.named_buffers())
    del source
    spec = ModelSpec(config={"model_type": config.model_type}, attention_backend="portable", compile=compile)
    model = build_model(
        spec, config, device=torch.device("cpu"), shard=lambda m: None, seed=0, dense_mask=dense_mask
    ).double()
    model.hf.load_state_dict(state, strict=False)
    for name, value in buffers.items():
        model.hf.get_buffer(name).copy_(value)
    vocab = model.transformers_model.get_output_embeddings().weight.shape[0]
    samples = sample_pairs(min(vocab, getattr(config, "vocab_size", vocab) or vocab), seed, lengths)
    ref_loss, ref_logits, ref_grads = _reference(config, state, samples)

    thd, meta = packed_row(samples)
    n_labels = int((thd["labels"] != -100).sum())
    with _recording() as calls:
        loss = model(thd["input_ids"], thd["position_ids"], thd["labels"], meta) / n_labels
        loss.backward()
        with torch.no_grad():
            hidden = model.hidden_states(thd["input_ids"], thd["position_ids"], meta)
    head = model.transformers_model.get_output_embeddings()
    with torch.no_grad():
        logits = transform_logits(
            torch.nn.functional.linear(hidden, head.weight, head.bias), **logit_transform(model.config)
        )
    real = torch.nonzero(~thd["padding_mask"]).squeeze(1)
    errors = []
    loss_err = abs(float(loss.detach()) - ref_loss) / max(abs(ref_loss), 1e-12)
    token_errs = (logits[real] - ref_logits).norm(dim=-1) / ref_logits.norm(dim=-1).clamp_min(1e-12)
    worst_token = int(token_errs.argmax())
    logit_err = float(token_errs[worst_token])
    if not loss_err <= RTOL:
        errors.append(f"loss rel err {loss_err:.1e}")
    if not logit_err <= RTOL:
        sample = int(torch.searchsorted(torch.tensor(lengths).cumsum(0), worst_token, right=True))
        start = sum(lengths[:sample])
        bad = int((token_errs > RTOL).sum())
        errors.append(
            f"logits rel err {logit_err:.1e} at token {worst_token - start} of sample {sample} "
            f"(lengths {list(lengths)}; {bad} of {len(token_errs)} tokens off)"
        )
    worst = max(loss_err, logit_err)
    grads = {n: p.grad for n, p in model.hf.named_parameters() if p.grad is not None}
    if set(grads) != set(ref_grads):
        errors.append(f"gradient names differ: {sorted(set(grads) ^ set(ref_grads))[:3]}")
    # each gradient against its own norm; one that is zero in exact arithmetic (a key bias) against
    # GRAD_FLOOR of the largest, so that float64 rounding is not read as an error
    floor = GRAD_FLOOR * float(max(g.norm() for g in ref_grads.values()))
    for name in sorted(set(grads) & set(ref_grads)):
        err = float((grads[name] - ref_grads[name]).norm()) / max(float(ref_grads[name].norm()), floor)
        worst = max(worst, err)
        if not err <= RTOL:
            errors.append(f"grad {name} rel err {err:.1e}")
    return errors, calls, worst


# ---------------------------------------------------------------------------------------------
# why a type fails: named reasons

REASONS = {
    "no_attention_interface": "its attention layers do not call transformers' AttentionInterface (own attention "
    "code), and under a block-diagonal mask instead they differ from each sample alone ({})",
    "drops_layout": "its layers drop the forward keywords before attention, so the layout (thd_layout) never "
    "reaches it",
    "recurrent": "recurrent, state-space or convolutional token mixing ({}) carries state across packed samples",
    "own_mask": "its layers pass their own attention mask, which the THD path (no dense mask) cannot honour",
    "bidirectional": "its attention is bidirectional (is_causal=False), not causal within each sample",
    "head": "its output head is more than lm_head on the final hidden states (a projection between them), which "
    "the chunked loss does not compute",
    "ignores_position_ids": "it ignores position_ids (positions come from the row), so packed samples get the "
    "wrong positions",
    "differs": "the packed step differs from each sample alone ({})",
}
_RECURRENT_NAMES = (
    "mamba",
    "rwkv",
    "recurrent",
    "lstm",
    "linearattention",
    "linear_attention",
    "deltanet",
    "shortconv",
    "conv",
    "mixer",
    "lightning",
)


def token_mixers(model: nn.Module) -> list[str]:
    """Class names of modules that mix tokens other than attention (state-space, recurrent,
    convolution across the sequence): evidence for a refusal reason, not the test itself. Not
    counted: image convolutions (``Conv2d``), GPT-2's ``Conv1D`` (a Linear), norms and whole models,
    which carry a mixer's family name without mixing tokens."""
    from transformers.pytorch_utils import Conv1D

    found = set()
    for module in model.modules():
        name = type(module).__name__.lower()
        if isinstance(module, (Conv1D, nn.Conv2d, nn.Conv3d, PreTrainedModel)) or "norm" in name:
            continue
        if isinstance(module, nn.Conv1d) or any(key in name for key in _RECURRENT_NAMES):
            found.add(type(module).__name__)
    return sorted(found)


def _head_is_more_than_lm_head(config: PretrainedConfig, seed: int = 0) -> bool:
    """Whether the class's logits differ from its output embeddings applied to the decoder's final
    hidden states (with the family's logit transform): a projection or norm sits between them."""
    from automodel.models.build import CausalLMForTraining, logit_transform

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        copy.deepcopy(config), attn_implementation="eager", dtype=torch.float64
    ).eval()
    ids = torch.arange(1, 9)[None]
    head = model.get_output_embeddings()
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0]
        hidden = CausalLMForTraining(model).decoder(input_ids=ids, use_cache=False).last_hidden_state[0]
        ours = transform_logits(
            torch.nn.functional.linear(hidden, head.weight, head.bias), **logit_transform(config)
        )
    return _rel(ours, logits) > RTOL


def _ignores_position_ids(config: PretrainedConfig, seed: int = 0) -> bool:
    """Whether shifted ``position_ids`` leave the logits unchanged; False where the class cannot take
    positions past its tokens (a block-sparse indexer sizes its blocks by the sequence)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    ids = torch.arange(1, 9)[None]
    with torch.no_grad():
        a = model(input_ids=ids, position_ids=torch.arange(8)[None], use_cache=False).logits
        try:
            b = model(input_ids=ids, position_ids=torch.arange(8)[None] + 5, use_cache=False).logits
        except (RuntimeError, IndexError):
            return False
    return bool(torch.equal(a, b))


def verify(model_type: str) -> Verdict:
    """The differential for one type's default config (:func:`tiny_config`), with the reason when it
    fails. A window left off by default (``sliding_window: null``) is verified switched on too."""
    try:
        config = tiny_config(model_type)
    except Exception as error:  # any failure to build is recorded as the reason, not raised
        return Verdict("not_buildable", _one_line(error))
    verdict = verify_config(config)
    if verdict.status == "verified" and getattr(config, "sliding_window", 0) is None:
        windowed = copy.deepcopy(config)
        windowed.sliding_window = WINDOW
        with contextlib.suppress(Exception):
            windowed_errors, windowed_calls, windowed_worst = packed_step_errors(windowed)
            if not windowed_errors:
                verdict.features = sorted(set(verdict.features) | set(_features(windowed, windowed_calls)))
                verdict.backends = _backends(verdict.features)
                verdict.max_error = max(verdict.max_error, float(f"{windowed_worst:.1e}"))
    return verdict


def verify_config(
    config: PretrainedConfig, lengths: tuple[int, ...] = REAL_LENS, dense_mask_fallback: bool = True
) -> Verdict:
    """The differential for ``config`` on one packed row of ``lengths`` samples, with the reason when
    it fails. Where the registered THD attention is not exact (or never called), the type's own
    attention under a dense block-diagonal mask is checked next (:func:`verify_dense_mask`); with
    ``dense_mask_fallback`` off only where the layers never call the registered attention (the mask
    is O(T^2): the setup check tries it for the other types only where the type needs it)."""
    config = copy.deepcopy(config)
    config._experts_implementation = "eager"  # every float64 model below: grouped GEMM has no float64 kernel
    try:
        with torch.device("meta"):
            probe = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    except Exception as error:  # any failure to build is recorded as the reason, not raised
        return Verdict("not_buildable", _one_line(error))
    # where the THD path is not exact, recurrent state crossing samples is the reason whatever the attention does
    mixers = token_mixers(probe)
    recurrent = Verdict("refused", REASONS["recurrent"].format(", ".join(mixers)))
    try:
        errors, calls, worst = packed_step_errors(config, lengths=lengths)
    except NotBuildable as error:
        return Verdict("not_buildable", f"its eager forward fails at a tiny size: {error}")
    except Exception as error:  # classified below; the message is kept
        if mixers:
            return recurrent
        message = _one_line(error)
        refusal = None  # transformers' attention table has no entry for the name: its own attention code
        for marker, reason in (
            ("without thd_layout", REASONS["drops_layout"]),
            ("got an attention_mask", REASONS["own_mask"]),
            ("hidden_TD", REASONS["head"]),
            ("is_causal=False", REASONS["bidirectional"]),
        ):
            if marker in message:
                refusal = Verdict("refused", reason)
                break
        else:
            if not ("KeyError" in message and THD_ATTENTION in message):
                refusal = Verdict("refused", REASONS["differs"].format(message))
        return (
            verify_dense_mask(config, refusal, lengths) if dense_mask_fallback or refusal is None else refusal
        )
    if not errors:
        features = _features(config, calls)
        # a window field that no layer applies (verified exact with it set): setup need not restrict it
        ignores = (
            ["sliding_window"] if getattr(config, "sliding_window", None) and "window" not in features else []
        )
        return Verdict(
            "verified",
            features=features,
            backends=_backends(features),
            ignores=ignores,
            max_error=float(f"{worst:.1e}"),
        )
    if mixers:
        return Verdict(
            "refused", f"{recurrent.reason}: {'; '.join(errors[:2])}", max_error=float(f"{worst:.1e}")
        )
    max_error = float(f"{worst:.1e}")
    if not calls.modules:
        refusal = None
    elif _head_is_more_than_lm_head(config):
        refusal = Verdict("refused", REASONS["head"], max_error=max_error)
    elif _ignores_position_ids(config):
        refusal = Verdict("refused", REASONS["ignores_position_ids"], max_error=max_error)
    else:
        refusal = Verdict("refused", REASONS["differs"].format("; ".join(errors[:2])), max_error=max_error)
    return verify_dense_mask(config, refusal, lengths) if dense_mask_fallback or refusal is None else refusal


def verify_dense_mask(
    config: PretrainedConfig, refusal: Verdict | None, lengths: tuple[int, ...] = REAL_LENS
) -> Verdict:
    """The type's own attention code under a dense block-diagonal causal mask
    (:meth:`ThdAttentionMetadata.block_causal_mask`), verified if exact; otherwise ``refusal`` (the
    THD path's reason), or for a type whose layers never call the interface (None) the reason
    naming what the dense-mask run gave."""
    try:
        errors, calls, worst = packed_step_errors(config, lengths=lengths, dense_mask=True)
    except Exception as error:  # the reason is recorded, not raised
        why, max_error = _one_line(error), None
    else:
        if not errors:
            features = sorted(set(_features(config, calls)) | {"dense_mask"})
            return Verdict(
                "verified", features=features, backends=_backends(features), max_error=float(f"{worst:.1e}")
            )
        why, max_error = "; ".join(errors[:2]), float(f"{worst:.1e}")
    if refusal is not None:
        return refusal
    return Verdict("refused", REASONS["no_attention_interface"].format(why), max_error=max_error)


def _one_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    return text[:200]


def _features(config: PretrainedConfig, calls: _Calls) -> list[str]:
    from automodel.models.build import logit_transform

    features = set(calls.features)
    transform = logit_transform(config)
    if transform["logit_scale"] != 1.0:
        features.add("logit_scale")
    if transform["final_logit_softcap"] is not None:
        features.add("final_softcap")
    if any(
        isinstance(getattr(config, n, None), int) and getattr(config, n) > 1
        for n in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    ):
        features.add("moe")
    return sorted(features)


# what each backend cannot compute at all (windows and chunks: only samples within them)
BACKEND_LACKS = {
    backend: {name for name in ("softcap", "sinks", "mla", "dense_mask") if not getattr(features, name)}
    for backend, features in FEATURES.items()
}


def _backends(features: list[str]) -> list[str]:
    return [b for b, lacks in BACKEND_LACKS.items() if not lacks & set(features)]


# ---------------------------------------------------------------------------------------------
# the table


def causal_lm_types() -> list[str]:
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


class _TooSlow(BaseException):  # not caught by the checks' own `except Exception`
    pass


def _too_slow(signum, frame):
    raise _TooSlow


def sweep(types: list[str], log=print, seconds_per_type: int = 120) -> dict[str, dict]:
    """Each type's verdict; a type whose tiny model takes longer than ``seconds_per_type`` is listed
    as not buildable tiny."""
    table = {}
    previous = signal.signal(signal.SIGALRM, _too_slow)
    for model_type in types:
        signal.alarm(seconds_per_type)
        try:
            verdict = verify(model_type)
        except _TooSlow:
            verdict = Verdict("not_buildable", f"its tiny config takes over {seconds_per_type} s to check")
        except Exception as error:  # a bug in a check must not stop the sweep; it is recorded
            verdict = Verdict("refused", REASONS["differs"].format(_one_line(error)))
            log(traceback.format_exc())
        finally:
            signal.alarm(0)
        table[model_type] = {k: v for k, v in asdict(verdict).items() if v not in ("", [], None)}
        log(f"{model_type:28} {verdict.status:13} {verdict.reason or ', '.join(verdict.features)}")
    signal.signal(signal.SIGALRM, previous)
    return table


def write_table(table: dict[str, dict], path: Path = SUPPORTED_TABLE) -> None:
    import transformers

    document = {
        "generated_by": "python -m automodel families --verify",
        "transformers": transformers.__version__,
        "torch": torch.__version__.split("+")[0],
        "rtol": RTOL,
        "types": dict(sorted(table.items())),
    }
    path.write_text(json.dumps(document, indent=1) + "\n")


def read_table(path: Path = SUPPORTED_TABLE) -> dict:
    return json.loads(path.read_text())


def markdown_table(document: dict) -> str:
    """The README's supported-families table, printed from the table file."""
    types = document["types"]
    rows = ["| `model_type` | features | backends |", "|---|---|---|"]
    for name, entry in types.items():
        if entry["status"] == "verified":
            rows.append(
                f"| `{name}` | {', '.join(entry.get('features', [])) or 'plain'} | "
                f"{', '.join(entry['backends'])} |"
            )
    refused = ["| `model_type` | why refused |", "|---|---|"]
    for name, entry in types.items():
        if entry["status"] != "verified":
            kind = "not buildable tiny: " if entry["status"] == "not_buildable" else ""
            refused.append(f"| `{name}` | {kind}{entry['reason'].replace('|', '/')} |")
    counts = {
        s: sum(e["status"] == s for e in types.values()) for s in ("verified", "refused", "not_buildable")
    }
    head = (
        f"transformers {document['transformers']}: {counts['verified']} verified, {counts['refused']} refused, "
        f"{counts['not_buildable']} not buildable tiny, of {len(types)} causal-LM types."
    )
    return "\n".join([head, "", *rows, "", *refused]) + "\n"


def main(argv: list[str]) -> int:
    """``automodel families [--verify [TYPE ...]] [--markdown]``."""
    import argparse
    import logging
    import warnings

    parser = argparse.ArgumentParser(
        prog="automodel families",
        description="The supported model types (automodel/models/supported.json), or re-verify them.",
    )
    parser.add_argument(
        "--verify",
        nargs="*",
        metavar="TYPE",
        help="run the differential check on these types (all causal-LM types when none given) "
        "and update the table",
    )
    parser.add_argument("--markdown", action="store_true", help="print the README table")
    args = parser.parse_args(argv)
    if args.verify is None:
        document = read_table()
        if args.markdown:
            print(markdown_table(document), end="")
        else:
            for name, entry in document["types"].items():
                print(
                    f"{name:28} {entry['status']:13} {entry.get('reason') or ', '.join(entry.get('features', []))}"
                )
        return 0
    unknown = sorted(set(args.verify) - set(causal_lm_types()))
    if unknown:
        print(f"automodel families: not in transformers' causal-LM table: {unknown}", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    table = sweep(args.verify or causal_lm_types())
    document = read_table() if args.verify and SUPPORTED_TABLE.exists() else {"types": {}}
    write_table({**document["types"], **table})
    counts = {
        s: sum(e["status"] == s for e in table.values()) for s in ("verified", "refused", "not_buildable")
    }
    print(
        f"{len(table)} types: {counts['verified']} verified, {counts['refused']} refused, "
        f"{counts['not_buildable']} not buildable tiny; written to {SUPPORTED_TABLE}"
    )
    return 0
