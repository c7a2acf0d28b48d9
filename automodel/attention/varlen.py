"""THD attention with torch's own ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 kernels):
the backend for CUDA machines without Transformer Engine.

What it computes: causal attention inside each sequence of the packed batch, with grouped-query
attention, an optional sliding window and context parallelism (:func:`varlen_context_parallel`).
It has no logit softcapping and no attention sinks; :func:`varlen_unsupported` names what a
configuration asks for that it lacks, for refusal at setup.

Every torch in the declared range: ``varlen_attn`` first ships in torch 2.10, and its signature
grew since (read once with ``inspect.signature``, :class:`VarlenKernel`):

======  ==========================================================  =============================
torch   keywords after ``max_q, max_k``                             adapted here
======  ==========================================================  =============================
<2.10   no ``torch.nn.attention.varlen``                            backend unavailable
2.10    ``is_causal, return_aux``                                   q pre-scaled, a window refused
2.11    ``*, return_aux, scale, window_size``                       nothing
2.12+   ``*, return_aux, scale, window_size, enable_gqa, ...``      ``enable_gqa`` for GQA
======  ==========================================================  =============================

(read from each release's ``torch/nn/attention/varlen.py``: 2.10.0, 2.11.0, 2.12.0 = 2.12.1, 2.13.0,
2.14.1, 2.15.0; any other release is adapted the same way from what its signature shows.) Fewer
key/value heads than query heads go to the kernel as they are on every release: 2.10 and 2.11 hand
k and v straight to FlashAttention-2, which shares each key/value head among ``H / K`` query heads
natively; from 2.12 ``varlen_attn`` refuses them unless ``enable_gqa=True``. FlashAttention takes
only bfloat16 and float16 (:data:`FLASH_DTYPES`), which setup checks against the run's compute
dtype. On 2.14 and 2.15 ``varlen_attn`` may pick cuDNN instead of FlashAttention, never for a
causal call with different query and key offsets (cuDNN aligns the causal diagonal top-left): 2.14
uses cuDNN only without any mask (``window_size=(-1, -1)``, never passed here), 2.15 also for a
causal call whose ``cu_seq_q`` and ``cu_seq_k`` are the same tensor (every query sequence as long
as its key sequence, where both alignments agree); the context-parallel calls pass different ones.

Sliding window: transformers' ``sliding_window=W`` lets a token see itself and the W - 1 tokens
before it (``masking_utils.sliding_window_overlay``: ``kv_idx > q_idx - W``; its flash path passes
``window_size=(W - 1, W - 1)`` with ``causal=True``). FlashAttention's ``window_size=(left, right)``
lets query i see keys ``i - left .. i + right``, so W becomes ``(W - 1, 0)``; no window is
``(-1, 0)``, which ``varlen_attn`` runs as plain causal attention.

Padding between sequences: ``varlen_attn`` reads one offsets tensor per side and has nothing like
Transformer Engine's ``cu_seqlens_padded``, so pass the PADDED offsets (``cu_seqlens_padded``) as
``cu_seqlens``. Each sequence's padding slots follow its real tokens, so under the causal mask a
real token still sees exactly the real tokens before it in its own sequence: the real rows of the
output, and all gradients when the loss ignores padding rows, equal attention on the real lengths.
Padding rows attend to their sequence's real tokens too (finite, and ignored by the loss).

Context parallelism: each rank's queries are two chunks of every sequence (chunk ``r`` and
``2 cp - 1 - r``, :func:`thd_get_partitioned_indices`); after the keys and values are all-gathered,
each query chunk is one "sequence" of the kernel whose keys are the prefix of its sequence up to
the chunk's end (per-chunk ``cu_seqlens_q``, prefix ``cu_seqlens_k``). FlashAttention aligns the
causal diagonal bottom-right when a sequence has more keys than queries, so query i of a chunk
ending at key position p sees keys up to ``p - (chunk length - 1 - i)``: its own global position.
Transformer Engine's all-gather CP lays out its kernel calls the same way; memory stays O(L).

Shape legend: T = tokens of the batch, H = query heads, K = key/value heads, D = head dim,
N = sequences.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from automodel.attention.metadata import ThdAttentionMetadata

FLASH_HEAD_DIM_MAX = 256  # FlashAttention-2: head_dim <= 256 and a multiple of 8
FLASH_DTYPES = (torch.bfloat16, torch.float16)
FLASH_MIN_CAPABILITY = (8, 0)  # torch's FlashAttention kernels need Ampere or newer
VARLEN_MIN_TORCH = "2.10"  # the first release with torch.nn.attention.varlen
USE_ANOTHER = "choose attention backend 'te' or 'portable'"


@dataclass(frozen=True)
class VarlenKernel:
    """torch's ``varlen_attn`` and which optional keywords its signature takes."""

    fn: Callable[..., torch.Tensor]
    takes_scale: bool  # torch >= 2.11
    takes_window_size: bool  # torch >= 2.11; before, ``is_causal``
    takes_enable_gqa: bool  # torch >= 2.12; before, fewer key/value heads pass without asking

    @classmethod
    def of(cls, fn: Callable[..., torch.Tensor]) -> VarlenKernel:
        params = inspect.signature(fn).parameters
        if "window_size" not in params and "is_causal" not in params:
            raise ValueError(
                f"torch {torch.__version__}'s varlen_attn takes neither window_size nor is_causal, so it cannot "
                f"be asked for causal attention; {USE_ANOTHER}"
            )
        return cls(fn, "scale" in params, "window_size" in params, "enable_gqa" in params)


