"""Which attention backend a run uses, and building its module.

Backends: ``"te"`` (Transformer Engine, CUDA), ``"portable"`` (SDPA per sequence, any device),
``"varlen"`` (torch's ``varlen_attn``, CUDA, torch >= 2.10) and ``"auto"``: TE when a CUDA device is
present, TE imports and its fast kernels take the run's compute dtype, else varlen on CUDA where this
torch has it and FlashAttention takes that dtype, else portable (the one backend for float32).

Shape legend: t = this rank's tokens, h = query heads, h_kv = key/value heads, d = head dim.
"""

from __future__ import annotations

import torch
from torch import nn

from automodel.attention.portable import PortableAttention
from automodel.attention.te import TE_DTYPES, TransformerEngineAttention
from automodel.attention.varlen import FLASH_DTYPES, varlen_missing
from automodel.distributed.parallel import check_cp_comm_type
from automodel.te_support import te_pytorch

ATTENTION_BACKENDS = ("auto", "te", "portable", "varlen")


def resolve_attention_backend(backend: str, *, compute_dtype: torch.dtype) -> str:
    """``"te"``, ``"varlen"`` or ``"portable"``: the backend that ``backend`` means on this machine
    for attention computed in ``compute_dtype`` (what q, k and v reach it in:
    :func:`automodel.attention.hf.attention_compute_dtype`; a run's is ``trainer.bf16_autocast`` on
    CUDA, else ``model.dtype``). Whether a named backend can run it is setup's check."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    if backend == "auto":
        if not torch.cuda.is_available():
            return "portable"
        if te_pytorch() is not None and compute_dtype in TE_DTYPES:
            return "te"
        return "varlen" if varlen_missing() is None and compute_dtype in FLASH_DTYPES else "portable"
    return backend


def build_attention(
    backend: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    softmax_scale: float | None = None,
    cp_comm_type: str = "p2p",
) -> nn.Module:
    """A module mapping q ``[t, h, d]``, k/v ``[t, h_kv, d]`` and a ThdAttentionMetadata to ``[t, h*d]``.

    Args:
        backend: ``te`` or ``portable``, resolved (:func:`resolve_attention_backend`; ``varlen``
            is a function, called by :mod:`automodel.attention.hf`).
        num_heads: h. num_kv_heads: h_kv, dividing h. head_dim: d.
        softmax_scale: None means ``1 / sqrt(d)``.
        cp_comm_type: TE's context-parallel exchange, one of ``CP_COMM_TYPES``; validated for every
            backend so a config error shows on any machine (the portable backend always all-gathers).
    """
    check_cp_comm_type(cp_comm_type)
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    if backend not in ("te", "portable"):
        raise ValueError(
            f"build_attention builds 'te' or 'portable' modules, got {backend!r}: 'varlen' is called as a "
            "function, and 'auto' is resolved first (resolve_attention_backend, with the compute dtype)"
        )
    if backend == "te":
        return TransformerEngineAttention(num_heads, num_kv_heads, head_dim, softmax_scale, cp_comm_type)
    return PortableAttention(num_heads, num_kv_heads, head_dim, softmax_scale)
