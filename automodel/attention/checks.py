"""Host-side checks shared by the attention backends.

Every backend runs these before launching a kernel, so a wrong shape, dtype or layout fails with a
message naming the value and the fix instead of as a device assert (or a silently wrong result).
The per-call checks read only the small CPU tensors that ``ThdAttentionMetadata`` caches.

Shape legend: t = this rank's tokens, h = query heads, h_kv = key/value heads, d = head dim.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from automodel.attention.metadata import ThdAttentionMetadata


def check_head_config(num_heads: int, num_kv_heads: int, head_dim: int, softmax_scale: float | None) -> None:
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads} (grouped-query "
            "attention shares each key/value head among num_heads // num_kv_heads query heads)"
        )
    if softmax_scale is not None and not (
        isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale) and softmax_scale > 0
    ):
        raise ValueError(
            f"softmax_scale must be a positive finite float or None (1/sqrt(head_dim)), got {softmax_scale!r}"
        )


def check_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: ThdAttentionMetadata,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    head_dim_v: int | None = None,
) -> None:
    """Check q ``[t, h, d]``, k ``[t, h_kv, d]``, v ``[t, h_kv, d_v]`` (``d_v`` = ``head_dim_v``, else d) against the module's head configuration and the
    THD layout in ``meta``; under context parallelism also check the process group."""
    if not isinstance(meta, ThdAttentionMetadata):
        raise ValueError(f"meta must be a ThdAttentionMetadata, got {type(meta).__name__}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a 3-D tensor [tokens, heads, head_dim] (THD), got {shape}")
    t = q.shape[0]
    expected = {
        "q": (t, num_heads, head_dim),
        "k": (t, num_kv_heads, head_dim),
        "v": (t, num_kv_heads, head_dim if head_dim_v is None else head_dim_v),
    }
    for name, x in (("q", q), ("k", k), ("v", v)):
        if tuple(x.shape) != expected[name]:
            raise ValueError(
                f"{name} has shape {tuple(x.shape)}, expected {expected[name]} "
                f"(tokens, {'num_heads' if name == 'q' else 'num_kv_heads'}, head_dim) for this attention module"
            )
    if not q.dtype.is_floating_point or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")

    if t * meta.cp_size != meta.total_tokens:
        raise ValueError(
            f"q holds {t} tokens but the batch has {meta.total_tokens} tokens over cp_size={meta.cp_size} "
            f"ranks (cu_seqlens_padded[-1] / cp_size = {meta.total_tokens // meta.cp_size}); pass this rank's "
            "tokens as sharded by make_cp_batch_for_te with the batch's global metadata"
        )
    if meta.cp_size > 1:
        group_size, group_rank = dist.get_world_size(meta.cp_group), dist.get_rank(meta.cp_group)
        if (group_size, group_rank) != (meta.cp_size, meta.cp_rank):
            raise ValueError(
                f"meta says cp_size={meta.cp_size}, cp_rank={meta.cp_rank} but cp_group has size {group_size} "
                f"and this process is its rank {group_rank}; build the metadata with the CP group's size and rank"
            )
