"""Balanced packing: split a group of samples into packs of (nearly) equal work.

Built for RL rollouts, where one step trains a fixed group of samples (prompts x answers) and every
data-parallel rank should finish its share at the same time; also usable for SFT as the batching
mode ``packing: balanced``. Unlike bin packing (fewest packs of a fixed size), the number of packs
is given (or derived from a token cap) and the spread of their loads is minimized.

Stages, each a pure function:

- :func:`plan_balanced_packs` (lengths only): Karmarkar-Karp largest differencing, then a
  local-improvement pass, then more packs while any pack exceeds ``max_tokens_per_gpu``.
- :func:`pack_sequences` / :func:`unpack_sequences`: per-sample tensors <-> flat packs with
  ``position_ids``, int32 ``cu_seqlens`` and every per-token field flattened alongside.
- :func:`pad_packed_sequence_with_cp`: tail padding for a contiguous split over CP ranks.
- :func:`plan_balanced_epoch` and :class:`BalancedBatching`: balanced packs for every DP rank of
  every step, resumable mid-epoch.

Shape legend: K = samples, k = packs, n = samples in one pack, T = tokens in one pack,
``...`` = trailing dims of a per-token field (e.g. vocab V of logits).
"""

from __future__ import annotations

import functools
import heapq
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from automodel.data.collate import CROSS_ENTROPY_IGNORE_INDEX, packed_sequence_thd_collater
from automodel.data.loader import LoaderEnv, MicroBatchStream, check_positive_int
from automodel.data.planning import PackPlan, lower_bound_packs

logger = logging.getLogger(__name__)

# Keys that pack_sequences adds to every pack; sample fields may not use them.
PACK_LAYOUT_KEYS = ("position_ids", "cu_seqlens", "seq_lens", "sample_indices")


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_cost_coefficients(cost_coefficients: Sequence[float]) -> tuple[float, float]:
    if len(cost_coefficients) != 2:
        raise ValueError(
            f"cost_coefficients must be (linear, quadratic), got {cost_coefficients!r}; "
            "use (1, 0) to balance tokens or (a, 1) to balance attention work a*L + L^2"
        )
    linear, quadratic = (float(c) for c in cost_coefficients)
    if not (linear >= 0 and quadratic >= 0 and linear + quadratic > 0):
        raise ValueError(
            f"cost_coefficients={tuple(cost_coefficients)!r} must be >= 0 and not both 0, so that a longer "
            "sample always costs more; use (1, 0) to balance tokens"
        )
    return linear, quadratic


def sample_costs(lengths: np.ndarray, cost_coefficients: Sequence[float] = (1.0, 0.0)) -> np.ndarray:
    """Work of each sample: ``linear * L + quadratic * L**2`` as float64 ``[K]``.

    ``(1, 0)`` balances tokens (activation memory, linear layers); ``(a, 1)`` balances the work of a
    decoder layer, whose dense part grows with L and whose attention grows with L^2. For causal
    attention and a llama-like MLP, ``a ~ 12 * hidden_size``: the quadratic term only matters once
    L reaches about that many tokens.

    Example: lengths [8, 4] with (0, 1) -> [64., 16.]; with (2, 1) -> [80., 24.].
    """
    linear, quadratic = _check_cost_coefficients(cost_coefficients)
    lengths = np.asarray(lengths, dtype=np.float64)
    return linear * lengths + quadratic * lengths * lengths


