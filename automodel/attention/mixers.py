"""Stateful token mixers on the THD path: every sample starts from an empty state.

A hybrid model's recurrent, state-space and short-convolution layers (Gated DeltaNet, Mamba and
Mamba-2 mixers, short convolutions, lightning and KDA attention) carry a convolution window and a
recurrent state along the sequence. Run over a packed row as transformers writes them, the state
of one sample flows into the next. Beside the registered THD attention, the same layout
(:class:`ThdAttentionMetadata`) tells each such module where its samples start:
:func:`attach_stateful_mixers` wraps the forward of each module of the given classes (found by
:mod:`automodel.models.mixers`), never rewriting it, so that the module runs over each padded
sequence of the row as if that were its whole input, with transformers' cache off. A sample's
padding follows its real tokens, so in causal mixing it never reaches them; the module's output
on padding is finite and carries no label.

Two backends, chosen per mixer class (:func:`automodel.models.mixers.mixer_kernel_classes`):

- ``reference``: torch alone on any device. The sequences of one padded length go through the
  module as one batch, so a row costs one call per distinct sequence length and O(T) work in all.
- ``kernels``: one call per layer, the module's own forward with the layout as the keywords
  transformers hands to the kernels it calls where they are installed (:func:`kernel_keywords`):
  flash-linear-attention's chunked gated delta rule and KDA take ``cu_seqlens``, causal-conv1d's
  convolution and mamba-ssm's Mamba-2 scan take ``seq_idx``. transformers' torch fallbacks refuse
  those keywords, and a class with an installed kernel the layout does not reach (mamba-ssm's Mamba
  scan) is never given this path
  (:func:`automodel.models.mixers.kernels_missing`), so it never silently runs without them.

How the layout reaches a module that transformers calls without it: :func:`layout_scope` holds it
in a context variable around the decoder's forward; under activation checkpointing the recompute
of a layer in the backward runs inside the same scope again (:func:`checkpoint_context_fn`, torch's
``context_fn``); the wrapper runs eagerly under ``torch.compile`` (``torch.compiler.disable``), so it
reads the layout's host ints outside any graph.

Context parallelism: each rank holds a share of every sequence. A wrapped module all-gathers its
per-token inputs over ``meta.cp_group`` (the backward reduce-scatters their gradients to their
owners), runs every whole sequence and keeps this rank's tokens: exact, at the cost of the mixer
computed ``cp_size`` times and one all-gather of its input per layer.

Shape legend: t = this rank's tokens, T = tokens of the global batch, L = one sequence's padded
length, k = sequences of one padded length, D = hidden size.
"""

from __future__ import annotations

import contextvars
import functools
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from automodel.attention.metadata import ThdAttentionMetadata
from automodel.attention.portable import gather_tokens, inverse_permutation

_LAYOUT: contextvars.ContextVar[ThdAttentionMetadata | None] = contextvars.ContextVar(
    "automodel_thd_layout", default=None
)
_WRAPPED = "_automodel_stateful_mixer"
# keywords the decoder layers hand down that describe the packed row to attention kernels: the
# wrapper runs each sequence alone, so none of them may reach the module
_LAYOUT_KEYWORDS = (
    "thd_layout", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "cu_seqlens",
)  # fmt: skip


class layout_scope:  # noqa: N801  (a context manager used like a function)
    """Hold ``meta`` as the current THD layout while inside (re-enterable: the checkpoint recompute
    of a layer enters it again)."""

    def __init__(self, meta: ThdAttentionMetadata | None):
        self.meta, self._tokens = meta, []

    def __enter__(self) -> ThdAttentionMetadata | None:
        self._tokens.append(_LAYOUT.set(self.meta))
        return self.meta

    def __exit__(self, *exc) -> None:
        _LAYOUT.reset(self._tokens.pop())


def checkpoint_context_fn() -> tuple[Any, layout_scope]:
    """``context_fn`` for ``torch.utils.checkpoint`` (non-reentrant): the layer's recompute in the
    backward sees the layout its forward saw."""
    return layout_scope(_LAYOUT.get()), layout_scope(_LAYOUT.get())


MIXER_BACKENDS = ("auto", "reference", "kernels")