@functools.cache
def installed_varlen_kernel() -> VarlenKernel | None:
    """This torch's ``varlen_attn``, its signature read once; None before torch 2.10."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return VarlenKernel.of(varlen_attn)


def varlen_missing() -> str | None:
    """Why this torch has no ``varlen_attn``, or None when it has."""
    if installed_varlen_kernel() is not None:
        return None
    return (
        f"attention backend 'varlen' needs torch >= {VARLEN_MIN_TORCH} (torch.nn.attention.varlen), "
        f"and this is torch {torch.__version__}; {USE_ANOTHER}"
    )


def varlen_unsupported(
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    softcap: float | None,
    sinks: bool,
    head_dim: int | None = None,
) -> str | None:
    """Why the varlen backend cannot run this configuration, or None when it can.

    Args:
        device: where attention runs. dtype: the attention compute dtype (the FSDP2 param dtype).
        softcap: the layers' attention logit softcap (Gemma 2), or None.
        sinks: whether the layers pass attention sinks (``s_aux``, GPT-OSS).
        head_dim: the layers' head dim, when known.
    """
    missing = varlen_missing()
    if missing is not None:
        return missing
    name = "attention backend 'varlen' (torch.nn.attention.varlen)"
    if softcap is not None:
        return (
            f"{name} has no attention logit softcapping, but the model uses softcap={softcap}; "
            "choose attention backend 'portable'"
        )
    if sinks:
        return f"{name} has no attention sinks, but the model's layers use them (s_aux); choose attention backend 'portable'"
    if head_dim is not None and (head_dim > FLASH_HEAD_DIM_MAX or head_dim % 8):
        return (
            f"{name} needs a head dim that is a multiple of 8 and at most {FLASH_HEAD_DIM_MAX}, "
            f"got {head_dim}; {USE_ANOTHER}"
        )
    device = torch.device(device)
    if device.type != "cuda":
        return f"{name} runs on CUDA only, got device {device}; {USE_ANOTHER}"
    if dtype not in FLASH_DTYPES:
        return f"{name} needs bfloat16 or float16, got {dtype}; set model.dtype=bfloat16 or {USE_ANOTHER}"
    if not torch.cuda.is_available():
        return f"{name} needs a CUDA device, and none is available; {USE_ANOTHER}"
    capability = torch.cuda.get_device_capability(device)
    if capability < FLASH_MIN_CAPABILITY:
        return f"{name} needs a GPU of compute capability 8.0 or newer, got {capability}; {USE_ANOTHER}"
    return None


def varlen_window_size(window: int | None) -> tuple[int, int]:
    """FlashAttention's ``(left, right)`` for transformers' ``sliding_window`` (None: no window)."""
    if window is None:
        return (-1, 0)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(
            f"window must be None or a positive int (transformers' sliding_window), got {window!r}"
        )
    return (window - 1, 0)


def window_refusal(kernel: VarlenKernel, window: int | None, max_k: int) -> str | None:
    """Why ``kernel`` cannot apply transformers' ``sliding_window`` ``window`` to sequences of up to
    ``max_k`` keys, or None when it can: a torch without ``window_size`` (2.10) computes plain
    causal attention, which equals the window only where no sequence exceeds it."""
    if kernel.takes_window_size or window is None or max_k <= window:
        return None
    return (
        f"torch {torch.__version__}'s varlen_attn has no window_size (torch >= 2.11 has it), so it "
        f"cannot apply sliding_window={window} to sequences of up to {max_k} tokens; upgrade torch, "
        f"use model.attention_backend=portable, or keep samples within {window} tokens (data.max_length)"
    )


def varlen_call(
    kernel: VarlenKernel,
    q_THD: torch.Tensor,
    k_SKD: torch.Tensor,
    v_SKD: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float | None,
    window: int | None,
) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for ``kernel.fn``: causal attention (bottom-right aligned where a sequence
    has more keys than queries), grouped-query heads passed as they are, ``scale`` and ``window``,
    in what this kernel's signature takes (see the module docstring). S = key tokens.

    Raises ValueError for a window the kernel cannot apply (:func:`window_refusal`).
    """
    kwargs: dict = {}
    if q_THD.shape[1] != k_SKD.shape[1] and kernel.takes_enable_gqa:
        kwargs["enable_gqa"] = True
    default_scale = q_THD.shape[-1] ** -0.5
    if kernel.takes_scale:
        kwargs["scale"] = scale
    elif scale is not None and scale != default_scale:  # the kernel scales by 1/sqrt(D)
        q_THD = q_THD * (scale / default_scale)
    if kernel.takes_window_size:
        kwargs["window_size"] = varlen_window_size(window)
    else:
        refusal = window_refusal(kernel, window, max_k)
        if refusal is not None:
            raise ValueError(refusal)
        kwargs["is_causal"] = True
    return (q_THD, k_SKD, v_SKD, cu_seqlens_q, cu_seqlens_k, max_q, max_k), kwargs