def karmarkar_karp(costs: Sequence[float], num_packs: int) -> list[list[int]]:
    """Largest differencing method (Karmarkar-Karp) for k-way balanced partitioning.

    Every sample starts as a partial partition ``[cost, 0, ..., 0]`` (k sums, descending). The two
    partial partitions with the largest spread (max - min) are merged, the largest sum of one with
    the smallest of the other, until one is left. Ties go to the earlier one (sample order first),
    so the result is deterministic.

    Args:
        costs: ``[K]`` work of each sample.
        num_packs: k.

    Returns:
        k lists of sample indices (ascending), ordered by descending load.

    Example (k=2, costs [8, 7, 6, 5, 4])::

        merge 8|7 -> [8, 7]; merge 6|5 -> [6, 5]; merge [4, 0] with [8, 7] -> [4+7, 0+8] = [11, 8];
        merge [11, 8] with [6, 5] -> [11+5, 8+6] = [16, 14]
        -> [[1, 3, 4], [0, 2]]   (loads 16 and 14; the optimum is 15 and 15)
    """
    heap = []
    for i, cost in enumerate(costs):
        sums = [float(cost)] + [0.0] * (num_packs - 1)
        members = [[i]] + [None] * (num_packs - 1)  # None: an empty slot, no list allocated
        heap.append((-float(cost), i, sums, members))
    heapq.heapify(heap)
    counter = len(heap)
    while len(heap) > 1:
        _, _, sums_a, members_a = heapq.heappop(heap)
        _, _, sums_b, members_b = heapq.heappop(heap)
        sums = [a + b for a, b in zip(sums_a, reversed(sums_b))]
        members = []
        for left, right in zip(members_a, reversed(members_b)):
            if left is None or (right is not None and len(left) < len(right)):
                left, right = right, left  # extend the longer list: O(K log K) copying in total
            if right is not None:
                left.extend(right)
            members.append(left)
        order = sorted(range(num_packs), key=lambda j: -sums[j])
        sums = [sums[j] for j in order]
        members = [members[j] for j in order]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), counter, sums, members))
        counter += 1
    return [sorted(m or []) for m in heap[0][3]]


def improve_packs(
    packs: list[list[int]], costs: np.ndarray, lengths: np.ndarray, max_tokens_per_gpu: int | None = None
) -> list[list[int]]:
    """Local improvement of a partition: lower the heaviest pack by moving or swapping one sample.

    Each round takes the heaviest pack H and, over every other pack P at once, the move (a sample
    of H to P) or swap (a of H with b of P) that minimizes ``max(H - d, P + d)`` (d = cost moved),
    accepted only when that is below H: then ``H^2 + P^2`` strictly drops, so the loop ends. A
    pack never becomes empty, and P never goes over ``max_tokens_per_gpu``. At the end no move
    lowers H against the lightest pack, so ``max load - min load <= cost of the cheapest sample of
    H`` (at most the cost of the longest sample) wherever the cap did not block that move (never
    when balancing tokens under the cap: P + d < H <= cap).

    Example: KK's [[1, 3, 4], [0, 2]] for costs [8, 7, 6, 5, 4] (16 vs 14): swapping sample 1 (7)
    with sample 2 (6) moves d = 1 -> [[0, 1], [2, 3, 4]] (15 vs 15).

    Returns:
        The improved packs, samples ascending, ordered by descending load (ties: first sample).
    """
    num_packs = len(packs)
    pack_of = np.empty(len(costs), dtype=np.int64)  # [K] pack of each sample
    for p, members in enumerate(packs):
        pack_of[members] = p
    loads = np.bincount(pack_of, weights=costs, minlength=num_packs)
    tokens = np.bincount(pack_of, weights=lengths, minlength=num_packs).astype(np.int64)
    sizes = np.bincount(pack_of, minlength=num_packs)
    cap = np.iinfo(np.int64).max if max_tokens_per_gpu is None else max_tokens_per_gpu
    while True:
        h = int(np.argmax(loads))
        rows = np.flatnonzero(pack_of == h)  # samples of H
        # Columns: every sample of another pack (a swap partner), then one empty slot per pack (a move).
        others = np.flatnonzero(pack_of != h)
        slots = np.delete(np.arange(num_packs), h)
        col_pack = np.concatenate([pack_of[others], slots])
        d = costs[rows][:, None] - np.concatenate([costs[others], np.zeros(len(slots))])[None, :]
        token_delta = lengths[rows][:, None] - np.concatenate([lengths[others], np.zeros(len(slots), np.int64)])
        ok = (d > 0) & (d < loads[h] - loads[col_pack]) & (tokens[col_pack] + token_delta <= cap)
        if sizes[h] == 1:
            ok[:, len(others) :] = False
        if not ok.any():
            break
        new_max = np.where(ok, np.maximum(loads[h] - d, loads[col_pack] + d), np.inf)
        row, col = np.unravel_index(int(np.argmin(new_max)), new_max.shape)
        p = int(col_pack[col])
        pack_of[rows[row]] = p
        if col < len(others):
            pack_of[others[col]] = h
        for j in (h, p):
            in_j = pack_of == j
            loads[j], tokens[j], sizes[j] = costs[in_j].sum(), lengths[in_j].sum(), in_j.sum()
    packs = [np.flatnonzero(pack_of == p).tolist() for p in range(num_packs)]
    return sorted(packs, key=lambda m: (-loads[pack_of[m[0]]], m[0]))