def attach_stateful_mixers(
    model: nn.Module, classes: Iterable[type], kernels: Mapping[type, tuple[str, ...]] | None = None
) -> list[nn.Module]:
    """Wrap the forward of every module of ``model`` whose class is one of ``classes`` so that each
    sample of the current layout starts from an empty state (:func:`mixer_forward`): through its
    own kernels, one call per layer with the layout keywords ``kernels`` names for its class
    (:func:`kernel_keywords`), for a class in ``kernels``, else per sequence (the reference path).
    The module tree, its parameters and ``state_dict()`` names stay as they are. Returns the wrapped
    modules."""
    classes, kernels = tuple(classes), dict(kernels or {})
    wrapped = []
    for module in model.modules():
        if classes and isinstance(module, classes) and not module.__dict__.get(_WRAPPED):
            names = next((n for cls, n in kernels.items() if isinstance(module, cls)), None)
            backend = "reference" if names is None else "kernels"
            module.forward = torch.compiler.disable(
                functools.partial(mixer_forward, module.forward, backend, names or ())
            )
            module.__dict__[_WRAPPED] = backend
            wrapped.append(module)
    return wrapped


def stateful_mixer_modules(model: nn.Module) -> list[nn.Module]:
    """The modules :func:`attach_stateful_mixers` wrapped."""
    return [m for m in model.modules() if m.__dict__.get(_WRAPPED)]


def mixer_backend_of(module: nn.Module) -> str | None:
    """``reference`` or ``kernels``: how :func:`attach_stateful_mixers` runs ``module`` (None: not wrapped)."""
    return module.__dict__.get(_WRAPPED)


# the names :func:`kernel_keywords` gives the layout to every kernel path; a kernel called with the
# forward's ``**kwargs`` gets those of them in its signature (transformers' wrapper drops the rest)
KERNEL_KEYWORDS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
# for a class whose kernels take ``cu_seqlens`` through the forward's ``**kwargs`` only (Kimi
# Linear's KDA); never for one that names it in a call beside ``**kwargs`` (twice would be a TypeError)
CU_SEQLENS = "cu_seqlens"


def kernel_keywords(
    meta: ThdAttentionMetadata, device: torch.device, names: Iterable[str] = KERNEL_KEYWORDS
) -> dict[str, Any]:
    """The layout as the keywords ``names`` (of :data:`KERNEL_KEYWORDS` and :data:`CU_SEQLENS`)
    transformers' stateful mixers hand to their kernels: the padded sequences' offsets
    (``cu_seq_lens_q``/``_k`` and ``cu_seqlens``, int32 ``[N+1]``: flash-linear-attention's
    ``cu_seqlens``), their longest (``max_length_q``/``_k``) and each token's sequence
    (``seq_idx``, int32 ``[1, T]``: causal-conv1d's and mamba-ssm's)."""
    cu_seqlens = meta.on_device("cu_seqlens_padded", device)
    values = {
        "cu_seq_lens_q": cu_seqlens,
        "cu_seq_lens_k": cu_seqlens,
        CU_SEQLENS: cu_seqlens,
        "max_length_q": meta.max_seqlen,
        "max_length_k": meta.max_seqlen,
        "seq_idx": meta.sequence_index(device),  # built once per batch
    }
    return {name: values[name] for name in names}


def mixer_forward(
    forward: Callable, backend: str, keywords: tuple[str, ...], *args: Any, **kwargs: Any
) -> Any:
    """``forward`` (a stateful mixer's own) with every sample of the current layout starting from an
    empty state, with no cache and no attention mask.

    Every tensor argument laid out per token (``[1, t, ...]``: hidden states, rotary cos/sin) is
    all-gathered first under CP (the whole row). ``reference``: cut into the layout's padded
    sequences; those of one padded length go through ``forward`` as one batch ``[k, L, ...]``;
    per-token outputs ``[k, L, ...]`` are put back in row order, any other tensor output (a final
    state ``[k, ...]``) comes back per sequence, in sequence order. ``kernels``: one call on the
    row with :func:`kernel_keywords` of ``keywords``. Under CP the per-token outputs keep this rank's
    tokens."""
    meta = _LAYOUT.get()
    if meta is None:
        raise ValueError(
            "a stateful token mixer (recurrent, state-space or convolutional) ran without the packed row's "
            "layout; call the model through automodel's CausalLMForTraining, which holds it (layout_scope)"
        )
    if kwargs.get("cache") is not None or kwargs.get("cache_params") is not None:
        raise ValueError(
            "a stateful token mixer got a cache on the THD path; call the model with use_cache=False"
        )
    kwargs = {k: v for k, v in kwargs.items() if k not in _LAYOUT_KEYWORDS}
    if "attention_mask" in kwargs:
        kwargs["attention_mask"] = None  # each sequence runs alone: no padding inside it to mask
    local = meta.total_tokens // meta.cp_size
    leaves, rebuild = _flatten((args, kwargs))
    per_token = [i for i, x in enumerate(leaves) if _is_per_token(x, local)]
    if not per_token:
        raise ValueError(
            f"a stateful token mixer got no [1, {local}, ...] input; its arguments do not match the row"
        )
    device = leaves[per_token[0]].device
    if meta.cp_size > 1:
        order = inverse_permutation(meta.partition_indices.flatten()).to(device, non_blocking=True)
        for i in per_token:
            leaves[i] = gather_tokens(leaves[i][0], meta.cp_group)[order][None]
    if backend == "kernels":
        row_args, row_kwargs = rebuild(leaves)
        out = forward(*row_args, **row_kwargs, **kernel_keywords(meta, device, keywords))
        return _local(out, meta, device)
    groups = _sequences_by_length(meta)
    outputs, rows = [], []
    for length, starts in groups.items():
        index_kL = (torch.tensor(starts)[:, None] + torch.arange(length)).to(device, non_blocking=True)
        batch = list(leaves)
        for i in per_token:
            batch[i] = leaves[i][0][index_kL]
        batch_args, batch_kwargs = rebuild(batch)
        outputs.append(forward(*batch_args, **batch_kwargs))
        rows.append(index_kL)
    return _merge(outputs, rows, meta, device)


