"""The THD attention metadata handed from the data path to the model.

Attention backends read only this object, so the data path and the backends meet in one place.
Under context parallelism every field describes the GLOBAL batch (all CP ranks' tokens), as
Transformer Engine requires; the local tokens are this rank's share in
``thd_get_partitioned_indices`` order.

The layout lives on the host, so reading it never waits for the device; the kernels that need
``cu_seqlens`` on the device get a copy made once per batch (:meth:`ThdAttentionMetadata.on_device`),
queued before the forward by :meth:`ThdAttentionMetadata.prefetch`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist

from automodel.distributed.cp_sharding import thd_get_partitioned_indices
from automodel.distributed.thd_checks import check_cu_seqlens_padded


def mark_sequence_count_dynamic(*cu_seqlens: torch.Tensor) -> None:
    """A compiled decoder layer (``model.compile``) takes the layout among its inputs, and the number
    of sequences changes from pack to pack: dynamic from the first compile, not after a recompile
    (torch 2.11 guards on the first pack's count and compiles every layer a second time)."""
    for tensor in cu_seqlens:
        torch._dynamo.maybe_mark_dynamic(tensor, 0)


@dataclass(frozen=True)
class ThdAttentionMetadata:
    """Layout of a packed THD batch.

    Attributes:
        cu_seqlens: ``[N+1]`` int32, cumulative REAL lengths of the N sequences.
        cu_seqlens_padded: ``[N+1]`` int32, cumulative padded lengths (memory offsets); the last
            entry is the global token count T.
        max_seqlen: longest padded sequence.
        cp_size, cp_rank: context-parallel size and this rank's index in the CP group.
        cp_group: the CP process group (None when cp_size == 1).
        device_copies: ``(name, device) -> tensor``: the layout tensors already copied to a device
            (:meth:`on_device`). A copy of the metadata (``dataclasses.replace``, or FSDP2's copy of
            each unit's forward inputs) starts with the copies made so far, which is why the trainer
            makes them before the forward (:meth:`prefetch`).
    """

    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: dist.ProcessGroup | None = None
    device_copies: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        total = int(self.cu_seqlens_padded[-1]) if self.cu_seqlens_padded.numel() else 0
        check_cu_seqlens_padded(self.cu_seqlens_padded, total, self.cp_size)
        if self.cu_seqlens.shape != self.cu_seqlens_padded.shape or self.cu_seqlens.dtype != torch.int32:
            raise ValueError(
                f"cu_seqlens must be int32 shaped like cu_seqlens_padded {tuple(self.cu_seqlens_padded.shape)}, "
                f"got {self.cu_seqlens.dtype} {tuple(self.cu_seqlens.shape)}"
            )
        if int(self.cu_seqlens[0]) != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {int(self.cu_seqlens[0])}")
        bad = torch.nonzero((self.real_lens < 0) | (self.real_lens > self.padded_lens))
        if bad.numel():
            i = int(bad[0])
            raise ValueError(
                f"sequence {i}: its real length {int(self.real_lens[i])} (from cu_seqlens) must lie in "
                f"[0, {int(self.padded_lens[i])}], its padded length (from cu_seqlens_padded)"
            )
        longest = int(self.padded_lens.max())
        if (
            isinstance(self.max_seqlen, bool)
            or not isinstance(self.max_seqlen, int)
            or self.max_seqlen < longest
        ):
            raise ValueError(
                f"max_seqlen must be a python int >= the longest padded sequence ({longest}), got {self.max_seqlen!r}"
            )
        if self.cp_size > 1 and self.cp_group is None:
            raise ValueError(f"cp_size={self.cp_size} needs a cp_group")
        mark_sequence_count_dynamic(self.cu_seqlens, self.cu_seqlens_padded)

    def on_device(self, name: str, device: torch.device) -> torch.Tensor:
        """``cu_seqlens`` or ``cu_seqlens_padded`` on ``device``, copied once per batch (a layer per
        call would otherwise copy, and on CUDA wait, every time)."""
        key = (name, torch.device(device))
        if key not in self.device_copies:
            self.device_copies[key] = getattr(self, name).to(device, non_blocking=True)
            mark_sequence_count_dynamic(self.device_copies[key])
        return self.device_copies[key]

    def sequence_index(self, device: torch.device) -> torch.Tensor:
        """``[1, T]`` int32: the index of each token's (padded) sequence, on ``device``, made once per
        batch (mamba-ssm's and causal-conv1d's ``seq_idx``)."""
        key = ("sequence_index", torch.device(device))
        if key not in self.device_copies:
            index = torch.repeat_interleave(
                torch.arange(len(self.padded_lens), dtype=torch.int32), self.padded_lens
            )
            self.device_copies[key] = index[None].to(device, non_blocking=True)
        return self.device_copies[key]

    def prefetch(self, device: torch.device) -> ThdAttentionMetadata:
        """Queue the device copies of the layout before the forward, so no layer waits on one."""
        for name in ("cu_seqlens", "cu_seqlens_padded"):
            self.on_device(name, device)
        return self

    def block_causal_mask(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """``[1, 1, T, T]`` additive mask (0 where token i may attend token j, the dtype's lowest value
        elsewhere): causal within each padded sequence, nothing across them. For models whose
        attention is their own code and takes a dense mask; O(T^2) memory, one process only.
        Built on ``device`` from the layout's device copy, so no host transfer of T^2 values."""
        if self.cp_size > 1:
            raise ValueError(
                f"a dense attention mask covers the whole row, but this batch is sharded over cp_size={self.cp_size} "
                "ranks; use parallel.cp_size=1 for this model"
            )
        total = self.total_tokens
        lens = self.on_device("cu_seqlens_padded", device).diff()
        sequence_T = torch.repeat_interleave(
            torch.arange(lens.numel(), device=device), lens, output_size=total
        )
        position_T = torch.arange(total, device=device)
        allowed_TT = (sequence_T[:, None] == sequence_T[None, :]) & (
            position_T[None, :] <= position_T[:, None]
        )
        mask_TT = torch.zeros((total, total), dtype=dtype, device=device)
        return mask_TT.masked_fill_(~allowed_TT, torch.finfo(dtype).min)[None, None]

    @classmethod
    def from_batch(
        cls, batch: dict[str, Any], cp_group: dist.ProcessGroup | None = None
    ) -> ThdAttentionMetadata:
        """From the output of ``make_cp_batch_for_te`` (single chunk)."""
        return cls(
            cu_seqlens=batch["cu_seqlens"],
            cu_seqlens_padded=batch["cu_seqlens_padded"],
            max_seqlen=int(batch["max_seqlen"]),
            cp_size=int(batch.get("cp_size", 1)),
            cp_rank=int(batch.get("cp_rank", 0)),
            cp_group=cp_group,
        )

    @property
    def total_tokens(self) -> int:
        """Global token count T (all CP ranks)."""
        return int(self.cu_seqlens_padded[-1])

    @cached_property
    def real_lens(self) -> torch.Tensor:
        """``[N]`` int64 real length of each sequence (CPU)."""
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).to("cpu", torch.int64)

    @cached_property
    def padded_lens(self) -> torch.Tensor:
        """``[N]`` int64 padded length of each sequence (CPU)."""
        return (self.cu_seqlens_padded[1:] - self.cu_seqlens_padded[:-1]).to("cpu", torch.int64)

    @cached_property
    def pad_between_seqs(self) -> bool:
        """True when some sequence has padding slots (TE's ``pad_between_seqs``)."""
        return bool((self.real_lens != self.padded_lens).any())

    @cached_property
    def partition_indices(self) -> torch.Tensor:
        """``[cp_size, T / cp_size]`` int64 (CPU): row r = global indices of CP rank r's local tokens."""
        cu = self.cu_seqlens_padded.to("cpu")
        return torch.stack(
            [
                thd_get_partitioned_indices(cu, self.total_tokens, self.cp_size, r).long()
                for r in range(self.cp_size)
            ]
        )
