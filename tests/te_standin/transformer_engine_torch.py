"""Stand-in for ``transformer_engine_torch`` (TE's compiled extension): only
``thd_get_partitioned_indices``, on any device.

It reproduces TE's host checks (RuntimeError) and the kernel's index arithmetic as TE documents it,
including what TE does not check: a sequence whose length is not a multiple of ``2 * world_size``
gives the same wrong indices the kernel would.
"""

from __future__ import annotations

import torch


def thd_get_partitioned_indices(
    cu_seqlens_padded: torch.Tensor, total_tokens: int, world_size: int, rank: int, /
) -> torch.Tensor:
    """``[total_tokens // world_size]`` int32 global indices of CP rank ``rank``'s tokens."""
    if cu_seqlens_padded.dtype != torch.int32:
        raise RuntimeError("cu_seqlens must be int32")
    if cu_seqlens_padded.dim() != 1 or cu_seqlens_padded.numel() < 2:
        raise RuntimeError("cu_seqlens must be 1-D with at least 2 entries")
    if not 0 <= rank < world_size:
        raise RuntimeError("rank must be in [0, world_size)")
    if total_tokens <= 0 or total_tokens % (2 * world_size):
        raise RuntimeError("total_tokens must be positive and divisible by 2 * world_size")
    batch = cu_seqlens_padded.numel() - 1
    cu_s = cu_seqlens_padded.to(torch.int64) // world_size
    j = torch.arange(total_tokens // world_size, device=cu_seqlens_padded.device)
    # Last sequence s with cu_s[s] <= j, searching entries 1..batch-1 only, clamped to [0, batch-1].
    s = torch.searchsorted(cu_s[1:batch], j, right=True).clamp(0, batch - 1)
    length = cu_s[s + 1] - cu_s[s]
    i = j - cu_s[s]
    half = length // 2
    chunk = torch.where(i < half, rank, 2 * world_size - 2 - rank)
    return (i + cu_s[s] * world_size + half * chunk).to(torch.int32)
