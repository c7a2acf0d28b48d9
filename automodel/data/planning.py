"""Pack planning: which sample goes into which pack, computed from lengths alone.

Planning is separated from materializing (``pack_dataset`` builds the token columns from a plan),
so every algorithm shares one builder. Planners are compiled with numba: no per-sample Python.

A plan is two arrays: ``sample_order`` ``[K]`` (indices into the length array, grouped by pack, in
output order) and ``pack_offsets`` ``[P+1]`` (pack ``p`` holds
``sample_order[pack_offsets[p]:pack_offsets[p+1]]``).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numba
import numpy as np

PACKING_ALGORITHMS = ("bfd", "sequential")


def check_positive_int(name: str, value) -> None:
    """ValueError naming ``name`` unless ``value`` is an int >= 1 (bools rejected)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class PackPlan:
    sample_order: np.ndarray  # [K] int64
    pack_offsets: np.ndarray  # [P+1] int64

    @property
    def num_packs(self) -> int:
        return len(self.pack_offsets) - 1

    @classmethod
    def from_packs(cls, packs: Sequence[Sequence[int]]) -> PackPlan:
        """The plan of ``packs``, each a list of sample indices, in this order."""
        offsets = np.zeros(len(packs) + 1, np.int64)
        np.cumsum([len(p) for p in packs], out=offsets[1:])
        return cls(np.concatenate(packs).astype(np.int64) if len(packs) else np.zeros(0, np.int64), offsets)


def lower_bound_packs(lengths: np.ndarray, capacity: int) -> int:
    """``ceil(sum(lengths) / capacity)``: no plan can use fewer packs."""
    return -(-int(lengths.sum()) // capacity)


_PACK_SHUFFLE_STREAM = 1


def plan_packs(lengths: np.ndarray, capacity: int, algorithm: str = "bfd", seed: int = 0) -> PackPlan:
    """Assign samples of ``lengths`` ``[K]`` (each in ``1..capacity``) to packs of ``capacity`` tokens.

    ``"sequential"``: next-fit in dataset order (NeMo AutoModel's and torchtune's packer): a pack
    closes as soon as the next sample does not fit. Order is preserved.

    ``"bfd"``: best-fit decreasing over all samples (each sample, longest first, goes into the open
    pack with the least room that still fits it), then packs are shuffled with ``seed`` so that
    training steps do not see lengths sorted. Inside a pack samples keep dataset order.
    """
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    if algorithm not in PACKING_ALGORITHMS:
        raise ValueError(f"algorithm must be one of {PACKING_ALGORITHMS}, got {algorithm!r}")
    if lengths.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {lengths.shape}")
    if len(lengths) == 0:
        return PackPlan(np.zeros(0, np.int64), np.zeros(1, np.int64))
    if lengths.min() < 1 or lengths.max() > capacity:
        raise ValueError(
            f"every length must be in [1, {capacity}], got range [{lengths.min()}, {lengths.max()}]"
        )
    if algorithm == "sequential":
        pack_of_sample = _next_fit(lengths, capacity)
        sample_order = np.arange(len(lengths), dtype=np.int64)  # next-fit keeps dataset order
        num_packs = int(pack_of_sample[-1]) + 1
    else:
        pack_of_sample, num_packs = _best_fit_decreasing(
            lengths, np.argsort(-lengths, kind="stable"), capacity
        )
        # A stream of its own: numpy seeds ``seed`` and ``(seed, 0)`` alike, and the epoch engine draws
        # epoch 0's order from ``(seed, 0)``, which would undo this shuffle (lengths sorted again).
        shuffle = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_PACK_SHUFFLE_STREAM,)))
        pack_of_sample = shuffle.permutation(num_packs)[pack_of_sample]
        sample_order = np.argsort(pack_of_sample, kind="stable")  # dataset order inside a pack
    pack_offsets = np.zeros(num_packs + 1, dtype=np.int64)
    np.cumsum(np.bincount(pack_of_sample, minlength=num_packs), out=pack_offsets[1:])
    return PackPlan(sample_order, pack_offsets)


@numba.njit(cache=True)
def _next_fit(lengths, capacity):
    pack_of_sample = np.empty(len(lengths), np.int64)
    pack, used = 0, 0
    for i in range(len(lengths)):
        if used + lengths[i] > capacity:
            pack += 1
            used = 0
        pack_of_sample[i] = pack
        used += lengths[i]
    return pack_of_sample


