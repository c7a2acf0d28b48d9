"""Pack planning: which sample goes into which pack, computed from lengths alone.

Planning is separated from materializing (``pack_dataset`` builds the token columns from a plan),
so every algorithm shares one builder. Planners are compiled with numba: no per-sample Python.

A plan is two arrays: ``sample_order`` ``[K]`` (indices into the length array, grouped by pack, in
output order) and ``pack_offsets`` ``[P+1]`` (pack ``p`` holds
``sample_order[pack_offsets[p]:pack_offsets[p+1]]``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

PACKING_ALGORITHMS = ("bfd", "sequential")


@dataclass(frozen=True)
class PackPlan:
    sample_order: np.ndarray  # [K] int64
    pack_offsets: np.ndarray  # [P+1] int64

    @property
    def num_packs(self) -> int:
        return len(self.pack_offsets) - 1

    def truncate(self, max_packs: int) -> PackPlan:
        """The first ``max_packs`` packs."""
        if max_packs >= self.num_packs:
            return self
        offsets = self.pack_offsets[: max_packs + 1]
        return PackPlan(self.sample_order[: offsets[-1]], offsets)


def lower_bound_packs(lengths: np.ndarray, capacity: int) -> int:
    """``ceil(sum(lengths) / capacity)``: no plan can use fewer packs."""
    return -(-int(lengths.sum()) // capacity)


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
        raise ValueError(f"every length must be in [1, {capacity}], got range [{lengths.min()}, {lengths.max()}]")
    if algorithm == "sequential":
        pack_of_sample = _next_fit(lengths, capacity)
        sample_order = np.arange(len(lengths), dtype=np.int64)
        num_packs = int(pack_of_sample[-1]) + 1
    else:
        by_length_desc = np.argsort(-lengths, kind="stable")
        pack_of_sample, num_packs = _best_fit_decreasing(lengths, by_length_desc, capacity)
        pack_position = np.random.default_rng(seed).permutation(num_packs)
        pack_of_sample = pack_position[pack_of_sample]
        sample_order = np.argsort(pack_of_sample, kind="stable")
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
