"""``packing: streaming``: packs formed while reading an iterable source, memory bounded by a window.

For data too large to plan up front: a ``datasets.IterableDataset`` or any iterable of rows
(``input_ids``, ``labels``, optional ``loss_mask``). Each DP rank reads its own share
(``split_dataset_by_node``, or every ``dp``-th row of a plain iterable); the ranks of a CP group
read the same share. Packs form by best-fit decreasing over a window of ``buffer_size`` waiting
samples and are laid out by :func:`automodel.data.collate.build_row` (the rows ``pack_dataset``
writes). A stream's length is unknown, so an epoch is ``steps_per_epoch`` micro-batches per rank;
the source is read pass after pass within an epoch, and every epoch starts the source over
(reshuffled through ``set_epoch`` when ``shuffle``). The state is the global position
``{epoch, consumed, fingerprint}``; resuming replays the epoch's packing up to it (exact, and
nothing but the position is saved), on the same DP size (each rank's share depends on it).

Memory: at most ``buffer_size`` waiting samples plus the packs of one round.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import datasets
import numpy as np
import torch
from datasets.distributed import split_dataset_by_node
from torchdata.stateful_dataloader import StatefulDataLoader

from automodel.data.batching import LoaderEnv, PackedBatching, _fingerprint, _Position, check_pack_alignment
from automodel.data.collate import build_row, cp_padded, packed_sequence_thd_collater
from automodel.data.packing import keep_fitting
from automodel.data.planning import check_positive_int, plan_packs
from automodel.errors import DataError
from automodel.loss import CROSS_ENTROPY_IGNORE_INDEX

logger = logging.getLogger(__name__)


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
        self.samples: list[Mapping[str, Any]] = []  # waiting samples, in arrival order
        self.lengths: list[int] = []
        self.first_round: list[int] = []  # the first round each waiting sample takes part in
        self.rounds = 0

    def add(self, samples: list[Mapping[str, Any]], lengths: list[int]) -> list[list[Mapping[str, Any]]]:
        """Queue samples (no more than the buffer has room for) of the given (padded) lengths; returns
        the packs (lists of samples) of the round this triggers, if it does."""
        self.samples += samples
        self.lengths += lengths
        self.first_round += [self.rounds] * len(samples)
        return self._round() if len(self.samples) >= self.buffer_size else []

    def _round(self) -> list[list[Mapping[str, Any]]]:
        lengths = np.asarray(self.lengths, np.int64)
        plan = plan_packs(lengths, self.capacity, "bfd", self.seed + self.rounds)
        starts = plan.pack_offsets[:-1]
        members = np.diff(plan.pack_offsets)
        used = np.add.reduceat(lengths[plan.sample_order], starts)
        waited = self.rounds + 1 - np.asarray(self.first_round)[plan.sample_order]
        emit = (used == self.capacity) | np.logical_or.reduceat(waited >= self.max_wait_rounds, starts)
        missing = (len(lengths) + 1) // 2 - int(members[emit].sum())
        if missing > 0:  # progress: at least half leave, the fullest packs first
            candidates = np.argsort(-used, kind="stable")
            candidates = candidates[~emit[candidates]]
            emit[candidates[: np.searchsorted(np.cumsum(members[candidates]), missing) + 1]] = True
        self.rounds += 1
        order = plan.sample_order
        packs = [
            [self.samples[i] for i in order[starts[p] : starts[p] + members[p]]] for p in np.flatnonzero(emit)
        ]
        stays = np.empty(len(lengths), np.bool_)
        stays[plan.sample_order] = ~np.repeat(emit, members)
        self.samples = [sample for sample, stay in zip(self.samples, stays) if stay]
        self.lengths = lengths[stays].tolist()
        self.first_round = np.asarray(self.first_round)[stays].tolist()
        return packs


class _EpochPacks(torch.utils.data.IterableDataset):
    """This rank's packs of one epoch, without end (the source is read pass after pass)."""

    def __init__(self, mode: StreamingPackedBatching, rows: Iterable, env: LoaderEnv, epoch: int):
        self.mode, self.rows, self.env, self.epoch = mode, rows, env, epoch

    def _rank_rows(self, pass_index: int) -> Iterator[Mapping[str, Any]]:
        if isinstance(self.rows, datasets.IterableDataset):
            rows = self.rows.shuffle(seed=self.env.seed, buffer_size=1000) if self.mode.shuffle else self.rows
            rows = split_dataset_by_node(rows, self.env.dp_rank, self.env.dp_size)
            rows.set_epoch(self.epoch * 1_000_000 + pass_index)
            return iter(rows)
        iterator = iter(self.rows)
        if pass_index and iterator is self.rows:
            raise ValueError("dataset: a one-shot iterator (a generator) cannot be read again; give an iterable "
                             "that starts over on every iter() (a list, a datasets.IterableDataset)")  # fmt: skip
        return itertools.islice(iterator, self.env.dp_rank, None, self.env.dp_size)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        m, env = self.mode, self.env
        seed = int(np.random.SeedSequence([env.seed, self.epoch]).generate_state(1)[0])
        planner = _WindowPlanner(m.packed_sequence_size, m.buffer_size, m.max_wait_rounds, seed)
        for pass_index in itertools.count():
            rows = self._rank_rows(pass_index)
            read = fitting = 0
            while chunk := list(itertools.islice(rows, m.buffer_size - len(planner.samples))):
                read += len(chunk)
                padded = cp_padded(np.array([len(row["input_ids"]) for row in chunk], np.int64), env.cp_size)
                fits = np.flatnonzero(keep_fitting("packing.packed_sequence_size", padded, m.packed_sequence_size,
                                                   m.drop_long_samples, env.cp_size, whole=False))  # fmt: skip
                fitting += len(fits)
                for pack in planner.add([chunk[i] for i in fits], padded[fits].tolist()):
                    yield build_row(pack, env.padding_idx, env.cp_size, m.packed_sequence_size)
            if read == 0:
                raise ValueError(
                    f"dataset: DP rank {env.dp_rank} of {env.dp_size} got no rows; use more data or fewer ranks"
                )
            if fitting == 0:  # a pass with nothing to pack: the next one would read the same, forever
                raise DataError(
                    f"no sample fits packing.packed_sequence_size={m.packed_sequence_size}: all {read} rows of a pass "
                    f"over the data are longer; raise it, or cut samples with data.max_length (at most "
                    f"{m.packed_sequence_size})"
                )


