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
(feature ``dense_mask``). A model whose layers mix tokens besides attention (recurrent, state-space,
short-convolution mixers: :mod:`automodel.models.mixers`) is checked with those mixers run per
sample (feature ``stateful_mixer``), on a row with a sample past their chunk sizes, a one-token
sample and padding after the last sample.

Training noise: the comparison runs with the config's noise fields at 0 (:func:`without_noise`:
dropout, jitter, a router's sampling), and the run trains with them as configured: drawn per element
or per token, they have one distribution whether samples are packed or not (no unpacked run draws
another run's numbers either). Noise drawn once per row or sequence, which packing would share among
the samples of a row, is refused naming its field (:func:`shared_noise`); so is noise no field turns
off (the comparison cannot run). Attention dropout is refused earlier, at setup: the THD kernels
apply none (:func:`automodel.models.setup.check_config_fields`).

``automodel families --verify`` (:mod:`automodel.models.support`) runs it over every type of
transformers' causal-LM table and writes ``automodel/models/supported.json``, which setup reads
(:func:`automodel.models.setup.check_model_config`): a type is trained only when it is listed
as verified there. Each other type is listed with why: refused (a named reason) or not buildable
tiny (the error of building it).

Shape legend: T = packed tokens, V = vocabulary.
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)

from automodel.attention.hf import (
    FEATURES,
    THD_ATTENTION,
    mask_restrictions,
    register_thd_attention,
    thd_attention_forward,
)
from automodel.data import collate
from automodel.loss import CROSS_ENTROPY_IGNORE_INDEX, transform_logits
from automodel.models.build import (
    CausalLMForTraining,
    build_model,
    logit_transform,
    own_attention_implementation,
)
from automodel.models.inputs import model_inputs, padding_token_id
from automodel.models.mixers import probe_mixers
from automodel.models.router_aux import load_balancing_loss
from automodel.models.spec import ModelSpec
from automodel.models.tiny import depth_config, length_fields

RTOL = 1e-5
GRAD_FLOOR = 1e-9  # of the largest gradient's norm: the scale below which a gradient is zero
REAL_LENS = (7, 12, 5, 9)  # packed sample lengths; windows and chunks below are shorter than most
PAD_MULTIPLE = 4
# the chunk of the gated delta rule (transformers' torch path and flash-linear-attention's kernels);
# a stateful mixer's check crosses it and the config's own chunk sizes (tiny Mamba-2: 16)
MIXER_CHUNK = 64
TAIL_PADDING = PAD_MULTIPLE  # padding after the last sample of every checked row


