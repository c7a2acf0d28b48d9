"""THD attention with torch's own ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 kernels):
the backend for CUDA machines without Transformer Engine.

What it computes: causal attention inside each sequence of the packed batch, with grouped-query
attention and an optional sliding window. It has no logit softcapping, no attention sinks and no
context parallelism; :func:`varlen_unsupported` names what a configuration asks for that it lacks,
for refusal at setup.

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

Shape legend: T = tokens of the batch, H = query heads, K = key/value heads, D = head dim,
N = sequences.
"""

from __future__ import annotations

import torch

FLASH_HEAD_DIM_MAX = 256  # FlashAttention-2: head_dim <= 256 and a multiple of 8
FLASH_DTYPES = (torch.bfloat16, torch.float16)
FLASH_MIN_CAPABILITY = (8, 0)  # torch's FlashAttention kernels need Ampere or newer
USE_ANOTHER = "choose attention backend 'te' or 'portable'"


def varlen_unsupported(
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    softcap: float | None,
    sinks: bool,
    cp_size: int,
    head_dim: int | None = None,
) -> str | None:
    """Why the varlen backend cannot run this configuration, or None when it can.

    Args:
        device: where attention runs. dtype: the attention compute dtype (the FSDP2 param dtype).
        softcap: the layers' attention logit softcap (Gemma 2), or None.
        sinks: whether the layers pass attention sinks (``s_aux``, GPT-OSS).
        cp_size: context-parallel degree. head_dim: the layers' head dim, when known.
    """
    name = "attention backend 'varlen' (torch.nn.attention.varlen)"
    if cp_size > 1:
        return f"{name} has no context parallelism, but cp_size={cp_size}; {USE_ANOTHER}"
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
    try:
        from torch.nn.attention import varlen  # noqa: F401
    except ImportError as error:
        return f"{name} is not in torch {torch.__version__} ({error}); {USE_ANOTHER}"
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
    from torch.nn.attention.varlen import varlen_attn

    _check_varlen_args(q_THD, k_THKD, v_THKD, cu_seqlens, max_seqlen)
    return varlen_attn(
        q_THD,
        k_THKD,
        v_THKD,
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        scale=scale,
        window_size=varlen_window_size(window),
        enable_gqa=q_THD.shape[1] != k_THKD.shape[1],
    )


def _check_varlen_args(q, k, v, cu_seqlens, max_seqlen) -> None:
    if (
        q.dim() != 3
        or k.dim() != 3
        or k.shape != v.shape
        or k.shape[0] != q.shape[0]
        or k.shape[2] != q.shape[2]
    ):
        raise ValueError(
            f"q, k, v must be [T, H, D], [T, K, D], [T, K, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
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
