"""Host-side checks of the THD layout invariants.

Every boundary that hands a THD batch to a kernel calls these first, so a bad layout fails here
with a message naming the value instead of as a device assert (or silently wrong indices) inside
Transformer Engine. All checks run on CPU copies of small metadata tensors (``[N+1]`` entries).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def check_integers(value: Any, name: str, *, ndim: int | None = None, tensor: bool = False) -> None:
    """ValueError naming ``name`` unless ``value`` holds integers (token ids, positions, lengths: a
    float would be cast silently) with ``ndim`` dimensions; ``tensor`` requires a ``torch.Tensor``."""
    if tensor and not torch.is_tensor(value):
        raise ValueError(
            f"{name} must be a torch.Tensor (as packed_sequence_thd_collater returns), got {type(value).__name__}"
        )
    try:
        array = value.detach().cpu().numpy() if torch.is_tensor(value) else np.asarray(value)
    except ValueError:  # ragged nested lists
        raise ValueError(
            f"{name} must be a {ndim or 'rectangular'}-D array of ints, got ragged nested lists"
        ) from None
    if array.size and array.dtype.kind not in "iu":
        raise ValueError(
            f"{name} must hold integers, got dtype {value.dtype if torch.is_tensor(value) else array.dtype}"
        )
    if ndim is not None and array.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(array.shape)}")


def check_cp_size(cp_size: int, *, name: str = "cp_size") -> None:
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"{name} must be a positive int, got {cp_size!r}")


def check_cp_rank(cp_rank: int, cp_size: int, *, name: str = "rank") -> None:
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"{name} must be an int in [0, {cp_size}), got {cp_rank!r}")


def check_cu_seqlens_padded(
    cu_seqlens_padded: torch.Tensor,
    total_tokens: int,
    cp_size: int = 1,
    *,
    name: str = "cu_seqlens_padded",
) -> None:
    """Validate cumulative padded offsets for TE's THD kernels and CP sharding.

    Requires: a 1-D int32 tensor of at least 2 entries, starting at 0, non-decreasing, every
    sequence length a multiple of ``2 * cp_size`` (when ``cp_size > 1``), and the last entry equal
    to ``total_tokens``.
    """
    if not isinstance(cu_seqlens_padded, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(cu_seqlens_padded).__name__}")
    if cu_seqlens_padded.dtype != torch.int32:
        raise ValueError(
            f"{name} must be int32 (Transformer Engine's contract), got {cu_seqlens_padded.dtype}"
        )
    if cu_seqlens_padded.dim() != 1 or cu_seqlens_padded.numel() < 2:
        raise ValueError(
            f"{name} must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens_padded.shape)}"
        )
    cu = cu_seqlens_padded.detach().to("cpu", torch.int64)
    if int(cu[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {int(cu[0])}")
    seq_lens = cu[1:] - cu[:-1]
    negative = torch.nonzero(seq_lens < 0)
    if negative.numel():
        i = int(negative[0])
        raise ValueError(
            f"{name} must be non-decreasing: entry {i + 1} ({int(cu[i + 1])}) < entry {i} ({int(cu[i])})"
        )
    if cp_size > 1:
        divisor = 2 * cp_size
        bad = torch.nonzero(seq_lens % divisor)
        if bad.numel():
            i = int(bad[0])
            raise ValueError(
                f"{name}: sequence {i} has padded length {int(seq_lens[i])}, which is not a multiple of "
                f"2*cp_size={divisor}. Pad every sequence to a multiple of 2*cp_size "
                f"(pack_dataset(..., cp_size={cp_size}) does this)."
            )
    if isinstance(total_tokens, bool) or not isinstance(total_tokens, int):
        raise ValueError(f"total_tokens must be an int, got {total_tokens!r}")
    if int(cu[-1]) != total_tokens:
        raise ValueError(
            f"total_tokens={total_tokens} must equal {name}[-1]={int(cu[-1])}: every token must belong "
            "to exactly one padded sequence"
        )
    if total_tokens <= 0:
        raise ValueError(f"total_tokens must be positive, got {total_tokens}")