class NotBuildable(Exception):
    """transformers' own model (``model_class``, a class name) cannot run the checked config."""

    def __init__(self, model_class: str, error: str):
        super().__init__(model_class, error)
        self.model_class, self.error = model_class, error

    def __str__(self) -> str:
        return f"transformers' own {self.model_class} fails on it: {self.error}"


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
    """Seeded ``(input_ids, labels)`` of ``lengths`` tokens each, the first two unlabelled (a prompt)
    while a label is left (a sample of one or two tokens keeps its last)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(1, vocab, (n,), generator=g)
        labels = torch.randint(1, vocab, (n,), generator=g)
        labels[: min(2, n - 1)] = CROSS_ENTROPY_IGNORE_INDEX
        out.append((ids, labels))
    return out


# The long sample's length where no threshold of the config asks for more, and how far past a
# threshold the check goes.
BASE_TOKENS = 64


def check_lengths(
    sample_tokens: int, row_tokens: int | None = None, thresholds: Iterable[int] = ()
) -> tuple[int, ...]:
    """Sample lengths of one packed row for the check on a run's own config: a short sample first
    (so the next one starts mid-row), then a long one, then more long ones while the row needs them;
    the long one alone where the run's row has no room for both.

    The long samples go ``BASE_TOKENS`` past every threshold below the run's longest sample
    (``sample_tokens``), the row past every one below the run's longest row (``row_tokens``; None:
    the short and the long sample) (``thresholds``: the config's length fields,
    :func:`~automodel.models.tiny.length_fields`), so that each threshold the run can reach (a
    window, a chunk, a block-sparse top-k, a row-index floor) is crossed by a sample and by a row
    index; neither is longer than the run's, nor than that asks: the full length only where a
    threshold lies near it (the check's cost grows with the square of the samples).

    Example (a window of 4,096, samples up to 32,768 in rows of 65,536)::

        check_lengths(32768, 65536, [4096]) == (7, 4160)
    """
    longest = max(1, int(sample_tokens))

    def past(bound: int) -> int:  # the length that crosses every threshold below bound
        return min(bound, max([BASE_TOKENS, *(v + BASE_TOKENS for v in thresholds if v < bound)]))

    first = min(7, longest)
    sample = past(longest)
    row = _padded(first) + _padded(sample)
    if row_tokens is not None:
        row = max(_padded(first), min(row_tokens, max(row, past(row_tokens))))
    if row - _padded(first) < sample:  # no room for a long sample beside the short one: the long one alone
        return (sample,)
    lengths, used = [first], _padded(first)
    while row - used >= PAD_MULTIPLE:
        lengths.append(min(sample, (row - used) // PAD_MULTIPLE * PAD_MULTIPLE))
        used += _padded(lengths[-1])
    return tuple(lengths)


def mixer_lengths(config: PretrainedConfig) -> tuple[int, ...]:
    """The sweep's row for a model with stateful token mixers: a one-token sample, and a sample past
    ``MIXER_CHUNK`` and every chunk or block length of ``config`` (a Mamba-2 ``chunk_size``, a
    lightning attention's ``block_size``), so that state crosses a chunk inside a sample.

    Example (a tiny Mamba-2 config, ``chunk_size`` 16): ``(7, 1, 70, 12)``."""
    chunks = [v for k, v in length_fields(config).items() if re.search("chunk|block", k.rsplit(".", 1)[-1])]
    return (7, 1, max([MIXER_CHUNK, *chunks]) + 6, 12)


def _padded(n: int) -> int:
    return -(-n // PAD_MULTIPLE) * PAD_MULTIPLE


def packed_row(samples, vocab_size: int, padding_idx: int = 0) -> dict:
    """The samples as the run lays them out: ``build_row`` (each padded to ``PAD_MULTIPLE``, as for
    two CP ranks, with ``padding_idx``, and ``TAIL_PADDING`` slots after the last, as in a row padded
    to its pack size) -> ``packed_sequence_thd_collater`` -> :func:`model_inputs` (one rank), the
    recipe's own road to the model. Looked up in :mod:`automodel.data.collate` at each call, so the
    check runs whatever the data path is."""
    length = sum(_padded(len(x)) for x, _ in samples) + TAIL_PADDING
    row = collate.build_row(
        [{"input_ids": x.numpy(), "labels": y.numpy()} for x, y in samples],
        padding_idx,
        PAD_MULTIPLE // 2,
        length,
    )
    return model_inputs(collate.packed_sequence_thd_collater([row]), vocab_size=vocab_size)


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


def _reference(config: PretrainedConfig, state: dict, samples) -> tuple[float, torch.Tensor, dict, float]:
    """Token-mean loss, logits ``[T_real, V]``, gradients and the class's own added loss term, each
    sample run alone through the class's own ``forward`` (its own attention, head and logit
    transform) and a float64 cross-entropy of those logits: nothing of the project's model wrapper,
    data path or loss. A term the class adds to its loss over a batch (a router load-balancing loss
    under ``output_router_logits``) is the class's own on the samples as one padded batch with its
    attention mask (:func:`_added_loss`), and is in the loss and the gradients too."""

    # a copy: from_config sets the config's attention implementation, which the packed model shares.
    # SDPA where the class has it: transformers' eager attention takes the softmax in float32, whose
    # rounding (1e-7, up to 1e-5 after cancelling gradients: glm4) would read as a layout error.
    config = copy.deepcopy(config)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation=own_attention_implementation(config), dtype=torch.float64
    ).train()
    model.load_state_dict(state, strict=False)
    n_labels = sum(int((y != CROSS_ENTROPY_IGNORE_INDEX).sum()) for _, y in samples)
    total, logits, batch_terms = 0.0, [], False
    for x, y in samples:
        try:
            out = model(input_ids=x[None], use_cache=False)
        except Exception as error:  # transformers' own model cannot run this config
            raise NotBuildable(type(model).__name__, one_line(error)) from error
        batch_terms |= any(k.endswith("loss") and k != "loss" and v is not None for k, v in out.items())
        logits_LV = out.logits[0]
        loss = (
            F.cross_entropy(logits_LV.double(), y, ignore_index=CROSS_ENTROPY_IGNORE_INDEX, reduction="sum")
            / n_labels
        )
        loss.backward()
        total += float(loss.detach())
        logits.append(logits_LV.detach())
    added = 0.0
    if batch_terms:
        added_loss = _added_loss(model, [x for x, _ in samples])
        added_loss.backward()
        added = float(added_loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return total + added, torch.cat(logits), grads, added


def _added_loss(model: PreTrainedModel, inputs: list[torch.Tensor]) -> torch.Tensor:
    """What the class's ``forward`` adds to its own cross-entropy (``loss_function`` of its logits) on
    ``inputs`` as one right-padded batch with its attention mask: its batch-level terms."""
    longest = max(len(x) for x in inputs)
    ids = torch.zeros(len(inputs), longest, dtype=torch.long)
    mask = torch.zeros(len(inputs), longest, dtype=torch.long)
    for i, x in enumerate(inputs):
        ids[i, : len(x)], mask[i, : len(x)] = x, 1
    labels = ids.masked_fill(mask == 0, CROSS_ENTROPY_IGNORE_INDEX)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    return out.loss - model.loss_function(out.logits, labels, vocab_size=out.logits.shape[-1])


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
    ref_loss, ref_logits, ref_grads, ref_added = _reference(config, state, samples)

    thd = packed_row(samples, vocab, padding_token_id(config, None))
    meta = thd["attn_meta"]
    inputs = (thd["input_ids"], thd["position_ids"], thd["labels"], meta, thd["label_positions"])
    # the logits from the loss's own forward: the decoder's final hidden states, kept by a hook
    kept = {}

    def keep_hidden(module, args, output) -> None:  # None: the output passes on unchanged
        kept.setdefault("hidden", output.last_hidden_state[0].detach())

    hook = model.decoder.register_forward_hook(keep_hidden)
    with _recording() as calls:
        added = torch.zeros((), dtype=torch.float64)
        if model.router_aux is None:
            loss = model(*inputs) / thd["label_tokens"]
        else:  # the class's batch-level term, from this row's router statistics
            loss, stats = model(*inputs, real_T=~thd["padding_mask"])
            added = model.router_aux.coef * load_balancing_loss(stats, model.router_aux.num_experts)
            loss = loss / thd["label_tokens"] + added
        loss.backward()
    hook.remove()
    hidden = kept["hidden"]
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
    # against the whole loss: the class adds its term in float32 to a float32 cross-entropy, so the
    # term alone is known to float32 rounding of the loss (its gradients, compared below, are exact)
    added_err = abs(float(added.detach()) - ref_added) / max(abs(ref_loss), 1e-12)
    if ref_added and not added_err <= RTOL:  # named first: a wrong loss term shows in every gradient too
        errors.insert(
            0,
            f"the class's forward adds {ref_added:.3e} to its loss over the batch (output_router_logits: a router "
            f"load-balancing loss), the packed step {float(added.detach()):.3e}",
        )
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
    "recurrent": "recurrent, state-space or convolutional token mixing ({}) differs from each sample alone even "
    "run per sample",
    "own_mask": "its layers pass their own attention mask, which the THD path (no dense mask) cannot honour",
    "bidirectional": "its attention is bidirectional (is_causal=False), not causal within each sample",
    "head": "its output head is more than lm_head on the final hidden states (a projection between them), which "
    "the chunked loss does not compute",
    "ignores_position_ids": "it ignores position_ids (positions come from the row), so packed samples get the "
    "wrong positions",
    "differs": "the packed step differs from each sample alone ({})",
    "dense_differs": "under a block-diagonal mask its own attention differs from each sample alone ({}), and the "
    "registered THD attention cannot run it ({})",
    "random": "its forward in train mode draws random numbers ({}) that no dropout, jitter or noise field of its "
    "config turns off, so the check cannot compare a packed row with each sample alone",
    "shared_noise": "its forward in train mode draws noise once per row or sequence ({}), which packing would share "
    "among the samples of a row; {}",
}


def _head_is_more_than_lm_head(config: PretrainedConfig, seed: int = 0) -> bool:
    """Whether the class's logits differ from its output embeddings applied to the decoder's final
    hidden states (with the family's logit transform): a projection or norm sits between them."""

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


# tokens of the train-mode probe: enough that a router drawing for a tenth of the tokens draws at least once
RANDOM_PROBE_TOKENS = 64


def random_layers(config: PretrainedConfig, seed: int = 0) -> str | None:
    """None when the class's forward and backward in train mode give the same loss and gradients on
    the same tokens under two seeds; otherwise why not (:data:`REASONS` ``random``). Run on the config
    with its noise off (:func:`without_noise`): what still draws, no field turns off."""
    config = copy.deepcopy(config)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation=own_attention_implementation(config), dtype=torch.float64
    ).train()
    perturb_constants(model, seed)
    ids = torch.arange(RANDOM_PROBE_TOKENS)[None] % max(1, config.get_text_config().vocab_size - 1) + 1
    runs = []
    for draw in (seed, seed + 1):
        model.zero_grad()
        torch.manual_seed(draw)
        try:
            loss = model(input_ids=ids, use_cache=False).logits.square().mean()
        except Exception as error:  # transformers' own model cannot run this config
            raise NotBuildable(type(model).__name__, one_line(error)) from error
        loss.backward()
        runs.append([loss.detach(), *(p.grad.clone() for p in model.parameters() if p.grad is not None)])
    if all(torch.equal(a, b) for a, b in zip(*runs)):
        return None
    return REASONS["random"].format("two runs on the same tokens differ")


_RANDOM_FIELD = re.compile(r"dropout|pdrop|jitter|noise")


def noise_fields(config: PretrainedConfig) -> dict[str, float]:
    """The config's fields that turn on noise in train mode: every float above 0 named like dropout,
    jitter or noise (``hidden_dropout``, ``router_jitter_noise``), dotted inside sub-configs."""
    return {
        name: value for name, value in _numbers(config.to_dict())
        if isinstance(value, float) and value > 0 and _RANDOM_FIELD.search(name.rsplit(".", 1)[-1])
    }  # fmt: skip


def without_noise(config: PretrainedConfig, names: Iterable[str] | None = None) -> PretrainedConfig:
    """A copy of ``config`` with its noise fields (:func:`noise_fields`, or those ``names``) at 0: the
    model the differential check compares. Training keeps them: dropout and jitter drawn per element
    or per token have one distribution whether samples are packed or not."""
    config = copy.deepcopy(config)
    for name in noise_fields(config) if names is None else names:
        *path, field = name.split(".")
        part = config
        for key in path:
            part = getattr(part, key)
        setattr(part, field, 0.0)
    return config


class _Draws(TorchDispatchMode):
    """The number of values each random operation draws (ops tagged ``nondeterministic_seeded``:
    dropout, ``uniform_``, ``exponential_``...), in call order."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.Tag.nondeterministic_seeded in func.tags:
            first = out[0] if isinstance(out, (tuple, list)) else out
            size = first.numel() if isinstance(first, torch.Tensor) else 0
            self.sizes.append((func.overloadpacket.__name__, size))
        return out


# (rows, tokens per row) of the probes that tell noise per token from noise per row: the tokens change
# between the first two, the rows between the first and the last
_SHARED_NOISE_PROBES = ((1, 29), (1, 43), (2, 29))


def _row_draws(config: PretrainedConfig) -> list[tuple[str, int]]:
    """The random draws of a train-mode forward whose size follows the number of rows, not of tokens:
    noise drawn once per row or sequence (shape ``[B, 1, ...]``), which packing shares among samples."""
    model = AutoModelForCausalLM.from_config(
        copy.deepcopy(config), attn_implementation=own_attention_implementation(config)
    ).train()
    vocab = max(2, config.get_text_config().vocab_size)
    runs = []
    for rows, tokens in _SHARED_NOISE_PROBES:
        ids = torch.arange(rows * tokens).reshape(rows, tokens) % (vocab - 1) + 1
        with torch.no_grad(), _Draws() as draws:
            try:
                model(input_ids=ids, use_cache=False)
            except Exception as error:  # transformers' own model cannot run this config
                raise NotBuildable(type(model).__name__, one_line(error)) from error
        runs.append(draws.sizes)
        if not draws.sizes:  # nothing drawn at all
            return []
    one, longer, two = runs
    if len(one) == len(longer) == len(two) and [n for n, _ in one] == [n for n, _ in longer] == [
        n for n, _ in two
    ]:
        pairs = zip(one, longer, two, strict=True)
        return [
            (name, size) for (name, size), (_, b), (_, c) in pairs if size and b == size and c == 2 * size
        ]
    # the draws differ in number (a router's experts draw only where tokens go): by size, op by op
    return [(name, size) for name, size in one if (name, size) in longer and (name, 2 * size) in two]


def shared_noise(config: PretrainedConfig) -> str | None:
    """Why the config is refused when its forward in train mode draws noise once per row or sequence
    (:func:`_row_draws`), naming the noise fields that turn it on; None when every draw follows the
    tokens (dropout, jitter, a router's sampling: one distribution packed or not) or none happens."""
    draws = _row_draws(config)
    if not draws:
        return None
    fields = noise_fields(config)
    named = [name for name in fields if not _row_draws(without_noise(config, [name]))]
    what = ", ".join(sorted({f"{op}: one value per row" for op, _ in draws}))
    if not named:
        return REASONS["shared_noise"].format(
            what, "no dropout, jitter or noise field of its config turns it off"
        )
    listed = ", ".join(f"{name}={fields[name]}" for name in named)
    return REASONS["shared_noise"].format(
        f"{listed}: {what}", f"set {' and '.join(f'{n}: 0.0' for n in named)} in model.config"
    )


def _numbers(node: dict, prefix: str = ""):
    """``(dotted name, value)`` of every leaf of a config dict."""
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _numbers(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def runs_at_own_sizes(config: PretrainedConfig) -> bool | None:
    """Whether transformers' own class runs ``config`` at its own widths (cut in depth to one layer
    of each kind: :func:`~automodel.models.tiny.depth_config`) on the meta device, on 8 tokens: True
    when it does, False when it raises, None when the meta device cannot tell (an op with no meta
    kernel, or one that reads values)."""
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(depth_config(config))
            model(input_ids=torch.ones(1, 8, dtype=torch.long), use_cache=False)
    except (NotImplementedError, RuntimeError) as error:
        return (
            False if "meta" not in str(error).lower() and not isinstance(error, NotImplementedError) else None
        )
    except Exception:  # noqa: BLE001  (any other error of transformers' own forward)
        return False
    return True


def not_buildable(error: NotBuildable, own_config: PretrainedConfig | None) -> Verdict:
    """The verdict when transformers' own class fails on the checked (reduced-size) config: named as
    transformers' failure where it fails at ``own_config``'s sizes too (:func:`runs_at_own_sizes`),
    or, where the meta device cannot tell, where the error is not about shapes (a field the config
    leaves None); a shape error there is the reduction's."""
    own = None if own_config is None else runs_at_own_sizes(own_config)
    if own is False:
        return Verdict("not_buildable", f"{error} (at its own sizes too)")
    if own is None and not re.search(r"\bsize\b|\bshape\b|dimension", error.error):
        return Verdict("not_buildable", f"{error} (at a reduced size)")
    if own:
        return Verdict(
            "not_buildable",
            f"the check's reduced-size copy of it does not run in transformers' {error.model_class} "
            f"({error.error}), while the config does at its own sizes: a width the check cannot shrink",
        )
    return Verdict(
        "not_buildable",
        f"its reduced-size copy does not run in transformers' {error.model_class}: {error.error}",
    )


def verify_config(
    config: PretrainedConfig,
    lengths: tuple[int, ...] = REAL_LENS,
    dense_mask_fallback: bool = True,
    own_config: PretrainedConfig | None = None,
) -> Verdict:
    """The differential for ``config`` on one packed row of ``lengths`` samples, with the reason when
    it fails. Where the registered THD attention is not exact (or never called), the type's own
    attention under a dense block-diagonal mask is checked next (:func:`verify_dense_mask`); with
    ``dense_mask_fallback`` off only where the layers never call the registered attention (the mask
    is O(T^2): the setup check tries it for the other types only where the type needs it).
    ``own_config``: the config ``config`` was reduced from, to tell whether a failure of
    transformers' own class is the config's or the reduction's (:func:`not_buildable`)."""
    config = copy.deepcopy(config)
    config._experts_implementation = "eager"  # every float64 model below: grouped GEMM has no float64 kernel
    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(copy.deepcopy(config))
    except Exception as error:  # any failure to build is recorded as the reason, not raised
        return Verdict("not_buildable", f"transformers cannot build it at a reduced size: {one_line(error)}")
    mixers, hybrid = [], False
    try:
        try:  # in eval mode: the first run of transformers' own class on the config
            probe = probe_mixers(config)
        except Exception as error:
            model_class = AutoModelForCausalLM._model_mapping[type(config)].__name__
            raise NotBuildable(model_class, one_line(error)) from error
        mixers = [c.__name__ for c in probe.classes]
        # a hybrid: where it is not exact, its mixers are the first suspects; a model whose layers never
        # call the registered attention is judged as one (its own attention code under a dense mask)
        hybrid = bool(mixers) and probe.calls_attention
        shared = shared_noise(config)
        if shared is not None:
            return Verdict("refused", shared)
        # compared with the model's noise off; the run trains with it (drawn per element or token)
        config = without_noise(config)
        randomness = random_layers(config)
        if randomness is not None:
            return Verdict("refused", randomness)
        errors, calls, worst = packed_step_errors(config, lengths=lengths)
    except NotBuildable as error:
        return not_buildable(error, own_config)
    except Exception as error:  # classified below; the message is kept
        message = one_line(error)
        if hybrid:
            refusal = Verdict("refused", f"{REASONS['recurrent'].format(', '.join(mixers))}: {message}")
            return verify_dense_mask(config, refusal, lengths) if dense_mask_fallback else refusal
        if mixers:  # never calls the registered attention: its own attention code decides
            return verify_dense_mask(config, None, lengths)
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
                if dense_mask_fallback:  # the THD path cannot run it: the dense mask decides
                    return verify_dense_mask(config, refusal, lengths, thd_error=message)
        return (
            verify_dense_mask(config, refusal, lengths) if dense_mask_fallback or refusal is None else refusal
        )
    if not errors:
        features = features_of(config, calls, mixers)
        # a window field that no layer applies (verified exact with it set): setup need not restrict it
        ignores = (
            ["sliding_window"] if getattr(config, "sliding_window", None) and "window" not in features else []
        )
        return Verdict(
            "verified",
            features=features,
            backends=backends_for(features),
            ignores=ignores,
            max_error=float(f"{worst:.1e}"),
        )
    max_error = float(f"{worst:.1e}")
    if hybrid:
        refusal = Verdict(
            "refused",
            f"{REASONS['recurrent'].format(', '.join(mixers))}: {'; '.join(errors[:2])}",
            max_error=max_error,
        )
        return verify_dense_mask(config, refusal, lengths) if dense_mask_fallback else refusal
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
    config: PretrainedConfig,
    refusal: Verdict | None,
    lengths: tuple[int, ...] = REAL_LENS,
    thd_error: str | None = None,
) -> Verdict:
    """The type's own attention code under a dense block-diagonal causal mask
    (:meth:`ThdAttentionMetadata.block_causal_mask`), verified if exact; otherwise the reason of what
    decided: ``refusal`` (the THD path's reason where it ran and differed), the dense-mask run's
    result where the THD path could not run at all (``thd_error``, quoted after it), or for a type
    whose layers never call the interface (``refusal`` None) the dense-mask run's result."""
    try:
        errors, calls, worst = packed_step_errors(config, lengths=lengths, dense_mask=True)
    except Exception as error:  # the reason is recorded, not raised
        why, max_error = one_line(error), None
    else:
        if not errors:  # the stateful mixers are not wrapped under a dense mask (build_model)
            features = sorted(set(features_of(config, calls)) | {"dense_mask"})
            return Verdict(
                "verified",
                features=features,
                backends=backends_for(features),
                max_error=float(f"{worst:.1e}"),
            )
        why, max_error = "; ".join(errors[:2]), float(f"{worst:.1e}")
    if thd_error is not None:
        return Verdict("refused", REASONS["dense_differs"].format(why, thd_error), max_error=max_error)
    if refusal is not None:
        return refusal
    return Verdict("refused", REASONS["no_attention_interface"].format(why), max_error=max_error)


def one_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    return text[:200]


def features_of(config: PretrainedConfig, calls: _Calls, mixers: Iterable[str] = ()) -> list[str]:
    """What the verified model uses: the attention features its layers passed (``calls``), the
    family's logit transform, MoE, and ``stateful_mixer`` where ``mixers`` (class names) ran per sample."""
    features = set(calls.features)
    if mixers:
        features.add("stateful_mixer")
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


def backends_for(features: list[str]) -> list[str]:
    return [b for b, lacks in BACKEND_LACKS.items() if not lacks & set(features)]


# ---------------------------------------------------------------------------------------------
# the table