@numba.njit(cache=True)
def _best_fit_decreasing(lengths, order, capacity):
    # Open packs are bucketed by remaining room r (a stack of packs per r), and a sum segment tree
    # over r finds the smallest r >= length with a pack in it: O(log capacity) per sample.
    leaves = 1
    while leaves < capacity + 1:
        leaves *= 2
    tree = np.zeros(2 * leaves, np.int64)
    stack_top = np.full(capacity + 1, -1, np.int64)
    below = np.empty(len(lengths), np.int64)  # next pack down the same stack
    pack_of_sample = np.empty(len(lengths), np.int64)
    num_packs = 0
    for k in range(len(order)):
        i = order[k]
        need = lengths[i]
        room = _first_nonempty_at_or_after(tree, leaves, need)
        if room < 0:
            pack = num_packs
            num_packs += 1
            left = capacity - need
        else:
            pack = stack_top[room]
            stack_top[room] = below[pack]
            _add(tree, leaves, room, -1)
            left = room - need
        pack_of_sample[i] = pack
        if left > 0:
            below[pack] = stack_top[left]
            stack_top[left] = pack
            _add(tree, leaves, left, 1)
    return pack_of_sample, num_packs


@numba.njit(cache=True, inline="always")
def _add(tree, leaves, index, delta):
    node = leaves + index
    while node >= 1:
        tree[node] += delta
        node //= 2


@numba.njit(cache=True)
def _first_nonempty_at_or_after(tree, leaves, index):
    """Smallest leaf ``>= index`` with a nonzero count, or -1."""
    node = leaves + index
    if tree[node] > 0:
        return index
    # Climb until a right sibling holds something, then descend to its leftmost nonzero leaf.
    while node > 1:
        if node % 2 == 0 and tree[node + 1] > 0:
            node += 1
            while node < leaves:
                node = 2 * node if tree[2 * node] > 0 else 2 * node + 1
            return node - leaves
        node //= 2
    return -1


# --- token budget (dyn_bsz) ---------------------------------------------------------------------


def plan_token_budget(
    order: np.ndarray,
    weights: np.ndarray,
    sizes: np.ndarray,
    budget: int,
    max_size: int,
    buffer_size: int = 200,
) -> PackPlan:
    """Micro-batches under a token budget, filled from a bounded buffer (``dyn_bsz``).

    Samples arrive in ``order``; a buffer holds up to ``buffer_size`` of them. Each micro-batch:
    top the buffer up from the arrivals, then scan it from the largest weight down and take every
    sample that still fits both ``budget`` (sum of ``weights``) and ``max_size`` (sum of ``sizes``).
    Largest-first leaves small samples to fill the gaps (first-fit decreasing for one bin), which
    is why this beats a scan in arrival order. Inside a micro-batch samples keep arrival order.

    Example (sizes 4, 2, 3, 1 = S1..S4 arriving in order, budget 6, buffer 4)::

        buffer sorted [S1:4, S3:3, S2:2, S4:1] -> take S1, S2 (4+2)  -> micro-batch [S1 S2]
        buffer [S3:3, S4:1]                     -> take both          -> micro-batch [S3 S4]
    """
    order = np.ascontiguousarray(order, dtype=np.int64)
    weights = np.ascontiguousarray(weights, dtype=np.int64)
    sizes = np.ascontiguousarray(sizes, dtype=np.int64)
    if len(order) and (
        weights[order].max() > budget or sizes[order].max() > max_size or weights[order].min() < 0
    ):
        raise ValueError(f"every sample must fit alone: weights in [0, {budget}] and sizes <= {max_size}")
    sample_order, offsets = _buffered_largest_first(order, weights, sizes, budget, max_size, buffer_size)
    return PackPlan(sample_order, offsets)