def plan_balanced_packs(
    lengths: np.ndarray,
    *,
    num_packs: int | None = None,
    max_tokens_per_gpu: int | None = None,
    cost_coefficients: Sequence[float] = (1.0, 0.0),
    multiple_of: int = 1,
) -> PackPlan:
    """Balanced split of samples of ``lengths`` ``[K]`` into packs, the token cap enforced strictly.

    k starts at the larger of ``num_packs`` and ``ceil(sum(lengths) / max_tokens_per_gpu)``, rounded
    up to a multiple of ``multiple_of``. The samples are split by :func:`karmarkar_karp` and
    :func:`improve_packs` on :func:`sample_costs`; while some pack holds more than
    ``max_tokens_per_gpu`` tokens, k grows by ``multiple_of`` and the split is redone.
    ``ceil(total / cap)`` is only a lower bound (slime and verl stop there and break the cap).

    Why the loop ends: with k >= K every merge of :func:`karmarkar_karp` pairs each sample with an
    empty slot, so each pack holds one sample (and :func:`improve_packs` cannot change such a
    split: a lone sample is never moved, and a swap of two lone samples never lowers the max); no
    sample is longer than the cap (checked first), so that split fits. Hence k never passes the
    first multiple of ``multiple_of`` at or above K. A k above K would leave a pack empty and
    raises instead.

    Args:
        lengths: ``[K]`` positive token counts.
        num_packs: the fewest packs (exactly this many when no cap is given).
        max_tokens_per_gpu: most tokens in one pack.
        cost_coefficients: ``(linear, quadratic)`` of :func:`sample_costs`; (1, 0) balances tokens.
        multiple_of: k is a multiple of this (the data-parallel size, for equal packs per rank).

    Returns:
        A :class:`PackPlan`; packs by descending load, samples ascending inside a pack.

    Example (cap 10, lengths [6, 6, 6, 2])::

        ceil(20 / 10) = 2 packs: best split [6, 6] + [6, 2] -> 12 tokens, over the cap
        3 packs: [[0, 3], [1], [2]] -> 8, 6, 6 tokens
    """
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or len(lengths) == 0 or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"lengths must be a non-empty 1-D int array, got {lengths.dtype} {lengths.shape}")
    lengths = lengths.astype(np.int64)
    if lengths.min() < 1:
        i = int(np.argmin(lengths))
        raise ValueError(f"sample {i} has {lengths[i]} tokens; every sample needs at least 1 token")
    if num_packs is None and max_tokens_per_gpu is None:
        raise ValueError("give num_packs, max_tokens_per_gpu, or both")
    for name, value in (("num_packs", num_packs), ("max_tokens_per_gpu", max_tokens_per_gpu)):
        if value is not None:
            check_positive_int(name, value)
    check_positive_int("multiple_of", multiple_of)
    costs = sample_costs(lengths, cost_coefficients)
    k = num_packs or 1
    if max_tokens_per_gpu is not None:
        longest = int(np.argmax(lengths))
        if lengths[longest] > max_tokens_per_gpu:
            raise ValueError(
                f"sample {longest} has {lengths[longest]} tokens, more than max_tokens_per_gpu="
                f"{max_tokens_per_gpu}; raise the cap or truncate/drop the sample"
            )
        k = max(k, lower_bound_packs(lengths, max_tokens_per_gpu))
    k = -(-k // multiple_of) * multiple_of
    while True:
        if k > len(lengths):
            raise ValueError(
                f"{k} packs are needed (num_packs={num_packs}, max_tokens_per_gpu={max_tokens_per_gpu}, "
                f"multiple_of={multiple_of}) but there are only {len(lengths)} samples, so a pack would be "
                "empty; give more samples or fewer packs"
            )
        packs = improve_packs(karmarkar_karp(costs, k), costs, lengths, max_tokens_per_gpu)
        if max_tokens_per_gpu is None or max(int(lengths[p].sum()) for p in packs) <= max_tokens_per_gpu:
            break
        k += multiple_of
    offsets = np.zeros(k + 1, dtype=np.int64)
    np.cumsum([len(p) for p in packs], out=offsets[1:])
    return PackPlan(np.concatenate([np.asarray(p, np.int64) for p in packs]), offsets)


def _sample_lengths(samples: Sequence[Mapping[str, Any]]) -> tuple[list[str], np.ndarray]:
    if len(samples) == 0:
        raise ValueError("samples is empty; pack_sequences needs at least one sample")
    keys = list(samples[0])
    if not keys:
        raise ValueError("sample 0 has no field; give per-token fields such as input_ids")
    reserved = [k for k in keys if k in PACK_LAYOUT_KEYS]
    if reserved:
        raise ValueError(f"sample fields {reserved} clash with the keys a pack adds {PACK_LAYOUT_KEYS}; rename them")
    lengths = np.empty(len(samples), dtype=np.int64)
    for i, sample in enumerate(samples):
        if list(sample) != keys:
            raise ValueError(f"sample {i} has fields {list(sample)}, sample 0 has {keys}; all need the same fields")
        sizes = {key: len(sample[key]) for key in keys}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"sample {i}: every per-token field needs the same length, got {sizes}")
        lengths[i] = sizes[keys[0]]
    return keys, lengths


