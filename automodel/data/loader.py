"""Batching modes: a tokenized dataset -> an endless, resumable stream of collated micro-batches.

A batching mode is the ``packing`` section of a recipe. ``build(dataset, env)`` returns a
:class:`MicroBatchStream` of batches in the collater contract (``input_ids``, ``labels``,
``position_ids`` ``[B, S]``; ``seq_lens``, ``seq_lens_padded`` ``[B, D]``) that flows through
``make_cp_batch_for_te``. Every DP rank gets disjoint data and the same number of micro-batches per
epoch; the ranks of one CP group get the same micro-batches.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from automodel.data.collate import packed_sequence_thd_collater, padded_sequence_thd_collater
from automodel.data.pack_cache import cached_pack_dataset
from automodel.data.packing import pack_dataset
from automodel.data.planning import PACKING_ALGORITHMS

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoaderEnv:
    """What a batching mode needs to know about the run."""

    dp_rank: int = 0
    dp_size: int = 1
    seed: int = 0
    padding_idx: int = 0


class MicroBatchStream:
    """Micro-batches over epochs without end; ``state_dict`` resumes mid-epoch exactly.

    Wraps a ``StatefulDataLoader``; ``set_epoch(e)`` reseeds the epoch's order (e.g. a sampler's).
    """

    def __init__(self, loader: StatefulDataLoader, set_epoch: Callable[[int], None]):
        if len(loader) == 0:
            raise ValueError(
                "the data gives 0 micro-batches per data-parallel rank: use more data, a smaller "
                "micro_batch_size, or fewer ranks"
            )
        self.loader = loader
        self.set_epoch = set_epoch
        self.epoch = 0
        self._iterator: Iterator | None = None

    @property
    def batches_per_epoch(self) -> int:
        return len(self.loader)

    def __iter__(self) -> MicroBatchStream:
        return self

    def __next__(self) -> dict[str, Any]:
        if self._iterator is None:
            self.set_epoch(self.epoch)
            self._iterator = iter(self.loader)
        try:
            return next(self._iterator)
        except StopIteration:
            self.epoch += 1
            self.set_epoch(self.epoch)
            self._iterator = iter(self.loader)
        try:
            return next(self._iterator)
        except StopIteration:  # modes that plan per epoch can come up empty on tiny data
            raise ValueError(
                f"epoch {self.epoch} gives 0 micro-batches on this data-parallel rank: use more data, "
                "smaller micro-batches, or fewer ranks"
            ) from None

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = state["epoch"]
        self.loader.load_state_dict(state["loader"])
        self._iterator = None


def distributed_stream(
    dataset, collate_fn: Callable, micro_batch_size: int, env: LoaderEnv, *, shuffle: bool = True, num_workers: int = 0
) -> MicroBatchStream:
    """Rows of ``dataset`` split across DP ranks (equal counts: the remainder is dropped), shuffled
    per epoch with ``env.seed``, ``micro_batch_size`` rows per micro-batch."""
    sampler = DistributedSampler(
        dataset, num_replicas=env.dp_size, rank=env.dp_rank, shuffle=shuffle, seed=env.seed, drop_last=True
    )
    loader = StatefulDataLoader(
        dataset, batch_size=micro_batch_size, sampler=sampler, collate_fn=collate_fn, drop_last=True,
        num_workers=num_workers,
    )
    return MicroBatchStream(loader, sampler.set_epoch)


def check_positive_int(name: str, value: Any) -> None:
    """ValueError unless ``value`` is an int >= 1 (bools rejected); shared by the batching modes."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass
class PackedBatching:
    """``packing: bfd | sequential``: :func:`pack_dataset` once, then ``micro_batch_size`` packs of
    ``packed_sequence_size`` tokens per micro-batch.

    ``cp_size`` pads every sample to a multiple of ``2 * cp_size`` (set it to the run's CP size; the
    recipes interpolate ``${parallel.cp_size}``). With ``cache_dir`` the packs come from
    :func:`cached_pack_dataset`: local rank 0 packs and writes them once, every rank memory-maps them.
    """

    algorithm: str = "bfd"
    packed_sequence_size: int = 2048
    micro_batch_size: int = 1
    cp_size: int = 1
    drop_long_samples: bool = True
    max_packs: int | None = None
    shuffle: bool = True
    num_workers: int = 0
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if self.algorithm not in PACKING_ALGORITHMS:
            raise ValueError(f"algorithm must be one of {PACKING_ALGORITHMS}, got {self.algorithm!r}")
        for name in ("packed_sequence_size", "micro_batch_size", "cp_size"):
            check_positive_int(name, getattr(self, name))
        if self.cp_size > 1 and self.packed_sequence_size % (2 * self.cp_size):
            raise ValueError(
                f"packed_sequence_size={self.packed_sequence_size} must be a multiple of 2*cp_size={2 * self.cp_size}"
            )

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch_size * self.packed_sequence_size

    def build(self, dataset: datasets.Dataset, env: LoaderEnv) -> MicroBatchStream:
        pack = functools.partial(cached_pack_dataset, cache_dir=self.cache_dir) if self.cache_dir else pack_dataset
        packed = pack(
            dataset, "train", self.packed_sequence_size, self.max_packs, env.padding_idx,
            self.drop_long_samples, self.cp_size, algorithm=self.algorithm, seed=env.seed,
        )
        return distributed_stream(
            packed.with_format("numpy"), packed_sequence_thd_collater, self.micro_batch_size, env,
            shuffle=self.shuffle, num_workers=self.num_workers,
        )


@dataclass
class PaddedBatching:
    """``packing: none``: classic padded batches, the baseline that packing is measured against.

    ``micro_batch_size`` samples per micro-batch, each padded at its end to the longest sample of
    the micro-batch (rounded up to a multiple of ``2 * cp_size``). Samples longer than
    ``max_length`` are dropped and reported.
    """

    micro_batch_size: int = 8
    max_length: int = 2048
    cp_size: int = 1
    shuffle: bool = True
    num_workers: int = 0

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "max_length", "cp_size"):
            check_positive_int(name, getattr(self, name))

    def build(self, dataset: datasets.Dataset, env: LoaderEnv) -> MicroBatchStream:
        lengths = np.asarray(dataset.with_format("arrow")[:]["input_ids"].combine_chunks().value_lengths())
        too_long = np.flatnonzero(lengths > self.max_length)
        if len(too_long):
            logger.warning(
                "packing none: dropped %d of %d samples (%.3f%%) longer than max_length=%d",
                len(too_long), len(lengths), 100 * len(too_long) / len(lengths), self.max_length,
            )
            dataset = dataset.select(np.flatnonzero(lengths <= self.max_length))
        collate = functools.partial(
            padded_sequence_thd_collater, padding_idx=env.padding_idx,
            pad_to_multiple_of=2 * self.cp_size if self.cp_size > 1 else 1,
        )
        return distributed_stream(
            dataset.with_format("numpy"), collate, self.micro_batch_size, env,
            shuffle=self.shuffle, num_workers=self.num_workers,
        )