@numba.njit(cache=True)
def _buffered_largest_first(order, weights, sizes, budget, max_size, buffer_size):
    num = len(order)
    # The buffer, kept sorted by weight (descending; ties in arrival order): arrival rank, weight, size.
    arrival = np.empty(buffer_size, np.int64)
    weight = np.empty(buffer_size, np.int64)
    size = np.empty(buffer_size, np.int64)
    taken = np.empty(buffer_size, np.int64)
    sample_order = np.empty(num, np.int64)
    offsets = np.zeros(num + 1, np.int64)
    filled, arrived, emitted, batches = 0, 0, 0, 0
    while arrived < num or filled > 0:
        # Top up: sort the next arrivals (stable, so ties keep arrival order) and merge them into the
        # buffer from the back; on equal weights a buffered sample arrived earlier and stays first.
        count = min(buffer_size - filled, num - arrived)
        new_weight = weights[order[arrived : arrived + count]]
        new_rank = np.argsort(-new_weight, kind="mergesort")
        i, j = filled - 1, count - 1
        for out in range(filled + count - 1, -1, -1):
            if j < 0:
                break
            if i >= 0 and weight[i] < new_weight[new_rank[j]]:
                arrival[out], weight[out], size[out] = arrival[i], weight[i], size[i]
                i -= 1
            else:
                arrival[out] = arrived + new_rank[j]
                weight[out] = new_weight[new_rank[j]]
                size[out] = sizes[order[arrival[out]]]
                j -= 1
        filled += count
        arrived += count
        room_weight, room_size, num_taken, kept = budget, max_size, 0, 0
        for k in range(filled):
            if weight[k] <= room_weight and size[k] <= room_size:
                room_weight -= weight[k]
                room_size -= size[k]
                taken[num_taken] = arrival[k]
                num_taken += 1
            else:
                arrival[kept], weight[kept], size[kept] = arrival[k], weight[k], size[k]
                kept += 1
        filled = kept
        for rank in np.sort(taken[:num_taken]):
            sample_order[emitted] = order[rank]
            emitted += 1
        batches += 1
        offsets[batches] = emitted
    return sample_order, offsets[: batches + 1]


# --- balanced packs (slime-style) -----------------------------------------------------------------


def check_cost_coefficients(cost_coefficients: Sequence[float]) -> tuple[float, float]:
    values = tuple(float(c) for c in cost_coefficients)
    if not (len(values) == 2 and min(values) >= 0 and sum(values) > 0):  # NaN fails too
        raise ValueError(
            f"cost_coefficients={tuple(cost_coefficients)!r} must be (linear, quadratic), >= 0 and not both 0, so "
            "that a longer sample costs more; use (1, 0) to balance tokens or (a, 1) for attention work a*L + L^2"
        )
    return values


def sample_costs(lengths: np.ndarray, cost_coefficients: Sequence[float] = (1.0, 0.0)) -> np.ndarray:
    """Work of each sample: ``linear * L + quadratic * L**2`` as float64 ``[K]``.

    ``(1, 0)`` balances tokens (activation memory, linear layers); ``(a, 1)`` balances the work of a
    decoder layer, whose dense part grows with L and whose attention grows with L^2. For causal
    attention and a llama-like MLP, ``a ~ 12 * hidden_size``: the quadratic term only matters once
    L reaches about that many tokens.

    Example: lengths [8, 4] with (0, 1) -> [64., 16.]; with (2, 1) -> [80., 24.].
    """
    linear, quadratic = check_cost_coefficients(cost_coefficients)
    lengths = np.asarray(lengths, dtype=np.float64)
    return linear * lengths + quadratic * lengths * lengths


def karmarkar_karp(costs: Sequence[float], num_packs: int) -> list[list[int]]:
    """Largest differencing method (Karmarkar-Karp) for k-way balanced partitioning.

    Every sample starts as a partial partition ``[cost, 0, ..., 0]`` (k sums, descending). The two
    partial partitions with the largest spread (max - min) are merged, the largest sum of one with
    the smallest of the other, until one is left. Ties go to the earlier one (sample order first),
    so the result is deterministic.

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

    Each round takes the heaviest pack H and the move (a sample of H to P) or swap (a of H, b of P)
    that minimizes ``max(H - d, P + d)``, accepted only below H (so ``H^2 + P^2`` drops and the loop
    ends). No pack empties; none goes over ``max_tokens_per_gpu``. Returns packs by descending load.

    Example: KK's [[1, 3, 4], [0, 2]] for costs [8, 7, 6, 5, 4] (16 vs 14): swapping sample 1 (7)
    with sample 2 (6) moves d = 1 -> [[0, 1], [2, 3, 4]] (15 vs 15).
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
        token_delta = lengths[rows][:, None] - np.concatenate(
            [lengths[others], np.zeros(len(slots), np.int64)]
        )
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

    The loop ends: with k >= K every pack holds one sample, which fits (checked first); a k above
    K would leave a pack empty and raises instead. Returns packs by descending load, samples ascending.

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
                f"{k} packs are needed (num_packs={num_packs}, max_tokens_per_gpu={max_tokens_per_gpu}, multiple_of="
                f"{multiple_of}) but a pack would be empty: {len(lengths)} samples; give more samples or fewer packs"
            )
        packs = improve_packs(karmarkar_karp(costs, k), costs, lengths, max_tokens_per_gpu)
        if max_tokens_per_gpu is None or max(int(lengths[p].sum()) for p in packs) <= max_tokens_per_gpu:
            break
        k += multiple_of
    return PackPlan.from_packs(packs)