def pack_sequences(
    samples: Sequence[Mapping[str, Any]],
    *,
    num_packs: int | None = None,
    max_tokens_per_gpu: int | None = None,
    cost_coefficients: Sequence[float] = (1.0, 0.0),
    multiple_of: int = 1,
) -> list[dict[str, torch.Tensor]]:
    """Split samples into balanced packs (:func:`plan_balanced_packs`) and flatten each pack.

    Args:
        samples: K dicts with the same per-token fields (``input_ids``, ``loss_mask``,
            ``advantages``, ``log_probs``, ...), each ``[L_i, ...]`` (tensor, array or list); every
            field of a sample has the same L_i >= 1.
        num_packs, max_tokens_per_gpu, cost_coefficients, multiple_of: see :func:`plan_balanced_packs`.

    Returns:
        k packs (descending load), each a dict with every sample field concatenated ``[T, ...]``
        in the pack's sample order, plus ``position_ids`` ``[T]`` int64 (restarting at 0 for each
        sample), ``cu_seqlens`` ``[n+1]`` int32, ``seq_lens`` ``[n]`` int64 and ``sample_indices``
        ``[n]`` int64 (positions in ``samples``).

    Example (num_packs=2; samples of input_ids [1 2 3], [4 5], [6 7 8 9], advantages per token)::

        pack 0: input_ids [1 2 3 4 5]  position_ids [0 1 2 0 1]  cu_seqlens [0 3 5]  sample_indices [0 1]
        pack 1: input_ids [6 7 8 9]    position_ids [0 1 2 3]    cu_seqlens [0 4]    sample_indices [2]
    """
    keys, lengths = _sample_lengths(samples)
    plan = plan_balanced_packs(
        lengths, num_packs=num_packs, max_tokens_per_gpu=max_tokens_per_gpu,
        cost_coefficients=cost_coefficients, multiple_of=multiple_of,
    )
    packs = []
    for p in range(plan.num_packs):
        members = plan.sample_order[plan.pack_offsets[p] : plan.pack_offsets[p + 1]]
        seq_lens = torch.from_numpy(lengths[members])
        pack = {key: torch.cat([torch.as_tensor(samples[i][key]) for i in members]) for key in keys}
        cu_seqlens = torch.zeros(len(members) + 1, dtype=torch.int32)
        cu_seqlens[1:] = seq_lens.cumsum(0)
        starts = cu_seqlens[:-1].long().repeat_interleave(seq_lens)
        pack.update(
            position_ids=torch.arange(int(seq_lens.sum())) - starts,
            cu_seqlens=cu_seqlens,
            seq_lens=seq_lens,
            sample_indices=torch.from_numpy(members.copy()),
        )
        packs.append(pack)
    return packs


