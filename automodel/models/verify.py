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
    keeping one layer of each kind."""
    config = AutoConfig.for_model(model_type)
    _shrink(config)
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if isinstance(sub, PretrainedConfig):
            _shrink(sub)
    return config


def _shrink(config: PretrainedConfig) -> None:
    sizes = dict(_TINY)
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
    for name in ("num_local_experts", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group"):
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
            setattr(config, name, [v for v in value if v < vocab] or None)
    layers = getattr(config, "num_hidden_layers", None)
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layers, int) and isinstance(layer_types, list) and len(layer_types) != layers:
        kinds = list(dict.fromkeys(layer_types))  # first-appearance order
        config.num_hidden_layers = max(layers, len(kinds))
        config.layer_types = (kinds * config.num_hidden_layers)[: config.num_hidden_layers]
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


def sample_pairs(vocab: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Seeded ``(input_ids, labels)`` of ``REAL_LENS`` tokens each, the first two unlabelled (a prompt)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in REAL_LENS:
        ids = torch.randint(1, vocab, (n,), generator=g)
        labels = torch.randint(1, vocab, (n,), generator=g)
        labels[:2] = -100
        out.append((ids, labels))
    return out


def _packed(samples) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, ThdAttentionMetadata]:
    """One packed row (each sample padded to ``PAD_MULTIPLE``, positions counting through padding)."""
    ids, labels, positions, real, padded = [], [], [], [0], [0]
    for x, y in samples:
        p = -(-len(x) // PAD_MULTIPLE) * PAD_MULTIPLE
        ids.append(torch.cat([x, torch.zeros(p - len(x), dtype=x.dtype)]))
        labels.append(torch.cat([y, torch.full((p - len(x),), -100)]))
        positions.append(torch.arange(p))
        real.append(real[-1] + len(x))
        padded.append(padded[-1] + p)
    meta = ThdAttentionMetadata(
        cu_seqlens=torch.tensor(real, dtype=torch.int32),
        cu_seqlens_padded=torch.tensor(padded, dtype=torch.int32),
        max_seqlen=max(b - a for a, b in zip(padded, padded[1:])),
    )
    return torch.cat(ids), torch.cat(positions), torch.cat(labels), meta


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
    class's own attention.

    The logits are the model's own ``forward`` (so the loss head's logit transform is checked
    against them); the loss goes through the same chunked loss as the packed step (float32 logits,
    tested on its own in tests/unit/test_loss.py), so that its rounding is not read as a layout error."""
    from automodel.loss import chunked_cross_entropy_sum
    from automodel.models.build import CausalLMForTraining, logit_transform, own_attention_implementation

    # a copy: from_config sets the config's attention implementation, which the packed model shares.
    # SDPA where the class has it: transformers' eager attention takes the softmax in float32, whose
    # rounding (1e-7, up to 1e-5 after cancelling gradients: glm4) would read as a layout error.
    config = copy.deepcopy(config)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation=own_attention_implementation(config), dtype=torch.float64
    ).train()
    model.load_state_dict(state, strict=False)
    decoder, head = CausalLMForTraining(model).decoder, model.get_output_embeddings()
    n_labels = sum(int((y != -100).sum()) for _, y in samples)
    total, logits = 0.0, []
    for x, y in samples:
        with torch.no_grad():
            try:
                logits.append(model(input_ids=x[None], use_cache=False).logits[0])
            except Exception as error:  # transformers' own model cannot run this tiny config
                raise NotBuildable(_one_line(error)) from error
        hidden = decoder(input_ids=x[None], use_cache=False).last_hidden_state[0]
        loss = chunked_cross_entropy_sum(hidden, head.weight, y, bias_V=head.bias, **logit_transform(config))
        loss = loss / n_labels
        loss.backward()
        total += float(loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return total, torch.cat(logits), grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm()) / max(float(b.norm()), 1e-12)