def _kernel() -> VarlenKernel:
    kernel = installed_varlen_kernel()
    if kernel is None:
        raise RuntimeError(varlen_missing())
    return kernel


def varlen_attention(
    q_THD: torch.Tensor,
    k_THKD: torch.Tensor,
    v_THKD: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    scale: float | None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention within each sequence -> ``[T, H, D]``.

    Args:
        q_THD: ``[T, H, D]``; k_THKD, v_THKD: ``[T, K, D]`` with K dividing H (bf16 or fp16, CUDA).
        cu_seqlens: ``[N+1]`` int32 on q's device: the sequences' offsets in the batch, i.e. the
            PADDED offsets when there is padding between sequences (see the module docstring).
        max_seqlen: the longest sequence by those offsets, a python int (read on the host once per
            micro-batch, never here).
        scale: the softmax scale of ``q . k`` (transformers' ``scaling``); None means ``1/sqrt(D)``.
        window: transformers' ``sliding_window`` W (a token sees itself and W - 1 tokens back), or None.

    Only shapes and dtypes are checked here (no device reads); the layout is the caller's.
    """
    _check_varlen_args(q_THD, k_THKD, v_THKD, cu_seqlens, max_seqlen)
    if k_THKD.shape[0] != q_THD.shape[0]:
        raise ValueError(f"q and k/v must hold the same tokens, got {q_THD.shape[0]} and {k_THKD.shape[0]}")
    kernel = _kernel()
    args, kwargs = varlen_call(
        kernel,
        q_THD,
        k_THKD,
        v_THKD,
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        scale=scale,
        window=window,
    )
    return kernel.fn(*args, **kwargs)


class VarlenCpLayout(NamedTuple):
    """One CP rank's query chunks as sequences of the varlen kernel (host tensors; C = chunks,
    S = their keys).

    Attributes:
        key_index: ``[S]`` int64, the global token index of each key, chunk by chunk: the prefix
            of the chunk's sequence up to the chunk's last token.
        cu_seqlens_q: ``[C+1]`` int32 offsets of the chunks in this rank's queries.
        cu_seqlens_k: ``[C+1]`` int32 offsets of their keys in ``key_index``.
        max_q, max_k: the longest chunk and the longest key prefix.
    """

    key_index: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_q: int
    max_k: int

    def to(self, device: torch.device) -> VarlenCpLayout:
        return VarlenCpLayout(*(x.to(device, non_blocking=True) for x in self[:3]), self.max_q, self.max_k)


def varlen_cp_layout(padded_lens: list[int], cp_size: int, cp_rank: int) -> VarlenCpLayout:
    """The kernel layout of CP rank ``cp_rank``'s queries (in ``thd_get_partitioned_indices``
    order) against the all-gathered keys in global order, from the padded sequence lengths (each a
    multiple of ``2 * cp_size``).

    Example, one sequence of 8 tokens, cp_size 2 (chunks of 2): rank 0 holds chunks 0 and 3, so
    ``cu_seqlens_q = [0, 2, 4]``, keys ``[0 1 | 0 1 2 3 4 5 6 7]``, ``cu_seqlens_k = [0, 2, 10]``.
    """
    q_lens, k_lens, key_index = [], [], []
    start = 0
    for n in padded_lens:
        chunk = n // (2 * cp_size)
        if chunk:
            for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
                q_lens.append(chunk)
                k_lens.append((c + 1) * chunk)
                key_index.append(torch.arange(start, start + (c + 1) * chunk))
        start += n

    def offsets(lens: list[int]) -> torch.Tensor:
        return torch.tensor([0, *lens]).cumsum(0).to(torch.int32)

    return VarlenCpLayout(
        torch.cat(key_index) if key_index else torch.zeros(0, dtype=torch.int64),
        offsets(q_lens),
        offsets(k_lens),
        max(q_lens, default=0),
        max(k_lens, default=0),
    )


def varlen_local_queries(
    q_THD: torch.Tensor,
    k_global: torch.Tensor,
    v_global: torch.Tensor,
    layout: VarlenCpLayout,
    *,
    scale: float | None,
    window: int | None = None,
) -> torch.Tensor:
    """A CP rank's queries ``[t, H, D]`` (``layout``'s chunks) against the keys and values of the
    whole batch ``[T, K, D]`` in global order -> ``[t, H, D]``. ``layout``'s tensors on q's device."""
    _check_varlen_args(q_THD, k_global, v_global, layout.cu_seqlens_q, layout.max_q)
    kernel = _kernel()
    args, kwargs = varlen_call(
        kernel, q_THD, k_global[layout.key_index], v_global[layout.key_index], layout.cu_seqlens_q,
        layout.cu_seqlens_k, layout.max_q, layout.max_k, scale=scale, window=window,
    )  # fmt: skip
    return kernel.fn(*args, **kwargs)


_layout_cache: tuple[weakref.ref, torch.device, VarlenCpLayout] | None = None


def cp_layout_on(meta: ThdAttentionMetadata, device: torch.device) -> VarlenCpLayout:
    """:func:`varlen_cp_layout` of this rank, on ``device``; every layer of a step gets the same
    metadata object, so the last one is kept."""
    global _layout_cache
    cached = _layout_cache
    if cached is not None and cached[0]() is meta and cached[1] == device:
        return cached[2]
    layout = varlen_cp_layout(meta.padded_lens.tolist(), meta.cp_size, meta.cp_rank).to(device)
    _layout_cache = (weakref.ref(meta), device, layout)
    return layout


def varlen_context_parallel(
    q_THD: torch.Tensor,
    k_THKD: torch.Tensor,
    v_THKD: torch.Tensor,
    meta: ThdAttentionMetadata,
    *,
    scale: float | None,
    window: int | None = None,
) -> torch.Tensor:
    """This rank's queries ``[t, H, D]``, keys and values ``[t, K, D]`` under context parallelism
    -> ``[t, H, D]``: the keys and values are all-gathered over ``meta.cp_group`` (the backward
    reduce-scatters their gradients) and each query chunk attends to its sequence's prefix."""
    from automodel.attention.portable import gather_global_kv

    k_global, v_global = gather_global_kv(k_THKD, v_THKD, meta)
    layout = cp_layout_on(meta, q_THD.device)
    return varlen_local_queries(q_THD, k_global, v_global, layout, scale=scale, window=window)


def _check_varlen_args(q, k, v, cu_seqlens, max_seqlen) -> None:
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or k.shape[2] != q.shape[2]:
        raise ValueError(
            f"q, k, v must be [T, H, D], [S, K, D], [S, K, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"the query heads ({q.shape[1]}) must be a multiple of the key/value heads ({k.shape[1]})"
        )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32 or cu_seqlens.device != q.device:
        raise ValueError(
            f"cu_seqlens must be a 1-D int32 tensor on {q.device}, got {cu_seqlens.dtype} "
            f"{tuple(cu_seqlens.shape)} on {cu_seqlens.device}"
        )
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 1:
        raise ValueError(f"max_seqlen must be a positive python int, got {max_seqlen!r}")