def unpack_sequences(
    outputs: Sequence[torch.Tensor], packs: Sequence[Mapping[str, torch.Tensor]]
) -> list[torch.Tensor]:
    """Per-token outputs of packs (logits, log-probs, losses) -> one tensor per sample.

    Sample j of a pack is rows ``cu_seqlens[j] : cu_seqlens[j] + seq_lens[j]`` of its output, so
    tail padding (e.g. from :func:`pad_packed_sequence_with_cp`) is cut off by the layout, never by
    looking for a pad token id: token id 0 is a real token in most vocabularies.

    Args:
        outputs: one ``[T_p, ...]`` tensor per pack, T_p at least the pack's real tokens.
        packs: the packs from :func:`pack_sequences` (``cu_seqlens``, ``seq_lens``,
            ``sample_indices`` are read), in the same order as ``outputs``.

    Returns:
        Views ``[L_i, ...]`` in ascending sample index: given all packs, entry i is sample i
        of ``pack_sequences``'s input; given a subset (one DP rank's packs), the order of
        ``sorted(cat(sample_indices))``.

    Example: packs with sample_indices [2, 0] (cu_seqlens [0 3 5]) and [1] (cu_seqlens [0 4]),
    outputs of 6 (1 tail pad) and 4 rows -> [rows 3:5 of out0, rows 0:4 of out1, rows 0:3 of out0].
    """
    if len(outputs) != len(packs):
        raise ValueError(f"got {len(outputs)} outputs for {len(packs)} packs; give one output per pack")
    pieces: dict[int, torch.Tensor] = {}
    for p, (output, pack) in enumerate(zip(outputs, packs)):
        starts = pack["cu_seqlens"][:-1].tolist()
        seq_lens = pack["seq_lens"].tolist()
        indices = pack["sample_indices"].tolist()
        if not len(starts) == len(seq_lens) == len(indices):
            raise ValueError(
                f"pack {p}: cu_seqlens needs one entry more than seq_lens and sample_indices, got "
                f"{len(starts) + 1}, {len(seq_lens)}, {len(indices)}"
            )
        real_end = starts[-1] + seq_lens[-1] if starts else 0
        if output.shape[0] < real_end:
            raise ValueError(
                f"pack {p}: output has {output.shape[0]} rows but its samples span {real_end}; pass the "
                "full per-token output of the pack (dim 0 = tokens)"
            )
        for index, start, length in zip(indices, starts, seq_lens):
            if index in pieces:
                raise ValueError(f"sample {index} appears in more than one pack; pass each pack once")
            pieces[index] = output[start : start + length]
    return [pieces[i] for i in sorted(pieces)]