def _sequences_by_length(meta: ThdAttentionMetadata) -> dict[int, list[int]]:
    """Padded length -> the start offsets of the layout's sequences of that length (host ints)."""
    bounds = meta.cu_seqlens_padded.tolist()
    groups: dict[int, list[int]] = defaultdict(list)
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            groups[end - start].append(start)
    return dict(groups)


def _is_per_token(x: Any, tokens: int) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[0] == 1 and x.shape[1] == tokens


def _merge(outputs: list[Any], rows: list[torch.Tensor], meta: ThdAttentionMetadata, device) -> Any:
    """The outputs of each length group (``rows[g]``: ``[k, L]`` row positions of group g) as the
    output of one call on the row."""
    flat = [_flatten(out) for out in outputs]
    leaves, rebuild = [f[0] for f in flat], flat[0][1]
    to_row = inverse_permutation(torch.cat([r.flatten() for r in rows]))
    sequence_order = torch.cat([r[:, 0] for r in rows]).argsort()
    keep = meta.partition_indices[meta.cp_rank].to(device, non_blocking=True) if meta.cp_size > 1 else None
    merged = []
    for j, first in enumerate(leaves[0]):
        parts = [group[j] for group in leaves]
        if not isinstance(first, torch.Tensor):
            if any(p is not first and p != first for p in parts):
                raise ValueError(
                    f"a stateful token mixer returned {type(first).__name__} values that differ per sequence"
                )
            merged.append(first)
        elif all(p.dim() >= 2 and p.shape[:2] == r.shape for p, r in zip(parts, rows)):
            row = torch.cat([p.flatten(0, 1) for p in parts])[to_row]  # [T, ...] in row order
            merged.append((row if keep is None else row[keep])[None])
        else:  # one value per sequence (a final state): in sequence order
            merged.append(torch.cat(parts)[sequence_order])
    return rebuild(merged)


def _local(output: Any, meta: ThdAttentionMetadata, device) -> Any:
    """A call on the whole row's output with this rank's tokens kept under CP."""
    if meta.cp_size == 1:
        return output
    keep = meta.partition_indices[meta.cp_rank].to(device, non_blocking=True)
    leaves, rebuild = _flatten(output)
    total = meta.total_tokens
    return rebuild([x[:, keep] if _is_per_token(x, total) else x for x in leaves])


def _flatten(tree: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """The leaves of nested tuples, lists and dicts, and the function that rebuilds the structure
    from new leaves."""
    leaves: list[Any] = []

    def walk(node: Any) -> Callable[[Iterable[Any]], Any]:
        if isinstance(node, (tuple, list)) and not hasattr(node, "_fields"):
            builders = [walk(x) for x in node]
            kind = type(node)
            return lambda it: kind(b(it) for b in builders)
        if type(node) is dict:
            builders = {k: walk(x) for k, x in node.items()}
            return lambda it: {k: b(it) for k, b in builders.items()}
        leaves.append(node)
        return lambda it: next(it)

    builder = walk(tree)
    return leaves, lambda new: builder(iter(new))
