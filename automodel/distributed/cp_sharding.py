"""Context-parallel sharding of a THD batch, with Transformer Engine's dual-chunk layout.

Each padded sequence is cut into ``2 * cp_size`` equal chunks; CP rank ``r`` keeps chunks ``r`` and
``2 * cp_size - 1 - r``, which balances causal attention work across ranks. Example, one sequence
of 8 tokens, cp_size 2 (chunks of 2)::

    global   [0 1 | 2 3 | 4 5 | 6 7]
    rank 0   [0 1 6 7]      rank 1   [2 3 4 5]

Shape legend: T = tokens in the batch, W = cp_size, N = sequences, C = num_chunks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from automodel.distributed.thd import SEQ_LENS_PADDING_VALUE, process_input_for_thd
from automodel.distributed.thd_checks import check_cp_rank, check_cp_size, check_cu_seqlens_padded
from automodel.te_support import te_extension

_SHARDED_KEYS = ("input_ids", "labels", "position_ids", "padding_mask")


def thd_get_partitioned_indices(
    cu_seqlens_padded: torch.Tensor, total_tokens: int, world_size: int, rank: int
) -> torch.Tensor:
    """Global token indices ``[T / W]`` (int32) that CP rank ``rank`` holds, in TE's order.

    Order: sequence by sequence; inside a sequence chunk ``rank`` then chunk ``2W-1-rank``;
    ascending inside a chunk. Runs TE's kernel (``transformer_engine_torch``) for CUDA tensors when
    TE is importable, else an equivalent vectorized torch computation. Inputs are validated on the
    host first (TE leaves most of them to device asserts that release builds compile out).

    Args:
        cu_seqlens_padded: ``[N+1]`` int32 cumulative padded sequence offsets.
        total_tokens: T, must equal ``cu_seqlens_padded[-1]``.
        world_size: W, the context-parallel size.
        rank: this rank's index in the CP group.
    """
    check_cp_size(world_size, name="world_size")
    check_cp_rank(rank, world_size)
    check_cu_seqlens_padded(cu_seqlens_padded, total_tokens, world_size)
    tex = te_extension()
    if tex is not None and cu_seqlens_padded.is_cuda:
        return tex.thd_get_partitioned_indices(cu_seqlens_padded, total_tokens, world_size, rank)
    return _partitioned_indices(cu_seqlens_padded, world_size, rank)


def _partitioned_indices(cu_seqlens_padded: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    cu = cu_seqlens_padded.to(torch.int64)
    seq_lens = cu[1:] - cu[:-1]
    local_lens = seq_lens // world_size  # tokens of each sequence on one rank
    chunk = seq_lens // (2 * world_size)
    seq_of_token = torch.repeat_interleave(torch.arange(seq_lens.numel(), device=cu.device), local_lens)
    local_starts = local_lens.cumsum(0) - local_lens
    index_in_local = torch.arange(seq_of_token.numel(), device=cu.device) - local_starts[seq_of_token]
    chunk_of_token = torch.where(
        index_in_local < chunk[seq_of_token], rank, 2 * world_size - 2 - rank
    )  # the second chunk's offset already counts the first chunk's tokens, hence 2W-2-r
    global_index = cu[:-1][seq_of_token] + chunk[seq_of_token] * chunk_of_token + index_in_local
    return global_index.to(torch.int32)


def make_cp_batch_for_te(
    cp_mesh,
    batch: dict[str, Any],
    qkv_format: str = "thd",
    padding_token_id: int = 0,
    num_chunks: int = 1,
    seq_lens_padding_value: int = SEQ_LENS_PADDING_VALUE,
    return_local_indices: bool = False,
    *,
    cp_size: int | None = None,
    cp_rank: int | None = None,
) -> dict[str, Any] | tuple[dict[str, Any], torch.Tensor | None]:
    """Convert a collated batch to THD and keep this CP rank's tokens.

    Args:
        cp_mesh: 1-D ``DeviceMesh`` of the context-parallel group, or None.
        batch: output of :func:`packed_sequence_thd_collater` (``[B, S]`` tensors).
        qkv_format: only ``"thd"``.
        padding_token_id: passed to :func:`process_input_for_thd`.
        num_chunks: C; with C > 1 the B rows are split into C chunks of B/C rows, each converted
            and sharded on its own, and the results stacked on a leading ``[C]`` axis.
        seq_lens_padding_value: sentinel in ``seq_lens``; also right-pads stacked ``cu_seqlens``.
        return_local_indices: also return the global index of each token this rank holds
            (``thd_get_partitioned_indices``, int32; ``arange(T)`` int64 without CP; None when C > 1).
        cp_size, cp_rank: given instead of ``cp_mesh`` to run without a process group.

    Returns:
        ``input_ids``, ``labels``, ``position_ids``, ``padding_mask`` ``[T / W]`` holding
        this rank's tokens (gathered with :func:`thd_get_partitioned_indices`), and the GLOBAL
        ``cu_seqlens``, ``cu_seqlens_padded`` ``[N+1]`` and ``max_seqlen``, plus ``qkv_format="thd"``,
        ``cp_size`` and ``cp_rank``; with C > 1 each of them ``[C, ...]`` (``cu_seqlens*`` ``[C, max N+1]``).
        A tuple ``(batch, local_indices)`` when ``return_local_indices``.
    """
    if qkv_format != "thd":
        raise ValueError(
            f"Currently only 'thd' format is supported, got: {qkv_format!r}; set qkv_format='thd'"
        )
    cp_size, cp_rank = _resolve_cp(cp_mesh, cp_size, cp_rank)

    def shard(rows: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor]:
        thd = process_input_for_thd(rows, seq_lens_padding_value, padding_token_id)
        total = int(thd["cu_seqlens_padded"][-1])
        indices = torch.arange(total, device=thd["input_ids"].device)
        if cp_size > 1:
            indices = thd_get_partitioned_indices(thd["cu_seqlens_padded"], total, cp_size, cp_rank)
            for key in _SHARDED_KEYS:  # mRoPE position_ids [R, 1, T] carry tokens on their last axis
                dim = -1 if key == "position_ids" else 0
                thd[key] = thd[key].index_select(dim, indices.to(thd[key].device))
        thd.update(qkv_format="thd", cp_size=cp_size, cp_rank=cp_rank)
        return thd, indices

    if num_chunks == 1:
        thd, indices = shard(batch)
        return (thd, indices) if return_local_indices else thd
    chunks = [shard(rows)[0] for rows in _split_rows(batch, num_chunks)]
    stacked = dict(chunks[0])
    for key, value in chunks[0].items():
        if torch.is_tensor(value):
            values = [chunk[key] for chunk in chunks]
            ragged = key in (
                "cu_seqlens",
                "cu_seqlens_padded",
            )  # chunks may hold different numbers of sequences
            stacked[key] = (
                pad_sequence(values, batch_first=True, padding_value=seq_lens_padding_value)
                if ragged
                else torch.stack(values)
            )
    return (stacked, None) if return_local_indices else stacked


def _split_rows(batch: dict[str, Any], num_chunks: int) -> list[dict[str, Any]]:
    """``num_chunks`` batches of ``B / num_chunks`` consecutive rows of every tensor (other values shared)."""
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"num_chunks must be a positive int, got {num_chunks!r}")
    rows = len(batch["input_ids"]) if "input_ids" in batch else 0
    if rows % num_chunks:
        raise ValueError(f"num_chunks={num_chunks} must divide the batch's {rows} rows")
    size = rows // num_chunks

    def take(key: str, value: Any, i: int) -> Any:
        if not torch.is_tensor(value):
            return value
        if key == "position_ids" and value.dim() == 3:  # mRoPE [R, B, S]: rows on axis 1
            return value[:, i * size : (i + 1) * size]
        return value[i * size : (i + 1) * size]

    return [{k: take(k, v, i) for k, v in batch.items()} for i in range(num_chunks)]


def _resolve_cp(cp_mesh, cp_size: int | None, cp_rank: int | None) -> tuple[int, int]:
    if cp_mesh is not None:
        mesh_size = cp_mesh.size()
        mesh_rank = cp_mesh.get_local_rank() if mesh_size > 1 else 0
        if (cp_size is not None and cp_size != mesh_size) or (cp_rank is not None and cp_rank != mesh_rank):
            raise ValueError(
                f"cp_size/cp_rank ({cp_size}, {cp_rank}) contradict cp_mesh ({mesh_size}, {mesh_rank}); pass one or the other"
            )
        return mesh_size, mesh_rank
    if cp_size is None:
        if cp_rank not in (None, 0):
            raise ValueError(f"cp_rank={cp_rank} given without cp_size")
        return 1, 0
    check_cp_size(cp_size)
    if cp_rank is None:
        raise ValueError(f"cp_size={cp_size} given without cp_rank; pass both, or a cp_mesh")
    check_cp_rank(cp_rank, cp_size, name="cp_rank")
    return cp_size, cp_rank