def pad_packed_sequence_with_cp(
    pack: Mapping[str, torch.Tensor], cp_size: int, padding_values: Mapping[str, float] | None = None
) -> dict[str, torch.Tensor]:
    """Pad a pack at its end so its T tokens split into ``cp_size`` equal contiguous slices.

    For context parallelism that splits the flat pack contiguously (rank r takes tokens
    ``[r*T'/cp, (r+1)*T'/cp)``) and runs attention over all-gathered keys/values or a ring with the
    GLOBAL ``cu_seqlens``. The padding is appended to the last sample: the last ``cu_seqlens`` entry
    grows to T' while ``seq_lens`` keeps the real lengths, so :func:`unpack_sequences` still cuts
    exactly. Causal attention keeps real tokens from seeing the padding after them.

    Not for Transformer Engine's THD context parallelism (``thd_get_partitioned_indices``, used by
    ``make_cp_batch_for_te`` in our trainer): its dual-chunk split needs EVERY sequence padded to a
    multiple of ``2*cp_size``; pad each sample before packing for that (as ``BalancedBatching`` does).

    Args:
        pack: a pack from :func:`pack_sequences`.
        cp_size: W.
        padding_values: value of the padding per field (e.g. ``{"input_ids": pad_id}``); fields not
            named (``loss_mask``, ``advantages``, ...) and ``position_ids`` are padded with 0.

    Returns:
        A new pack with every per-token field ``[T', ...]``, T' = T rounded up to a multiple of W,
        and ``cu_seqlens[-1] = T'``.

    Example (W=4; samples [11 12 13] and [14 15], loss_mask all 1)::

        input_ids     [11 12 13 14 15  0  0  0]
        position_ids  [ 0  1  2  0  1  0  0  0]
        loss_mask     [ 1  1  1  1  1  0  0  0]
        cu_seqlens    [0 3 8]        seq_lens [3 2]
    """
    check_positive_int("cp_size", cp_size)
    padding_values = dict(padding_values or {})
    if "position_ids" in padding_values:
        raise ValueError("position_ids are always padded with 0; drop position_ids from padding_values")
    cu_seqlens = pack["cu_seqlens"]
    total = int(cu_seqlens[-1])
    padded_total = -(-total // cp_size) * cp_size
    token_keys = [key for key in pack if key not in ("cu_seqlens", "seq_lens", "sample_indices")]
    unknown = sorted(set(padding_values) - set(token_keys))
    if unknown:
        raise ValueError(f"padding_values names {unknown}, which are not per-token fields of the pack {token_keys}")
    result = dict(pack)
    for key in token_keys:
        value = pack[key]
        if value.shape[0] != total:
            raise ValueError(
                f"field {key!r} has {value.shape[0]} rows but cu_seqlens[-1] is {total}; "
                "pad a pack straight from pack_sequences, once"
            )
        tail = value.new_full((padded_total - total, *value.shape[1:]), padding_values.get(key, 0))
        result[key] = torch.cat([value, tail])
    result["cu_seqlens"] = cu_seqlens.clone()
    result["cu_seqlens"][-1] = padded_total
    return result


def plan_balanced_epoch(
    lengths: np.ndarray,
    *,
    dp_size: int,
    samples_per_pack: int,
    packs_per_rank: int = 1,
    max_tokens_per_gpu: int | None = None,
    cost_coefficients: Sequence[float] = (1.0, 0.0),
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
) -> list[np.ndarray]:
    """One epoch of balanced micro-batches for every DP rank.

    Samples (shuffled with ``(seed, epoch)`` unless ``shuffle=False``) are cut into groups of
    ``G = samples_per_pack * dp_size * packs_per_rank`` (the incomplete last group is dropped). A
    group is split by :func:`plan_balanced_packs` into ``dp_size * packs_per_rank`` packs, or into
    more (a multiple of ``dp_size``) when the cap demands. The packs, by descending load, are dealt
    ``dp_size`` at a time to micro-step 0, 1, ... of the group, alternating direction so that no
    rank always gets the heaviest; every rank gets the same number of micro-batches per group.

    Returns:
        Sample indices per micro-batch; rank r's j-th micro-batch is entry ``j * dp_size + r``.

    Example (dp_size=2, samples_per_pack=2, no shuffle, lengths [8, 7, 6, 5, 4, 2, 9]): one group of
    4 samples [8, 7, 6, 5] -> packs [0, 3] (13) and [1, 2] (13); samples 4..6 are dropped ->
    ``[array([0, 3]), array([1, 2])]``.
    """
    for name, value in (("dp_size", dp_size), ("samples_per_pack", samples_per_pack),
                        ("packs_per_rank", packs_per_rank)):
        check_positive_int(name, value)
    lengths = np.asarray(lengths, dtype=np.int64)
    group = samples_per_pack * dp_size * packs_per_rank
    order = np.random.default_rng((seed, epoch)).permutation(len(lengths)) if shuffle else np.arange(len(lengths))
    micro_batches = []
    for start in range(0, len(order) - group + 1, group):
        members = order[start : start + group]
        plan = plan_balanced_packs(
            lengths[members], num_packs=dp_size * packs_per_rank, max_tokens_per_gpu=max_tokens_per_gpu,
            cost_coefficients=cost_coefficients, multiple_of=dp_size,
        )
        packs = [
            members[plan.sample_order[plan.pack_offsets[p] : plan.pack_offsets[p + 1]]]
            for p in range(plan.num_packs)
        ]
        for step, first in enumerate(range(0, len(packs), dp_size)):
            dealt = packs[first : first + dp_size]
            micro_batches.extend(dealt if step % 2 == 0 else dealt[::-1])
    return micro_batches


def collate_balanced_pack(
    rows: Sequence[Mapping[str, Any]], cp_size: int = 1, padding_idx: int = 0
) -> dict[str, Any]:
    """Flatten one pack's dataset rows into a one-row batch of the collater contract.

    Each sample (``input_ids``, ``labels``, optional ``loss_mask``: 0 turns the label into -100)
    is padded at its end to a multiple of ``2 * cp_size`` (tokens ``padding_idx``, labels -100);
    positions restart at 0 per sample and count through its padding, as ``pack_dataset`` does, so
    ``make_cp_batch_for_te`` shards it with TE's dual-chunk layout. No tail padding: the row is as
    long as its padded samples (T varies between micro-batches).

    Example (cp_size=2; rows [5 6 7] labels [6 7 8] loss_mask [0 1 1], and [9 4] labels [4 2])::

        input_ids       [[5 6 7 0 9 4 0 0]]
        labels          [[-100 7 8 -100 4 2 -100 -100]]
        position_ids    [[0 1 2 3 0 1 2 3]]
        seq_lens        [[3 2]]          seq_lens_padded [[4 4]]
    """
    multiple = 2 * cp_size if cp_size > 1 else 1
    seq_lens = np.array([len(row["input_ids"]) for row in rows], dtype=np.int64)
    padded_lens = -(-seq_lens // multiple) * multiple
    total = int(padded_lens.sum())
    input_ids = np.full(total, padding_idx, dtype=np.int64)
    labels = np.full(total, CROSS_ENTROPY_IGNORE_INDEX, dtype=np.int64)
    starts = np.cumsum(padded_lens) - padded_lens
    for row, start, length in zip(rows, starts, seq_lens):
        input_ids[start : start + length] = row["input_ids"]
        row_labels = np.asarray(row["labels"])
        if "loss_mask" in row:
            row_labels = np.where(np.asarray(row["loss_mask"]) != 0, row_labels, CROSS_ENTROPY_IGNORE_INDEX)
        labels[start : start + length] = row_labels
    position_ids = np.arange(total) - np.repeat(starts, padded_lens)
    pack = {
        "input_ids": input_ids, "labels": labels, "position_ids": position_ids,
        "seq_lens": seq_lens, "seq_lens_padded": padded_lens,
    }
    return packed_sequence_thd_collater([pack])


class _EpochPlanDataset(torch.utils.data.Dataset):
    """This rank's micro-batches of one epoch: item j is the list of dataset rows of its j-th pack.

    ``plan_epoch(epoch=e)`` gives every rank's micro-batches (:func:`plan_balanced_epoch`).
    """

    def __init__(self, dataset: datasets.Dataset, plan_epoch: functools.partial, dp_rank: int, dp_size: int):
        self.dataset = dataset
        self.plan_epoch = plan_epoch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.epoch: int | None = None
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:  # the plan depends only on the epoch: recompute on change only
            self.micro_batches = self.plan_epoch(epoch=epoch)[self.dp_rank :: self.dp_size]
            self.epoch = epoch

    def __len__(self) -> int:
        return len(self.micro_batches)

    def __getitem__(self, j: int) -> list[dict[str, Any]]:
        return [self.dataset[int(i)] for i in self.micro_batches[j]]


@dataclass
class BalancedBatching:
    """``packing: balanced``: every step's samples split into packs of balanced work, one per DP rank.

    Each group of ``micro_batch_size * dp_size * packs_per_rank`` samples (shuffled per epoch) is
    split by :func:`plan_balanced_epoch` into ``dp_size * packs_per_rank`` packs, more when a pack
    would exceed ``packed_sequence_size`` tokens (the cap, slime's ``max_tokens_per_gpu``). Every
    rank gets the same number of micro-batches from each group; each micro-batch is one pack
    flattened to one row ``[1, T]`` (:func:`collate_balanced_pack`), T <= ``packed_sequence_size``
    and varying. The epoch's plan is a pure function of ``(seed, epoch)``, so the resume state is
    the position in it.

    Args:
        packed_sequence_size: most tokens of one pack (after CP padding).
        micro_batch_size: samples per pack on average (each micro-batch is one pack).
        packs_per_rank: micro-batches per rank from one group; set it to the trainer's
            ``grad_accum_steps`` so that a group is one optimizer step.
        cost_coefficients: ``(linear, quadratic)`` per-sample work ``linear*L + quadratic*L^2``;
            (1, 0) balances tokens, (12*hidden_size, 1) roughly balances a decoder layer's work.
        cp_size: every sample is padded to a multiple of ``2 * cp_size`` (TE dual-chunk CP).
        drop_long_samples: drop (and report) samples longer than ``packed_sequence_size`` after
            CP padding; with False such a sample raises ValueError.
        shuffle: shuffle samples per epoch before grouping; False keeps dataset order (rollouts).
        num_workers: DataLoader worker processes.
    """

    packed_sequence_size: int = 16384
    micro_batch_size: int = 16
    packs_per_rank: int = 1
    cost_coefficients: tuple[float, float] = (1.0, 0.0)
    cp_size: int = 1
    drop_long_samples: bool = True
    shuffle: bool = True
    num_workers: int = 0

    def __post_init__(self) -> None:
        for name in ("packed_sequence_size", "micro_batch_size", "packs_per_rank", "cp_size"):
            check_positive_int(name, getattr(self, name))
        if not _is_int(self.num_workers) or self.num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0, got {self.num_workers!r}")
        self.cost_coefficients = _check_cost_coefficients(self.cost_coefficients)
        if self.cp_size > 1 and self.packed_sequence_size < 2 * self.cp_size:
            raise ValueError(
                f"packed_sequence_size={self.packed_sequence_size} cannot hold one sample padded to "
                f"2*cp_size={2 * self.cp_size}; raise packed_sequence_size"
            )

    def build(self, dataset: datasets.Dataset, env: LoaderEnv) -> MicroBatchStream:
        lengths = np.asarray(dataset.with_format("arrow")[:]["input_ids"].combine_chunks().value_lengths())
        multiple = 2 * self.cp_size if self.cp_size > 1 else 1
        padded_lens = (-(-lengths // multiple) * multiple).astype(np.int64)
        too_long = np.flatnonzero(padded_lens > self.packed_sequence_size)
        if len(too_long):
            if not self.drop_long_samples:
                i = int(too_long[0])
                raise ValueError(
                    f"sample {i} has {lengths[i]} tokens ({padded_lens[i]} after padding to a multiple of "
                    f"{multiple}), more than packed_sequence_size={self.packed_sequence_size}; raise it or set "
                    "drop_long_samples=True"
                )
            logger.warning(
                "packing balanced: dropped %d of %d samples (%.3f%%) longer than packed_sequence_size=%d",
                len(too_long), len(lengths), 100 * len(too_long) / len(lengths), self.packed_sequence_size,
            )
            keep = np.flatnonzero(padded_lens <= self.packed_sequence_size)
            dataset, padded_lens = dataset.select(keep), padded_lens[keep]
        plan_epoch = functools.partial(  # a partial, not a closure: worker processes can pickle it
            plan_balanced_epoch, padded_lens, dp_size=env.dp_size, samples_per_pack=self.micro_batch_size,
            packs_per_rank=self.packs_per_rank, max_tokens_per_gpu=self.packed_sequence_size,
            cost_coefficients=self.cost_coefficients, seed=env.seed, shuffle=self.shuffle,
        )
        planned = _EpochPlanDataset(dataset.with_format("numpy"), plan_epoch, env.dp_rank, env.dp_size)
        collate = functools.partial(collate_balanced_pack, cp_size=self.cp_size, padding_idx=env.padding_idx)
        loader = StatefulDataLoader(planned, batch_size=None, collate_fn=collate, num_workers=self.num_workers)
        return MicroBatchStream(loader, planned.set_epoch)

