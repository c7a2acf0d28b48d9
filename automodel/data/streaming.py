"""Streaming packing: rows that arrive one at a time -> packs in :func:`pack_dataset`'s row contract.

For data too large to pack up front (``datasets`` streaming, a generator, a huge Arrow dataset):
packs are formed on the fly by best-fit decreasing over a bounded window of waiting samples, with
an exact, resumable position.

- :func:`plan_stream`: the plan (which sample goes into which pack) from lengths alone.
- :class:`StreamPacker`: rows in, packs out, ``state_dict``/``load_state_dict``.
- :func:`pack_stream`: any iterable of rows -> a generator of packs.
- :class:`StreamingPackedBatching`: the ``packing: streaming`` batching mode.

Memory is bounded by ``buffer_size``: at most ``buffer_size`` waiting samples of at most
``packed_sequence_size`` tokens each, plus the packs of one round (those samples, laid out).
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import datasets
import numba
import numpy as np
import pyarrow.compute as pc
import torch
from datasets.distributed import split_dataset_by_node
from torchdata.stateful_dataloader import StatefulDataLoader

from automodel.data.collate import CROSS_ENTROPY_IGNORE_INDEX, packed_sequence_thd_collater
from automodel.data.loader import LoaderEnv, MicroBatchStream, check_positive_int
from automodel.data.packing import PackingReport, _check_arguments, _fill_packs, _fits_int32, _list_column
from automodel.data.planning import PackPlan, plan_packs

logger = logging.getLogger(__name__)

PACK_KEYS = ("input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded")
_ROWS_PER_READ = 256  # rows a map-style source takes from Arrow at a time


def _mix(*values: int) -> int:
    """One seed from several non-negative ints (a run seed and an epoch, say)."""
    return int(np.random.SeedSequence(list(values)).generate_state(1)[0])


class _WindowPlanner:
    """Best-fit decreasing over a window of waiting samples, from lengths alone.

    A round runs when ``buffer_size`` samples wait: BFD over all of them; every completely full
    pack leaves, and so does every pack holding a sample in its ``max_wait_rounds``-th round;
    then the fullest remaining packs leave until at least half of the waiting samples are gone.
    The rest wait for the next round, where new arrivals can complete them. Round ``r`` shuffles
    its packs with seed ``seed + r`` (``plan_packs``); inside a pack samples keep arrival order.
    """

    def __init__(self, capacity: int, buffer_size: int, max_wait_rounds: int, seed: int):
        self.capacity, self.buffer_size, self.max_wait_rounds, self.seed = (
            capacity,
            buffer_size,
            max_wait_rounds,
            seed,
        )
        self.keys: list[int] = []  # waiting samples, in arrival order
        self.lengths: list[int] = []
        self.first_round: list[int] = []  # the first round each waiting sample takes part in
        self.rounds = 0

    def add(self, keys: list[int], lengths: list[int]) -> list[list[int]]:
        """Queue samples (no more than the buffer has room for); returns the packs (lists of keys)
        of the round this triggers, if it does."""
        self.keys += keys
        self.lengths += lengths
        self.first_round += [self.rounds] * len(keys)
        return self._round(final=False) if len(self.keys) >= self.buffer_size else []

    @property
    def room(self) -> int:
        return self.buffer_size - len(self.keys)

    def finish(self) -> list[list[int]]:
        """End of data: every waiting sample goes into a pack."""
        return self._round(final=True) if self.keys else []

    def _round(self, final: bool) -> list[list[int]]:
        lengths = np.asarray(self.lengths, np.int64)
        plan = plan_packs(lengths, self.capacity, "bfd", self.seed + self.rounds)
        starts = plan.pack_offsets[:-1]
        members = np.diff(plan.pack_offsets)
        if final:
            emit = np.ones(plan.num_packs, np.bool_)
        else:
            used = np.add.reduceat(lengths[plan.sample_order], starts)
            waited = self.rounds + 1 - np.asarray(self.first_round)[plan.sample_order]
            emit = (used == self.capacity) | np.logical_or.reduceat(waited >= self.max_wait_rounds, starts)
            missing = (len(lengths) + 1) // 2 - int(members[emit].sum())
            if missing > 0:  # progress: at least half leave, the fullest packs first
                candidates = np.argsort(-used, kind="stable")
                candidates = candidates[~emit[candidates]]
                emit[candidates[: np.searchsorted(np.cumsum(members[candidates]), missing) + 1]] = True
        self.rounds += 1
        keys = np.asarray(self.keys, np.int64)
        packs = [
            keys[plan.sample_order[starts[p] : starts[p] + members[p]]].tolist() for p in np.flatnonzero(emit)
        ]
        stays = np.empty(len(lengths), np.bool_)
        stays[plan.sample_order] = ~np.repeat(emit, members)
        self.keys = keys[stays].tolist()
        self.lengths = lengths[stays].tolist()
        self.first_round = np.asarray(self.first_round)[stays].tolist()
        return packs

    def state_dict(self) -> dict[str, Any]:
        return {
            "keys": list(self.keys),
            "lengths": list(self.lengths),
            "first_round": list(self.first_round),
            "rounds": self.rounds,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.keys, self.lengths = list(state["keys"]), list(state["lengths"])
        self.first_round, self.rounds = list(state["first_round"]), state["rounds"]


def plan_stream(
    lengths: np.ndarray, capacity: int, buffer_size: int = 1000, *, max_wait_rounds: int = 8, seed: int = 0
) -> PackPlan:
    """The plan :class:`StreamPacker` forms for samples of ``lengths`` ``[K]`` arriving in order.

    Best-fit decreasing over a window: a round runs whenever ``buffer_size`` samples wait; it
    emits the full packs (and any pack with a sample in its ``max_wait_rounds``-th round), then the
    fullest others until at least half the waiting samples are gone; the rest wait for new
    arrivals. At the end everything waiting is packed. With ``buffer_size > K`` this is
    ``plan_packs(lengths, capacity, "bfd", seed)``.

    Example (capacity 10, buffer_size 4, lengths [6 5 4 3 5 2 4])::

        round 0, waiting [6 5 4 3]:  BFD -> {6 4} full, {5 3}      emits {6 4}      (samples 0 2)
        round 1, waiting [5 3 5 2]:  BFD -> {5 5} full, {3 2}      emits {5 5}      (samples 1 4)
        end,     waiting [3 2 4]:                                  emits {3 2 4}    (samples 3 5 6)
        sample_order [0 2 1 4 3 5 6], pack_offsets [0 2 4 7]: 3 packs, the lower bound
        (next-fit in order needs 4: [6] [5 4] [3 5 2] [4]).
    """
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    check_positive_int("capacity", capacity)
    check_positive_int("buffer_size", buffer_size)
    check_positive_int("max_wait_rounds", max_wait_rounds)
    if lengths.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {lengths.shape}")
    if len(lengths) and (lengths.min() < 1 or lengths.max() > capacity):
        raise ValueError(
            f"every length must be in [1, {capacity}], got range [{lengths.min()}, {lengths.max()}]"
        )
    planner = _WindowPlanner(capacity, buffer_size, max_wait_rounds, seed)
    packs, start = [], 0
    while start < len(lengths):
        end = start + planner.room
        packs += planner.add(list(range(start, min(end, len(lengths)))), lengths[start:end].tolist())
        start = end
    packs += planner.finish()
    sample_order = np.fromiter(itertools.chain.from_iterable(packs), np.int64, len(lengths))
    pack_offsets = np.zeros(len(packs) + 1, np.int64)
    np.cumsum([len(pack) for pack in packs], out=pack_offsets[1:])
    return PackPlan(sample_order, pack_offsets)


def _token_array(row: Mapping[str, Any], name: str, index: int, kinds: str) -> np.ndarray:
    values = np.asarray(row[name])
    if values.ndim != 1 or (values.size and values.dtype.kind not in kinds):
        raise ValueError(
            f"row {index}: {name} must be a 1-D list of integers, got {values.dtype} of shape {values.shape}"
        )
    return values.astype(np.int64, copy=False) if name != "loss_mask" else values != 0


def _row_tokens(row: Any, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``input_ids``, ``labels`` (int64) and ``loss_mask`` (bool or None) of one streamed row."""
    if not isinstance(row, Mapping):
        raise ValueError(f"row {index} must be a mapping with input_ids and labels, got {type(row).__name__}")
    missing = [name for name in ("input_ids", "labels") if name not in row]
    if missing:
        raise ValueError(
            f"row {index} lacks {missing}; rows need input_ids and labels (and optionally loss_mask)"
        )
    ids = _token_array(row, "input_ids", index, "iu")
    if len(ids) == 0:
        raise ValueError(f"row {index} has an empty input_ids; remove empty samples before packing")
    labels = _token_array(row, "labels", index, "iu")
    mask = _token_array(row, "loss_mask", index, "iub") if row.get("loss_mask") is not None else None
    for name, values in (("labels", labels), ("loss_mask", mask)):
        if values is not None and len(values) != len(ids):
            raise ValueError(f"row {index}: {name} has {len(values)} entries but input_ids has {len(ids)}")
    return ids, labels, mask