def packed_step_errors(
    model_type: str,
    config: PretrainedConfig | None = None,
    seed: int = 0,
    dense_mask: bool = False,
    compile: bool = False,
):
    """``(errors, calls, max_error)``: the packed step through the project's builder (with
    ``dense_mask``, the type's own attention under a block-diagonal mask; with ``compile``, its
    decoder layers compiled as ``model.compile`` does) against each sample alone; ``errors`` lists
    each mismatch (empty when exact)."""
    from automodel.models.build import build_model, logit_transform
    from automodel.models.spec import ModelSpec

    config = copy.deepcopy(config or tiny_config(model_type))
    # float64 on both sides, so a difference is the layout's, not rounding's; torch's grouped GEMM has
    # no float64 kernel, so MoE experts run transformers' eager loop (the same per-token maths)
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    source = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float64)
    perturb_constants(source, seed)
    state = source.state_dict()
    buffers = dict(source.named_buffers())
    del source
    spec = ModelSpec(config={"model_type": model_type}, attention_backend="portable", compile=compile)
    model = build_model(
        spec, config, device=torch.device("cpu"), shard=lambda m: None, seed=0, dense_mask=dense_mask
    ).double()
    model.hf.load_state_dict(state, strict=False)
    for name, value in buffers.items():
        model.hf.get_buffer(name).copy_(value)
    vocab = model.transformers_model.get_output_embeddings().weight.shape[0]
    samples = sample_pairs(min(vocab, getattr(config, "vocab_size", vocab) or vocab), seed)
    ref_loss, ref_logits, ref_grads = _reference(config, state, samples)

    ids, positions, labels, meta = _packed(samples)
    n_labels = int((labels != -100).sum())
    with _recording() as calls:
        loss = model(ids, positions, labels, meta) / n_labels
        loss.backward()
        with torch.no_grad():
            hidden = model.hidden_states(ids, positions, meta)
    head = model.transformers_model.get_output_embeddings()
    with torch.no_grad():
        logits = transform_logits(
            torch.nn.functional.linear(hidden, head.weight, head.bias), **logit_transform(model.config)
        )
    real = torch.cat(
        [torch.arange(a, a + n) for a, n in zip(meta.cu_seqlens_padded[:-1].tolist(), REAL_LENS)]
    )
    grads = {n: p.grad for n, p in model.hf.named_parameters() if p.grad is not None}
    errors, worst = [], 0.0
    loss_err = abs(float(loss.detach()) - ref_loss) / max(abs(ref_loss), 1e-12)
    logit_err = _rel(logits[real], ref_logits)
    for what, err in (("loss", loss_err), ("logits", logit_err)):
        worst = max(worst, err)
        if not err <= RTOL:
            errors.append(f"{what} rel err {err:.1e}")
    # a gradient that is zero in exact arithmetic (a key bias) is compared against a floor, not itself
    floor = 1e-2 * float(torch.stack([g.norm() for g in ref_grads.values()]).median())
    if set(grads) != set(ref_grads):
        errors.append(f"gradient names differ: {sorted(set(grads) ^ set(ref_grads))[:3]}")
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
        ours = transform_logits(torch.nn.functional.linear(hidden, head.weight, head.bias), **logit_transform(config))
    return _rel(ours, logits) > RTOL


def _ignores_position_ids(config: PretrainedConfig, seed: int = 0) -> bool:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    ids = torch.arange(1, 9)[None]
    with torch.no_grad():
        a = model(input_ids=ids, position_ids=torch.arange(8)[None], use_cache=False).logits
        b = model(input_ids=ids, position_ids=torch.arange(8)[None] + 5, use_cache=False).logits
    return bool(torch.equal(a, b))


def verify(model_type: str) -> Verdict:
    """The differential for one type, with the reason when it fails. Where the registered THD
    attention is not exact (or never called), the type's own attention under a dense
    block-diagonal mask is checked next (:func:`verify_dense_mask`)."""
    try:
        config = tiny_config(model_type)
        with torch.device("meta"):
            probe = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    except Exception as error:  # any failure to build is recorded as the reason, not raised
        return Verdict("not_buildable", _one_line(error))
    # where the THD path is not exact, recurrent state crossing samples is the reason whatever the attention does
    mixers = token_mixers(probe)
    recurrent = Verdict("refused", REASONS["recurrent"].format(", ".join(mixers)))
    try:
        errors, calls, worst = packed_step_errors(model_type, config)
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
        return verify_dense_mask(model_type, config, refusal)
    if not errors:
        features = _features(config, calls)
        # a window field that no layer applies (verified exact with it set): setup need not restrict it
        ignores = (
            ["sliding_window"] if getattr(config, "sliding_window", None) and "window" not in features else []
        )
        if getattr(config, "sliding_window", 0) is None:  # off by default: verified with one too, if exact
            windowed = copy.deepcopy(config)
            windowed.sliding_window = WINDOW
            with contextlib.suppress(Exception):
                windowed_errors, windowed_calls, windowed_worst = packed_step_errors(model_type, windowed)
                if not windowed_errors:
                    features = sorted(set(features) | set(_features(windowed, windowed_calls)))
                    worst = max(worst, windowed_worst)
        return Verdict(
            "verified",
            features=features,
            backends=_backends(features),
            ignores=ignores,
            max_error=float(f"{worst:.1e}"),
        )
    if mixers:
        return recurrent
    max_error = float(f"{worst:.1e}")
    if not calls.modules:
        refusal = None
    elif _head_is_more_than_lm_head(config):
        refusal = Verdict("refused", REASONS["head"], max_error=max_error)
    elif _ignores_position_ids(config):
        refusal = Verdict("refused", REASONS["ignores_position_ids"], max_error=max_error)
    else:
        refusal = Verdict("refused", REASONS["differs"].format("; ".join(errors[:2])), max_error=max_error)
    return verify_dense_mask(model_type, config, refusal)


def verify_dense_mask(model_type: str, config: PretrainedConfig, refusal: Verdict | None) -> Verdict:
    """The type's own attention code under a dense block-diagonal causal mask
    (:meth:`ThdAttentionMetadata.block_causal_mask`), verified if exact; otherwise ``refusal`` (the
    THD path's reason), or for a type whose layers never call the interface (None) the reason
    naming what the dense-mask run gave."""
    try:
        errors, calls, worst = packed_step_errors(model_type, config, dense_mask=True)
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