class StreamedMicroBatches(_Position):
    """The streaming counterpart of :class:`~automodel.data.batching.MicroBatchStream` (same interface)."""

    def __init__(self, mode: StreamingPackedBatching, rows: Iterable, env: LoaderEnv, fingerprint: str):
        self.mode, self.rows, self.env, self.fingerprint = mode, rows, env, fingerprint
        self.batches_per_epoch = mode.steps_per_epoch

    def __next__(self) -> dict[str, Any]:
        if self.taken + self.start // self.env.dp_size == self.batches_per_epoch:
            self.epoch, self.start, self.taken, self._iterator = self.epoch + 1, 0, 0, None
        if self._iterator is None:
            packs = _EpochPacks(self.mode, self.rows, self.env, self.epoch)
            loader = StatefulDataLoader(packs, batch_size=self.mode.micro_batch_size,
                                        collate_fn=packed_sequence_thd_collater)  # fmt: skip
            self._iterator = itertools.islice(
                iter(loader), self.start // self.env.dp_size, None
            )  # replay to the position
        self.taken += 1
        return next(self._iterator)

    def epoch_tokens(self, epoch: int = 0) -> tuple[int, int]:
        """``(real tokens, label tokens)`` that all DP ranks together train in ``epoch``, by packing it."""
        real = learned = 0
        for rank in range(self.env.dp_size):
            packs = _EpochPacks(self.mode, self.rows, dataclasses.replace(self.env, dp_rank=rank), epoch)
            for pack in itertools.islice(packs, self.batches_per_epoch * self.mode.micro_batch_size):
                real += int(pack["seq_lens"].sum())
                learned += int((pack["labels"] != CROSS_ENTROPY_IGNORE_INDEX).sum())
        return real, learned


@dataclass
class StreamingPackedBatching:
    """``packing: streaming``: ``micro_batch_size`` packs of ``packed_sequence_size`` tokens per
    micro-batch, formed while reading; ``steps_per_epoch`` micro-batches per rank and epoch."""

    packed_sequence_size: int = 2048
    micro_batch_size: int = 1
    steps_per_epoch: int = 100
    buffer_size: int = 1000
    max_wait_rounds: int = 8
    drop_long_samples: bool = True
    shuffle: bool = True

    def __post_init__(self) -> None:
        for name in (
            "packed_sequence_size",
            "micro_batch_size",
            "steps_per_epoch",
            "buffer_size",
            "max_wait_rounds",
        ):
            check_positive_int(f"packing.{name}", getattr(self, name))

    def check_run(self, env: LoaderEnv) -> None:
        check_pack_alignment(self.packed_sequence_size, env.cp_size)

    def micro_batch(self) -> tuple[str, int | None]:
        """What one micro-batch holds, and the most tokens it can hold (the ``global batch`` log line)."""
        packs = f"{self.micro_batch_size} pack" + ("s" if self.micro_batch_size > 1 else "")
        return (
            f"{packs} of up to {self.packed_sequence_size:,} tokens",
            self.micro_batch_size * self.packed_sequence_size,
        )

    def length_bounds(self, max_sample: int | None, cp_size: int) -> tuple[int | None, int | None]:
        """Samples up to the pack size; ``micro_batch_size`` packs in one micro-batch."""
        longest = (
            self.packed_sequence_size if max_sample is None else min(max_sample, self.packed_sequence_size)
        )
        return longest, self.micro_batch_size * self.packed_sequence_size

    def build(self, dataset: Iterable[Mapping[str, Any]], env: LoaderEnv) -> StreamedMicroBatches:
        self.check_run(env)
        if isinstance(dataset, datasets.Dataset):
            dataset = dataset.to_iterable_dataset()
        if not isinstance(dataset, Iterable) or isinstance(dataset, (str, bytes, Mapping)):
            raise ValueError(
                f"dataset: give a datasets.IterableDataset or an iterable of rows, got {type(dataset).__name__}"
            )
        fingerprint = _fingerprint(type(self).__name__, asdict(self), env.seed, env.cp_size, env.dp_size)
        return StreamedMicroBatches(self, dataset, env, fingerprint)

    def build_eval(self, dataset: datasets.Dataset, env: LoaderEnv) -> Sequence[dict[str, Any]]:
        """One unshuffled pass over a validation set (map-style: the tokenized ``data.validation`` or
        ``val_fraction``), packed whole into packs of the same size as ``packing: bfd`` evaluates;
        the loss is a token mean, so how the samples are packed does not change it."""
        return PackedBatching(
            packed_sequence_size=self.packed_sequence_size,
            micro_batch_size=self.micro_batch_size,
            drop_long_samples=self.drop_long_samples,
            shuffle=False,
        ).build_eval(dataset, env)