class StreamPacker:
    """Rows in, packs out, with bounded memory and an exact resumable state.

    ``add(row)`` takes a row with ``input_ids``, ``labels`` and optionally ``loss_mask``;
    ``pop()`` returns the next ready pack (``None`` when none is ready): a dict of numpy arrays
    ``input_ids``, ``labels``, ``position_ids`` ``[S]`` and ``seq_lens``, ``seq_lens_padded``
    ``[D]``, exactly the row :func:`pack_dataset` writes for the same samples (CP padding to
    multiples of ``2 * cp_size``, loss_mask 0 -> label -100). ``finish()`` packs what waits at the
    end of the data. Packs form as :func:`plan_stream` describes.

    Memory: at most ``buffer_size`` waiting samples of at most ``packed_sequence_size`` tokens
    (17 bytes a token), plus the ready packs; popping every ready pack before the next ``add``
    (as :func:`pack_stream` does) keeps those to one round's.
    """

    def __init__(
        self,
        packed_sequence_size: int,
        *,
        buffer_size: int = 1000,
        max_wait_rounds: int = 8,
        cp_size: int = 1,
        padding_idx: int = 0,
        drop_long_samples: bool = True,
        seed: int = 0,
    ):
        _check_arguments(packed_sequence_size, None, padding_idx, drop_long_samples, cp_size, "bfd", seed)
        check_positive_int("buffer_size", buffer_size)
        check_positive_int("max_wait_rounds", max_wait_rounds)
        if seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed}")
        self.config = {"packed_sequence_size": packed_sequence_size, "buffer_size": buffer_size,
                       "max_wait_rounds": max_wait_rounds, "cp_size": cp_size, "padding_idx": padding_idx,
                       "drop_long_samples": drop_long_samples, "seed": seed}  # fmt: skip
        self._size, self._padding_idx, self._drop_long = packed_sequence_size, padding_idx, drop_long_samples
        self._multiple = 2 * cp_size if cp_size > 1 else 1
        self._planner = _WindowPlanner(packed_sequence_size, buffer_size, max_wait_rounds, seed)
        self._waiting: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray | None]] = {}
        self._ready: deque[dict[str, np.ndarray]] = deque()
        self._counts = {"samples": 0, "too_long": 0, "packs": 0, "real_tokens": 0, "padded_tokens": 0}
        self._finished = False

    def add(self, row: Mapping[str, Any]) -> None:
        if self._finished:
            raise ValueError("StreamPacker.add after finish(): start a new StreamPacker for more data")
        index = self._counts["samples"]
        ids, labels, mask = _row_tokens(row, index)
        self._counts["samples"] += 1
        padded = -(-len(ids) // self._multiple) * self._multiple
        if padded > self._size:
            after = (
                f" ({padded} after padding to a multiple of 2*cp_size={self._multiple})"
                if self._multiple > 1
                else ""
            )
            if not self._drop_long:
                raise ValueError(
                    f"row {index} has {len(ids)} tokens{after}, more than packed_sequence_size={self._size}. Increase "
                    "packed_sequence_size, shorten the sample, or set drop_long_samples=True to drop such samples."
                )
            if not self._counts["too_long"]:
                logger.warning("streaming packing drops samples longer than packed_sequence_size=%d%s, first row %d; "
                               "the report counts them", self._size, after, index)  # fmt: skip
            self._counts["too_long"] += 1
            return
        self._waiting[index] = (ids, labels, mask)
        self._lay_out(self._planner.add([index], [padded]))

    def finish(self) -> None:
        """No more rows: pack everything still waiting."""
        self._lay_out(self._planner.finish())
        self._finished = True

    def pop(self) -> dict[str, np.ndarray] | None:
        return self._ready.popleft() if self._ready else None

    @property
    def num_ready(self) -> int:
        return len(self._ready)

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def report(self) -> PackingReport:
        """Counts so far; the lower bound is over the samples already in packs."""
        c = self._counts
        return PackingReport(
            algorithm=f"stream, buffer {self.config['buffer_size']}",
            packed_sequence_size=self._size,
            num_samples=c["samples"],
            num_too_long=c["too_long"],
            num_over_max_packs=0,
            num_packs=c["packs"],
            lower_bound=-(-c["padded_tokens"] // self._size),
            real_tokens=c["real_tokens"],
        )

    def _lay_out(self, packs: list[list[int]]) -> None:
        """Lay out ``packs`` (lists of sample keys) with pack_dataset's kernel, all in one call."""
        if not packs:
            return
        samples = [self._waiting.pop(key) for pack in packs for key in pack]
        lengths = np.array([len(ids) for ids, _, _ in samples], np.int64)
        padded = -(-lengths // self._multiple) * self._multiple
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        ids = np.concatenate([ids for ids, _, _ in samples])
        labels = np.concatenate([labels for _, labels, _ in samples])
        has_mask = any(mask is not None for _, _, mask in samples)
        mask = (np.concatenate([m if m is not None else np.ones(len(i), np.bool_) for i, _, m in samples])
                if has_mask else np.ones(1, np.bool_))  # fmt: skip
        offsets = np.zeros(len(packs) + 1, np.int64)
        np.cumsum([len(pack) for pack in packs], out=offsets[1:])
        token_dtype = np.int32 if _fits_int32(ids) and _fits_int32(labels) else np.int64
        out_ids, out_labels = (np.empty((len(packs), self._size), token_dtype) for _ in range(2))
        out_positions = np.empty((len(packs), self._size), np.int32)
        _fill_packs(
            0, len(packs), offsets, np.arange(len(samples)), lengths, padded, ids, starts, labels, starts, mask,
            starts if has_mask else np.zeros(len(samples), np.int64), has_mask, self._size, self._padding_idx,
            CROSS_ENTROPY_IGNORE_INDEX, out_ids.reshape(-1), out_labels.reshape(-1), out_positions.reshape(-1),
        )  # fmt: skip
        seq_lens_padded = padded.astype(np.int32)
        tails = self._size - np.add.reduceat(padded, offsets[:-1])
        seq_lens_padded[offsets[1:] - 1] += tails.astype(np.int32)  # tail padding joins the last sample
        for p in range(len(packs)):
            a, b = offsets[p], offsets[p + 1]
            self._ready.append({
                "input_ids": out_ids[p], "labels": out_labels[p], "position_ids": out_positions[p],
                "seq_lens": lengths[a:b].astype(np.int32), "seq_lens_padded": seq_lens_padded[a:b],
            })  # fmt: skip
        self._counts["packs"] += len(packs)
        self._counts["real_tokens"] += int(lengths.sum())
        self._counts["padded_tokens"] += int(padded.sum())

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: the planner, the waiting samples' tokens, the
        ready packs and the counters (numpy arrays; ``torch.save`` handles them)."""
        keys = self._planner.keys
        waiting = [self._waiting[key] for key in keys]
        ready = list(self._ready)
        return {
            "config": dict(self.config),
            "planner": self._planner.state_dict(),
            "waiting": {
                "input_ids": _concat([ids for ids, _, _ in waiting], np.int64),
                "labels": _concat([lab for _, lab, _ in waiting], np.int64),
                "loss_mask": _concat(
                    [m if m is not None else np.ones(len(i), np.bool_) for i, _, m in waiting], bool
                ),
                "has_loss_mask": np.array([m is not None for _, _, m in waiting], np.bool_),
                "lengths": np.array([len(ids) for ids, _, _ in waiting], np.int64),
            },
            "ready": {key: _concat([pack[key] for pack in ready], np.int32) for key in PACK_KEYS}
            | {"num_docs": np.array([len(pack["seq_lens"]) for pack in ready], np.int64)},
            "counts": dict(self._counts),
            "finished": self._finished,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state["config"] != self.config:
            raise ValueError(
                f"the saved stream was packed with {state['config']}, this packer has {self.config}; resume with the "
                "same packing parameters (or start the data stream afresh)"
            )
        self._planner.load_state_dict(state["planner"])
        waiting = state["waiting"]
        bounds = np.concatenate([[0], np.cumsum(waiting["lengths"])])
        self._waiting = {
            key: (
                waiting["input_ids"][a:b],
                waiting["labels"][a:b],
                waiting["loss_mask"][a:b] if has else None,
            )
            for key, a, b, has in zip(self._planner.keys, bounds[:-1], bounds[1:], waiting["has_loss_mask"])
        }
        ready = state["ready"]
        docs = np.concatenate([[0], np.cumsum(ready["num_docs"])])
        self._ready = deque(
            {**{k: ready[k][p * self._size : (p + 1) * self._size] for k in PACK_KEYS[:3]},
             **{k: ready[k][docs[p] : docs[p + 1]] for k in PACK_KEYS[3:]}}
            for p in range(len(ready["num_docs"]))
        )  # fmt: skip
        self._counts = dict(state["counts"])
        self._finished = state["finished"]


def _concat(arrays: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype)


def pack_stream(
    rows: Iterable[Mapping[str, Any]],
    packed_sequence_size: int,
    *,
    buffer_size: int = 1000,
    max_wait_rounds: int = 8,
    cp_size: int = 1,
    padding_idx: int = 0,
    drop_long_samples: bool = True,
    seed: int = 0,
) -> Iterator[dict[str, np.ndarray]]:
    """Pack ``rows`` (a ``datasets.IterableDataset``, a generator, any iterable of dicts with
    ``input_ids``, ``labels``, optional ``loss_mask``) on the fly; see :class:`StreamPacker`.

    Yields packs (dicts of numpy arrays) in :func:`pack_dataset`'s row contract while reading.
    With ``buffer_size`` above the number of rows the packs equal ``pack_dataset(...,
    algorithm="bfd", seed=seed)``, rows for rows.

    Example (S=16, cp_size=2, rows [1 2 3] and [4 5 6 7 8])::

        input_ids       [1 2 3 0 4 5 6 7 8 0 0 0 0 0 0 0]
        position_ids    [0 1 2 3 0 1 2 3 4 5 6 7 8 9 10 11]
        seq_lens        [3 5]
        seq_lens_padded [4 12]
    """
    packer = StreamPacker(
        packed_sequence_size,
        buffer_size=buffer_size,
        max_wait_rounds=max_wait_rounds,
        cp_size=cp_size,
        padding_idx=padding_idx,
        drop_long_samples=drop_long_samples,
        seed=seed,
    )  # validates the arguments now, not at the first next()

    def packs() -> Iterator[dict[str, np.ndarray]]:
        for row in rows:
            packer.add(row)
            while packer.num_ready:
                yield packer.pop()
        packer.finish()
        while packer.num_ready:
            yield packer.pop()
        logger.info("pack_stream: %s", packer.report)

    return packs()


# --- sources: where one DP rank's rows come from, with a resumable position -------------------


class _DatasetRows:
    """A map-style ``datasets.Dataset``: pass ``p`` reads a permutation seeded by ``(seed, p)`` (or
    dataset order), dealt to the DP ranks by :func:`_deal`. Lengths are known, so every rank can
    plan every rank's packs. Position: rows this rank has read in the pass."""

    def __init__(self, dataset: datasets.Dataset, env: LoaderEnv, shuffle: bool):
        names = [c for c in ("input_ids", "labels", "loss_mask") if c in dataset.column_names]
        if names[:2] != ["input_ids", "labels"]:
            raise ValueError(f"the dataset needs input_ids and labels columns (and optionally loss_mask), found "
                             f"{dataset.column_names}")  # fmt: skip
        self.rows = dataset.select_columns(names).with_format("arrow")
        self.names, self.env, self.shuffle = names, env, shuffle
        self.lengths = np.asarray(pc.list_value_length(self.rows[:]["input_ids"]), dtype=np.int64)
        self._pass: tuple[int, np.ndarray, np.ndarray] | None = None  # pass index, order, owner rank
        self._read = 0

    def indices(self, pass_index: int, dp_rank: int) -> np.ndarray:
        if self._pass is None or self._pass[0] != pass_index:
            n = len(self.lengths)
            rng = np.random.default_rng(_mix(self.env.seed, pass_index))
            order = rng.permutation(n) if self.shuffle else np.arange(n)
            self._pass = (pass_index, order, _deal(self.lengths[order], self.env.dp_size))
        _, order, owner = self._pass
        return order[owner == dp_rank]

    def open(self, pass_index: int, position: int | None) -> Iterator[dict[str, np.ndarray]]:
        indices = self.indices(pass_index, self.env.dp_rank)
        self._read = position or 0
        for start in range(self._read, len(indices), _ROWS_PER_READ):
            table = self.rows[indices[start : start + _ROWS_PER_READ]]
            columns = {name: _list_column(table, name) for name in self.names}
            for i in range(table.num_rows):
                row = {
                    name: values[starts[i] : starts[i] + lengths[i]]
                    for name, (values, starts, lengths) in columns.items()
                }
                self._read += 1
                yield row

    def position(self) -> int:
        return self._read


@numba.njit(cache=True)
def _deal(lengths, num_ranks):
    """Owner rank of each sample (in reading order): each run of ``num_ranks`` samples gives one to
    every rank, the longest to the rank with the fewest tokens so far. Ranks end with equal sample
    counts (+-1) and token totals within one sample's length, so their pack counts nearly agree.

    Example (2 ranks, lengths [5 1 2 9 4 4]): [5 1] -> r0 5, r1 1; [2 9] -> r1 9, r0 2;
    [4 4] -> r0 4 (7 tokens < 10), r1 4: owners [0 1 0 1 0 1], totals 11 and 14.
    """
    owner = np.empty(len(lengths), np.int64)
    totals = np.zeros(num_ranks, np.int64)
    for start in range(0, len(lengths), num_ranks):
        run = lengths[start : start + num_ranks]
        by_length = np.argsort(-run, kind="mergesort")
        by_total = np.argsort(totals, kind="mergesort")
        for j in range(len(run)):
            owner[start + by_length[j]] = by_total[j]
            totals[by_total[j]] += run[by_length[j]]
    return owner


class _IterableRows:
    """A ``datasets.IterableDataset`` (split with ``split_dataset_by_node``; pass ``p`` calls
    ``set_epoch(p)``; position: its own ``state_dict``) or any other iterable (rank ``r`` of ``W``
    takes rows ``r, r+W, ...``; position: rows taken, skipped over on resume; an iterable that
    starts over on every ``iter()``, a list or a dataset say, resumes exactly)."""

    def __init__(self, rows: Iterable, env: LoaderEnv):
        self.env = env
        self.hf = (
            split_dataset_by_node(rows, env.dp_rank, env.dp_size)
            if isinstance(rows, datasets.IterableDataset)
            else None
        )
        self.rows = rows
        self._taken = 0

    def open(self, pass_index: int, position: Any) -> Iterator[Any]:
        if self.hf is not None:
            self.hf.set_epoch(pass_index)  # the saved state applies to its own epoch only
            if position is not None:
                self.hf.load_state_dict(position)
            return iter(self.hf)
        iterator = iter(self.rows)
        if position and iterator is self.rows:
            raise ValueError(
                "cannot resume a one-shot iterator (a generator): give an iterable that starts over on every iter() "
                "(a list, a datasets.IterableDataset, a class whose __iter__ calls the generator function)"
            )
        self._taken = position or 0
        return self._take(
            itertools.islice(
                iterator, self.env.dp_rank + self._taken * self.env.dp_size, None, self.env.dp_size
            )
        )

    def _take(self, rows: Iterator[Any]) -> Iterator[Any]:
        for row in rows:
            self._taken += 1
            yield row

    def position(self) -> Any:
        return self.hf.state_dict() if self.hf is not None else self._taken


class _PackedStream(torch.utils.data.IterableDataset):
    """This DP rank's packs, epoch after epoch; ``state_dict`` is the exact position (torchdata's
    Stateful protocol, so ``StatefulDataLoader`` saves it with the loader).

    Without ``steps_per_epoch`` an epoch is one pass over a map-style dataset; every rank plans
    every rank's packs from the lengths and takes the smallest count (no communication). With it,
    the data is read pass after pass without a break and an epoch is ``steps_per_epoch``
    micro-batches.
    """

    def __init__(self, mode: StreamingPackedBatching, source: _DatasetRows | _IterableRows, env: LoaderEnv):
        self.mode, self.source, self.env = mode, source, env
        self.epoch = -1
        self.set_epoch(0)

    def _new_packer(self, seed: int) -> StreamPacker:
        m = self.mode
        return StreamPacker(
            m.packed_sequence_size,
            buffer_size=m.buffer_size,
            max_wait_rounds=m.max_wait_rounds,
            cp_size=m.cp_size,
            padding_idx=self.env.padding_idx,
            drop_long_samples=m.drop_long_samples,
            seed=seed,
        )

    def _packer_seed(self, epoch: int) -> int:
        return _mix(self.env.seed, epoch) if self.mode.steps_per_epoch is None else self.env.seed

    def set_epoch(self, epoch: int) -> None:
        if epoch == self.epoch:
            return
        first = self.epoch < 0
        self.epoch, self.taken = epoch, 0
        if self.mode.steps_per_epoch is None:
            self.epoch_packs = self._agreed_packs(epoch)
        else:
            self.epoch_packs = self.mode.steps_per_epoch * self.mode.micro_batch_size
        if first or self.mode.steps_per_epoch is None:  # otherwise reading and packing go on
            self.pass_index, self.rows_in_pass, self.position = epoch, 0, None
            self.packer = self._new_packer(self._packer_seed(epoch))
            self._rows: Iterator | None = None

    def _agreed_packs(self, epoch: int) -> int:
        """Packs per rank this epoch: the fewest any DP rank forms, in whole micro-batches."""
        m, source = self.mode, self.source
        multiple = 2 * m.cp_size if m.cp_size > 1 else 1
        empty = np.flatnonzero(source.lengths == 0)
        if len(empty):
            raise ValueError(f"sample {empty[0]} has an empty input_ids; remove empty samples before packing")
        counts = []
        for rank in range(self.env.dp_size):
            lengths = source.lengths[source.indices(epoch, rank)]
            padded = -(-lengths // multiple) * multiple
            if not m.drop_long_samples and (padded > m.packed_sequence_size).any():
                i = int(source.indices(epoch, rank)[np.argmax(padded > m.packed_sequence_size)])
                raise ValueError(
                    f"sample {i} has {source.lengths[i]} tokens, more than packed_sequence_size={m.packed_sequence_size} "
                    f"after padding to a multiple of {multiple}; increase packed_sequence_size or set "
                    "drop_long_samples=True"
                )
            fits = padded[padded <= m.packed_sequence_size]
            plan = plan_stream(fits, m.packed_sequence_size, m.buffer_size, max_wait_rounds=m.max_wait_rounds,
                               seed=self._packer_seed(epoch))  # fmt: skip
            counts.append(plan.num_packs)
        agreed = min(counts) // m.micro_batch_size * m.micro_batch_size
        logger.info(
            "streaming packing, epoch %d: %d micro-batches of %d packs per DP rank (packs each rank forms: %s; the "
            "rest are left out)",
            epoch,
            agreed // m.micro_batch_size,
            m.micro_batch_size,
            counts,
        )
        return agreed

    def __len__(self) -> int:
        return self.epoch_packs

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        while self.taken < self.epoch_packs:
            pack = self._next_pack()
            self.taken += 1
            yield pack

    def _next_pack(self) -> dict[str, np.ndarray]:
        while (pack := self.packer.pop()) is None:
            if self._rows is None:
                self._rows = self.source.open(self.pass_index, self.position)
            row = next(self._rows, None)
            if row is not None:
                self.packer.add(row)
                self.rows_in_pass += 1
            elif self.mode.steps_per_epoch is None:
                if self.packer.finished:
                    raise RuntimeError(
                        f"DP rank {self.env.dp_rank} formed fewer packs in epoch {self.epoch} than the {self.epoch_packs} "
                        "planned from the lengths: the dataset changed while training?"
                    )
                self.packer.finish()
            else:  # next pass, no break in the packing
                if self.rows_in_pass == 0:
                    raise ValueError(
                        f"DP rank {self.env.dp_rank} of {self.env.dp_size} got no rows in pass {self.pass_index}: its "
                        "share of the data is empty; use more data or fewer ranks"
                    )
                self.pass_index += 1
                self.rows_in_pass, self.position, self._rows = 0, None, None
        return pack

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch, "taken": self.taken, "epoch_packs": self.epoch_packs, "pass_index": self.pass_index,
            "rows_in_pass": self.rows_in_pass,
            "position": self.source.position() if self._rows is not None else self.position,
            "packer": self.packer.state_dict(),
        }  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.epoch, self.taken, self.epoch_packs = state["epoch"], state["taken"], state["epoch_packs"]
        self.pass_index, self.rows_in_pass = state["pass_index"], state["rows_in_pass"]
        self.position = state["position"]
        self.packer = self._new_packer(self._packer_seed(self.epoch))
        self.packer.load_state_dict(state["packer"])
        self._rows = None


@dataclass
class StreamingPackedBatching:
    """``packing: streaming``: packs formed while reading, ``micro_batch_size`` packs of
    ``packed_sequence_size`` tokens per micro-batch; memory bounded by ``buffer_size`` samples.

    ``build`` takes a map-style ``datasets.Dataset`` (what the recipe's data section gives), a
    ``datasets.IterableDataset`` or any iterable of rows. Each DP rank reads its own share (a
    length-balanced deal of a per-epoch permutation; ``split_dataset_by_node``; every W-th row). The
    ranks of one CP group read the same share and form the same packs.

    Every DP rank must take the same number of micro-batches per epoch. Without
    ``steps_per_epoch`` an epoch is one pass over a map-style dataset, and the count is the fewest
    packs any rank forms, which every rank computes alone from the lengths (the packing plan
    depends on lengths only). A stream's length is unknown, so it needs ``steps_per_epoch``:
    then every rank reads its share pass after pass (``set_epoch`` per pass) and an epoch is
    ``steps_per_epoch`` micro-batches.
    """

    packed_sequence_size: int = 2048
    micro_batch_size: int = 1
    cp_size: int = 1
    buffer_size: int = 1000
    max_wait_rounds: int = 8
    drop_long_samples: bool = True
    shuffle: bool = True
    steps_per_epoch: int | None = None

    def __post_init__(self) -> None:
        for name in ("packed_sequence_size", "micro_batch_size", "cp_size", "buffer_size", "max_wait_rounds"):
            check_positive_int(name, getattr(self, name))
        if self.steps_per_epoch is not None:
            check_positive_int("steps_per_epoch", self.steps_per_epoch)
        if self.cp_size > 1 and self.packed_sequence_size % (2 * self.cp_size):
            raise ValueError(
                f"packed_sequence_size={self.packed_sequence_size} must be a multiple of 2*cp_size={2 * self.cp_size}"
            )

    def build(
        self, dataset: datasets.Dataset | Iterable[Mapping[str, Any]], env: LoaderEnv
    ) -> MicroBatchStream:
        if isinstance(dataset, (datasets.DatasetDict, datasets.IterableDatasetDict)):
            raise ValueError(
                f"give one split of the DatasetDict (splits: {list(dataset)}), e.g. dataset['train']"
            )
        if isinstance(dataset, datasets.Dataset):
            source: _DatasetRows | _IterableRows = _DatasetRows(dataset, env, self.shuffle)
        elif isinstance(dataset, Iterable) and not isinstance(dataset, (str, bytes, Mapping)):
            if self.steps_per_epoch is None:
                raise ValueError(
                    f"packing.steps_per_epoch must be set to stream a {type(dataset).__name__}: its length is unknown, "
                    "and every DP rank must take the same number of micro-batches per epoch"
                )
            source = _IterableRows(dataset, env)
        else:
            raise ValueError(
                f"dataset must be a datasets.Dataset, IterableDataset or iterable of rows, got {type(dataset).__name__}"
            )
        packs = _PackedStream(self, source, env)
        loader = StatefulDataLoader(packs, batch_size=self.micro_batch_size, collate_fn=packed_sequence_thd_collater,
                                    drop_last=True)  # fmt: skip
        return MicroBatchStream(loader, packs.set_epoch)
