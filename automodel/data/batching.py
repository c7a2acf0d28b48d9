"""Batching modes on one epoch engine: a tokenized dataset -> a resumable stream of micro-batches.

A batching mode is the ``packing`` section of a recipe: its checks plus ``prepare(dataset, env)``,
which gives the kept units (samples, or packs), ``plan(order) -> PackPlan`` (which units form
which micro-batch of an epoch, from a unit order) and ``collate(units) -> batch``. The engine does
the rest, once for every mode:

- one seeded RNG per epoch, ``(seed, epoch)``, shuffles the kept units (unless ``shuffle: false``);
- the epoch's M global micro-batches are dealt round-robin: DP rank r takes ``k * dp + r``; the
  last ``M % dp`` are not dealt, and the log says how many micro-batches and units that is;
- the ranks of one CP group share ``dp_rank``, so they get the same micro-batches;
- ``state_dict()`` is the GLOBAL position ``{epoch, consumed, fingerprint}``, equal on every rank;
  ``load_state_dict`` re-deals the rest of the epoch for the current DP size, so a run resumed on a
  different number of ranks (same global batch) continues with the same global micro-batches.

Batches follow the collater contract (``input_ids``, ``labels``, ``position_ids`` ``[B, S]``;
``seq_lens``, ``seq_lens_padded`` ``[B, D]``), built by :func:`automodel.data.collate.build_row`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import datasets
import numpy as np
import pyarrow.compute as pc
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from automodel.data.collate import (
    build_row,
    cp_multiple,
    cp_padded,
    packed_sequence_thd_collater,
    padded_sequence_thd_collater,
)
from automodel.data.corpus import CorpusPacks, TokenCorpus, corpus_packs
from automodel.data.pack_cache import cache_root, cached_pack_dataset
from automodel.data.packing import keep_fitting, pack_dataset, read_lengths
from automodel.data.planning import (
    PACKING_ALGORITHMS,
    PackPlan,
    check_cost_coefficients,
    check_positive_int,
    plan_balanced_packs,
    plan_token_budget,
)
from automodel.loss import CROSS_ENTROPY_IGNORE_INDEX

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoaderEnv:
    """What a batching mode needs to know about the run."""

    dp_rank: int = 0
    dp_size: int = 1
    cp_size: int = 1
    seed: int = 0
    padding_idx: int = 0


@dataclass
class Prepared:
    """A mode prepared on a dataset: ``units`` rows (numpy format), ``kept`` unit indices ``[K]``."""

    units: datasets.Dataset
    kept: np.ndarray
    plan: Callable[[np.ndarray], PackPlan]
    collate: Callable[[list[dict[str, Any]]], dict[str, Any]]
    fingerprint: str


def _fingerprint(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _groups(order: np.ndarray, size: int) -> PackPlan:
    """``size`` consecutive units of ``order`` per micro-batch; the last may be smaller."""
    offsets = np.minimum(np.arange(-(-len(order) // size) + 1, dtype=np.int64) * size, len(order))
    return PackPlan(np.asarray(order, np.int64), offsets)


class _Dealt(torch.utils.data.Dataset):
    """Item k: the collated global micro-batch ``start + k * dp + dp_rank`` of ``plan``; items past
    the plan (``build_eval`` only) repeat micro-batch 0 with every label -100."""

    def __init__(self, prepared: Prepared, plan: PackPlan, start: int, env: LoaderEnv, length: int):
        self.prepared, self.plan, self.start, self.env, self.length = prepared, plan, start, env, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, k: int) -> dict[str, Any]:
        if not 0 <= k < self.length:
            raise IndexError(k)
        index = self.start + k * self.env.dp_size + self.env.dp_rank
        filler = index >= self.plan.num_packs
        a, b = self.plan.pack_offsets[[0, 1] if filler else [index, index + 1]]
        columns = self.prepared.units[self.plan.sample_order[a:b].tolist()]
        batch = self.prepared.collate([dict(zip(columns, values)) for values in zip(*columns.values())])
        if filler:
            batch["labels"] = torch.full_like(batch["labels"], CROSS_ENTROPY_IGNORE_INDEX)
        return batch


class _Position:
    """The resumable global position of ``MicroBatchStream`` and ``StreamedMicroBatches``: ``start``
    global micro-batches of ``epoch`` were consumed before this process began it, ``taken`` since."""

    env: LoaderEnv
    fingerprint: str
    epoch = start = taken = 0
    _iterator: Iterator | None = None

    def __iter__(self) -> _Position:
        return self

    def state_dict(self) -> dict[str, Any]:
        """``{epoch, consumed, fingerprint}``: global micro-batches consumed in the epoch; equal on every rank."""
        consumed = self.start + self.taken * self.env.dp_size
        return {"epoch": self.epoch, "consumed": consumed, "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["fingerprint"] != self.fingerprint:
            raise ValueError(
                f"fingerprint: the saved data position belongs to another plan ({state['fingerprint']} != "
                f"{self.fingerprint}): resume with the same data, packing section, seed (and DP size for balanced "
                "and streaming)"
            )
        self.epoch, self.start, self.taken, self._iterator = state["epoch"], state["consumed"], 0, None


class MicroBatchStream(_Position):
    """This rank's micro-batches over epochs without end (``next``), resumable from the global position."""

    def __init__(self, prepared: Prepared, env: LoaderEnv, shuffle: bool, num_workers: int = 0):
        self.prepared, self.env, self.shuffle, self.num_workers = prepared, env, shuffle, num_workers
        self.fingerprint = prepared.fingerprint
        self._plan: tuple[int, PackPlan] | None = None
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"dp_size: the data gives {self.plan(0).num_packs} micro-batches per epoch, fewer than the "
                f"{env.dp_size} data-parallel ranks; use more data, smaller micro-batches or fewer ranks"
            )

    def plan(self, epoch: int) -> PackPlan:
        """The epoch's global micro-batches (unit indices): the kept units in the order of ``(seed, epoch)``."""
        if self._plan is None or self._plan[0] != epoch:
            kept = self.prepared.kept
            order = (
                kept[np.random.default_rng((self.env.seed, epoch)).permutation(len(kept))]
                if self.shuffle
                else kept
            )
            plan = self.prepared.plan(order)
            dropped = plan.num_packs % self.env.dp_size
            left_out = len(kept) - int(plan.pack_offsets[plan.num_packs - dropped])
            if left_out:
                logger.warning(
                    "epoch %d: %d of %d units (samples or packs) are not dealt: the last %d of %d micro-batches do "
                    "not divide among %d data-parallel rank(s)",
                    epoch,
                    left_out,
                    len(kept),
                    dropped,
                    plan.num_packs,
                    self.env.dp_size,
                )
            self._plan = (epoch, plan)
        return self._plan[1]

    @property
    def batches_per_epoch(self) -> int:
        """Micro-batches per rank in the current epoch."""
        return self.plan(self.epoch).num_packs // self.env.dp_size

    def epoch_tokens(self, epoch: int = 0) -> tuple[int, int]:
        """``(real tokens, label tokens)`` that all DP ranks together train in ``epoch``: the units of
        its dealt micro-batches (what ``automodel data`` reports as learned)."""
        plan = self.plan(epoch)
        dealt = plan.sample_order[: plan.pack_offsets[plan.num_packs - plan.num_packs % self.env.dp_size]]
        tokens, learned = unit_token_counts(self.prepared.units)
        return int(tokens[dealt].sum()), int(learned[dealt].sum())

    def __next__(self) -> dict[str, Any]:
        for _ in range(2):
            if self._iterator is None:
                plan = self.plan(self.epoch)
                dealt = _Dealt(
                    self.prepared,
                    plan,
                    self.start,
                    self.env,
                    (plan.num_packs - self.start) // self.env.dp_size,
                )
                self._iterator = iter(StatefulDataLoader(
                    dealt, batch_size=None, num_workers=self.num_workers  # items are collated micro-batches
                ))  # fmt: skip
            try:
                batch = next(self._iterator)
                self.taken += 1
                return batch
            except StopIteration:
                self.epoch, self.start, self.taken, self._iterator = self.epoch + 1, 0, 0, None
        raise ValueError(
            f"dp_size: epoch {self.epoch} gives no micro-batch to each of {self.env.dp_size} ranks"
        )


def check_pack_alignment(packed_sequence_size: int, cp_size: int) -> None:
    """ValueError unless ``packed_sequence_size`` is a multiple of ``2 * cp_size`` (TE's CP sharding)."""
    if packed_sequence_size % cp_multiple(cp_size):
        raise ValueError(
            f"packing.packed_sequence_size={packed_sequence_size} must be a multiple of 2*cp_size="
            f"{cp_multiple(cp_size)} (parallel.cp_size={cp_size}): every sample and the pack's tail are padded to it"
        )


_NOT_IN_PLAN = ("num_workers", "cache_dir")  # settings that change no micro-batch: a resume may change them


@dataclass
class _Mode:
    """Shared fields and ``build``/``build_eval`` of the map-style modes; each mode defines
    ``prepare(dataset, env) -> Prepared``."""

    shuffle: bool = True
    num_workers: int = 0
    _positive: ClassVar[tuple[str, ...]] = ()  # fields that must be ints >= 1
    _plan_uses_dp_size: ClassVar[bool] = False  # True: a resume on another DP size is refused (fingerprint)

    def __post_init__(self) -> None:
        for name in self._positive:
            check_positive_int(f"packing.{name}", getattr(self, name))
        if not isinstance(self.shuffle, bool):
            raise ValueError(f"packing.shuffle must be true or false, got {self.shuffle!r}")
        if (
            isinstance(self.num_workers, bool)
            or not isinstance(self.num_workers, int)
            or self.num_workers < 0
        ):
            raise ValueError(f"packing.num_workers must be an int >= 0, got {self.num_workers!r}")

    def _prepared(self, dataset: datasets.Dataset | TokenCorpus, env: LoaderEnv) -> Prepared:
        if not isinstance(dataset, (datasets.Dataset, TokenCorpus)):
            raise ValueError(
                f"dataset: this mode needs a map-style datasets.Dataset or a TokenCorpus, got {type(dataset).__name__}"
            )
        prepared = self.prepare(dataset, env)
        prepared.fingerprint = _fingerprint(
            type(self).__name__,
            {k: v for k, v in asdict(self).items() if k not in _NOT_IN_PLAN},
            hashlib.sha256(prepared.kept.tobytes()).hexdigest(),
            len(prepared.units),
            env.seed,
            env.cp_size,
            *((env.dp_size,) if self._plan_uses_dp_size else ()),
        )
        return prepared

    def check_run(self, env: LoaderEnv) -> None:
        """ValueError for settings this run cannot use, before any data work (the modes that have such)."""

    def build(self, dataset: datasets.Dataset, env: LoaderEnv) -> MicroBatchStream:
        return MicroBatchStream(self._prepared(dataset, env), env, self.shuffle, self.num_workers)

    def length_bounds(self, max_sample: int | None, cp_size: int) -> tuple[int | None, int | None]:
        """``(longest sample, longest micro-batch row)`` in tokens this mode can produce from samples of
        at most ``max_sample`` tokens (``data.max_length``, or the longest tokenized sample; None:
        unknown), CP padding included in the row; None where the mode does not bound it."""
        raise NotImplementedError

    def build_eval(self, dataset: datasets.Dataset, env: LoaderEnv) -> Sequence[dict[str, Any]]:
        """One unshuffled pass: every kept sample once across DP ranks, the same count on every rank
        (the last micro-batches repeat micro-batch 0 with labels -100 where needed)."""
        prepared = self._prepared(dataset, env)
        plan = prepared.plan(prepared.kept)
        return _Dealt(prepared, plan, 0, env, -(-plan.num_packs // env.dp_size))


def sample_cap(mode: Any, cp_size: int = 1) -> int | None:
    """The most tokens one sample may have in a row of the batching ``mode`` (a pack, ``max_seq_len``,
    dyn_bsz's length cap, ``none``'s ``max_length``), rounded down to a multiple of ``2*cp_size``
    (the CP padding must still fit); None when the mode names no bound. ``data.long_samples`` cuts
    to it when ``data.max_length`` is null or larger."""
    for name in ("packed_sequence_size", "max_seq_len", "length_cap", "max_length"):
        cap = getattr(mode, name, None)
        if cap is not None:
            return cap // cp_multiple(cp_size) * cp_multiple(cp_size)
    return None


def unit_token_counts(units: datasets.Dataset | TokenCorpus | CorpusPacks) -> tuple[np.ndarray, np.ndarray]:
    """``([K] real tokens, [K] label tokens)`` of each unit: a pack (``seq_lens``, labels != -100) or
    a sample (its length, :func:`label_token_counts`)."""
    if isinstance(units, (TokenCorpus, CorpusPacks)):
        return units.token_counts()
    table = units.with_format("arrow")[:]
    if "seq_lens" not in table.column_names:
        return pc.list_value_length(table.column("input_ids")).to_numpy(
            zero_copy_only=False
        ), label_token_counts(units)
    real = _row_sums(table.column("seq_lens"), pc.list_flatten(table.column("seq_lens")))
    labels = table.column("labels")
    return real, _row_sums(labels, pc.not_equal(pc.list_flatten(labels), CROSS_ENTROPY_IGNORE_INDEX))


def _row_sums(lists, flat_values) -> np.ndarray:
    """``[N]`` sums of each list of ``lists`` over ``flat_values`` (its values, flattened)."""
    values = flat_values.to_numpy(zero_copy_only=False).astype(np.int64)
    ends = np.cumsum(pc.list_value_length(lists).to_numpy(zero_copy_only=False))
    cumulative = np.concatenate([[0], np.cumsum(values)])
    return cumulative[ends] - cumulative[np.concatenate([[0], ends[:-1]])]


def sample_lengths(dataset: datasets.Dataset | TokenCorpus) -> np.ndarray:
    """``[N]`` tokens per sample (:func:`~automodel.data.packing.read_lengths` for a dataset)."""
    return dataset.lengths if isinstance(dataset, TokenCorpus) else read_lengths(dataset)


def _at_most(max_sample: int | None, cap: int) -> int:
    return cap if max_sample is None else min(max_sample, cap)


def _sample_rows(dataset: datasets.Dataset | TokenCorpus) -> datasets.Dataset | TokenCorpus:
    if isinstance(dataset, TokenCorpus):
        return dataset
    names = [c for c in ("input_ids", "labels", "loss_mask") if c in dataset.column_names]
    return dataset.select_columns(names).with_format("numpy")


@dataclass
class PackedBatching(_Mode):
    """``packing: bfd | sequential``: :func:`pack_dataset` once, ``micro_batch_size`` packs of
    ``packed_sequence_size`` tokens per micro-batch, packs reshuffled every epoch. With ``cache_dir``
    the packs come from :func:`cached_pack_dataset` (packed once, memory-mapped by every rank)."""

    algorithm: str = "bfd"
    packed_sequence_size: int = 2048
    micro_batch_size: int = 1
    drop_long_samples: bool = True
    max_packs: int | None = None
    cache_dir: str | None = None
    _positive = ("packed_sequence_size", "micro_batch_size")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.algorithm not in PACKING_ALGORITHMS:
            raise ValueError(f"packing.algorithm must be one of {PACKING_ALGORITHMS}, got {self.algorithm!r}")

    def check_run(self, env: LoaderEnv) -> None:
        """The pack size against ``parallel.cp_size`` (every CP-padded sample, and the tail, keep TE's
        alignment) and ``cache_dir`` (created here, or named), before tokenizing."""
        check_pack_alignment(self.packed_sequence_size, env.cp_size)
        if self.cache_dir:
            try:
                cache_root(self.cache_dir)
            except ValueError as error:
                raise ValueError(f"packing.{error}") from None

    def micro_batch(self) -> tuple[str, int | None]:
        """What one micro-batch holds, and the most tokens it can hold (the ``global batch`` log line)."""
        return f"{_packs(self.micro_batch_size)} of up to {self.packed_sequence_size:,} tokens", (
            self.micro_batch_size * self.packed_sequence_size
        )

    def length_bounds(self, max_sample: int | None, cp_size: int) -> tuple[int | None, int | None]:
        """Samples up to the pack size (longer ones are dropped or refused); ``micro_batch_size`` packs
        in one micro-batch."""
        return _at_most(
            max_sample, self.packed_sequence_size
        ), self.micro_batch_size * self.packed_sequence_size

    def prepare(self, dataset: datasets.Dataset | TokenCorpus, env: LoaderEnv) -> Prepared:
        if isinstance(dataset, TokenCorpus):  # packs built as they are read, from the memory-mapped tokens
            if self.max_packs is not None:
                raise ValueError(
                    "packing.max_packs is not supported on a token corpus; use trainer.max_steps"
                )
            packs = corpus_packs(
                dataset, self.packed_sequence_size, algorithm=self.algorithm, seed=env.seed,
                padding_idx=env.padding_idx, cp_size=env.cp_size, drop_long_samples=self.drop_long_samples,
                cache_dir=self.cache_dir,
            )  # fmt: skip
            return Prepared(packs, np.arange(len(packs)), functools.partial(_groups, size=self.micro_batch_size),
                            packed_sequence_thd_collater, "")  # fmt: skip
        pack = (
            functools.partial(cached_pack_dataset, cache_dir=self.cache_dir)
            if self.cache_dir
            else pack_dataset
        )
        packed = pack(
            dataset, "train", self.packed_sequence_size, self.max_packs, env.padding_idx, self.drop_long_samples,
            env.cp_size, algorithm=self.algorithm, seed=env.seed,
        )  # fmt: skip
        return Prepared(
            packed.with_format("numpy"),
            np.arange(len(packed)),
            functools.partial(_groups, size=self.micro_batch_size),
            packed_sequence_thd_collater,
            "",
        )


@dataclass
class PaddedBatching(_Mode):
    """``packing: none``: classic padded batches, ``micro_batch_size`` samples per micro-batch, each
    padded to the longest of the micro-batch; samples longer than ``max_length`` are dropped."""

    micro_batch_size: int = 8
    max_length: int = 2048
    _positive = ("micro_batch_size", "max_length")

    def micro_batch(self) -> tuple[str, int | None]:
        return f"{self.micro_batch_size} sample(s) of up to {self.max_length:,} tokens, padded", (
            self.micro_batch_size * self.max_length
        )

    def length_bounds(self, max_sample: int | None, cp_size: int) -> tuple[int | None, int | None]:
        """Samples up to ``max_length``; ``micro_batch_size`` of them, each padded to the longest."""
        longest = _at_most(max_sample, self.max_length)
        return longest, self.micro_batch_size * int(cp_padded(longest, cp_size))

    def prepare(self, dataset: datasets.Dataset, env: LoaderEnv) -> Prepared:
        padded = cp_padded(sample_lengths(dataset), env.cp_size)
        kept = np.flatnonzero(keep_fitting("packing.max_length", padded, self.max_length, True, env.cp_size))
        collate = functools.partial(
            padded_sequence_thd_collater, padding_idx=env.padding_idx, cp_size=env.cp_size
        )
        return Prepared(
            _sample_rows(dataset), kept, functools.partial(_groups, size=self.micro_batch_size), collate, ""
        )


def _packs(count: int) -> str:
    return f"{count} pack" + ("s" if count > 1 else "")


def _flat_collate(samples: list[dict[str, Any]], env: LoaderEnv, length: int | None) -> dict[str, Any]:
    """Samples flattened into one row per micro-batch (rmpad, dyn_bsz, balanced)."""
    return packed_sequence_thd_collater([build_row(samples, env.padding_idx, env.cp_size, length)])


@dataclass
class _FlatMode(_Mode):
    """Modes whose micro-batch is one flattened row; ``pad_packed_input`` pads it to a fixed length."""

    pad_packed_input: bool = False
    pad_packed_to_length: int | None = None

    def _static_length(self, longest: int, what: str, cp_size: int) -> int | None:
        """``pad_packed_to_length`` (default ``longest``) when ``pad_packed_input``; it must hold the
        longest micro-batch and split into 2W chunks."""
        if not isinstance(self.pad_packed_input, bool):
            raise ValueError(f"packing.pad_packed_input must be true or false, got {self.pad_packed_input!r}")
        if self.pad_packed_to_length is not None:
            check_positive_int("packing.pad_packed_to_length", self.pad_packed_to_length)
            if not self.pad_packed_input:
                raise ValueError(
                    "packing.pad_packed_to_length needs packing.pad_packed_input=true; set it or remove it"
                )
        if not self.pad_packed_input:
            return None
        length = self.pad_packed_to_length or longest
        if length < longest or length % cp_multiple(cp_size):
            raise ValueError(
                f"packing.pad_packed_to_length={length} must be >= the longest micro-batch ({what} = {longest}) "
                f"and a multiple of 2*cp_size={cp_multiple(cp_size)}"
            )
        return length


def _flat_prepared(
    dataset: datasets.Dataset, env: LoaderEnv, kept: np.ndarray, plan: Callable, length: int | None
) -> Prepared:
    return Prepared(
        _sample_rows(dataset), kept, plan, functools.partial(_flat_collate, env=env, length=length), ""
    )


@dataclass
class RmpadBatching(_FlatMode):
    """``packing: rmpad`` (VeOmni's ``rmpad_with_pos_ids``): ``micro_batch_size`` samples per
    micro-batch, flattened into one row ``[1, T]`` without padding between them. With
    ``pad_packed_input`` every row is padded to ``pad_packed_to_length`` (default
    ``micro_batch_size * max_seq_len``) by the tail-padding rule (static shapes).

    Example (S1=[A B C D], S2=[E F], S3=[G H I], S4=[J], micro_batch_size 2, no shuffle)::

        [A B C D E F] positions [0 1 2 3 0 1]     then     [G H I J] positions [0 1 2 0]
    """

    micro_batch_size: int = 1
    max_seq_len: int = 2048
    _positive = ("micro_batch_size", "max_seq_len")

    def __post_init__(self) -> None:
        super().__post_init__()
        self._static_length(self.micro_batch_size * self.max_seq_len, "micro_batch_size * max_seq_len", 1)

    def micro_batch(self) -> tuple[str, int | None]:
        tokens = self.micro_batch_size * self.max_seq_len
        return f"{self.micro_batch_size} sample(s) in one row of up to {tokens:,} tokens", tokens

    def length_bounds(self, max_sample: int | None, cp_size: int) -> tuple[int | None, int | None]:
        """Samples up to ``max_seq_len``; ``micro_batch_size`` of them in a row, or the static length."""
        longest = _at_most(max_sample, self.max_seq_len)
        row = self.micro_batch_size * int(cp_padded(longest, cp_size))
        static = self.pad_packed_to_length or self.micro_batch_size * self.max_seq_len
        return longest, static if self.pad_packed_input else row

    def prepare(self, dataset: datasets.Dataset, env: LoaderEnv) -> Prepared:
        length = self._static_length(
            self.micro_batch_size * self.max_seq_len, "micro_batch_size * max_seq_len", env.cp_size
        )
        padded = cp_padded(sample_lengths(dataset), env.cp_size)
        kept = np.flatnonzero(
            keep_fitting("packing.max_seq_len", padded, self.max_seq_len, True, env.cp_size)
        )
        return _flat_prepared(
            dataset, env, kept, functools.partial(_groups, size=self.micro_batch_size), length
        )


def label_token_counts(dataset: datasets.Dataset) -> np.ndarray:
    """``[N]`` label tokens per sample: label != -100 where ``loss_mask`` != 0."""
    if isinstance(dataset, TokenCorpus):
        return dataset.lengths
    table = dataset.with_format("arrow")[:]
    learnable = pc.not_equal(pc.list_flatten(table.column("labels")), CROSS_ENTROPY_IGNORE_INDEX)
    if "loss_mask" in table.column_names:
        learnable = pc.and_(learnable, pc.not_equal(pc.list_flatten(table.column("loss_mask")), 0))
    return _row_sums(table.column("labels"), learnable)


@dataclass
class DynBszBatching(_FlatMode):
    """``packing: dyn_bsz`` (VeOmni's ``dyn_bsz``): each micro-batch takes, largest first from a
    buffer of ``buffer_size`` upcoming samples, every sample that fits the budget
    (:func:`plan_token_budget`), flattened into one row. ``count: tokens`` budgets the slots
    (CP padding included); ``count: label_tokens`` budgets label tokens, the row length then capped
    by ``max_packed_length``. ``pad_packed_input`` pads every row to the length cap (or
    ``pad_packed_to_length``).

    Example (S1=[A B C D], S2=[E F], S3=[G H I], S4=[J], budget 10)::

        [A B C D E F G H I J] positions [0 1 2 3 0 1 0 1 2 0]
    """

    max_tokens_per_micro_batch: int = 4096
    count: str = "tokens"
    max_packed_length: int | None = None
    buffer_size: int = 200
    _positive = ("max_tokens_per_micro_batch", "buffer_size")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.count not in ("tokens", "label_tokens"):
            raise ValueError(f"packing.count must be tokens or label_tokens, got {self.count!r}")
        if (self.count == "label_tokens") != (self.max_packed_length is not None):
            raise ValueError(
                "packing.max_packed_length (the cap on a micro-batch's length) is required with count=label_tokens "
                f"and not allowed with count=tokens; got max_packed_length={self.max_packed_length!r}"
            )
        if self.max_packed_length is not None:
            check_positive_int("packing.max_packed_length", self.max_packed_length)
            if self.max_packed_length < self.max_tokens_per_micro_batch:
                raise ValueError(
                    f"packing.max_packed_length={self.max_packed_length} must be >= max_tokens_per_micro_batch="
                    f"{self.max_tokens_per_micro_batch}"
                )
        self._static_length(self.length_cap, "the length cap", 1)

    @property
    def length_cap(self) -> int:
        """The most tokens (CP padding included) a micro-batch may hold."""
        return self.max_packed_length or self.max_tokens_per_micro_batch

    def micro_batch(self) -> tuple[str, int | None]:
        budget = f", {self.max_tokens_per_micro_batch:,} {self.count.replace('_', ' ')} at most"
        return (
            f"one row of up to {self.length_cap:,} tokens{budget if self.count != 'tokens' else ''}",
            self.length_cap,
        )

    def length_bounds(self, max_sample: int | None, cp_size: int) -> tuple[int | None, int | None]:
        """Samples and rows up to the length cap (or the static length)."""
        static = self.pad_packed_to_length or self.length_cap
        return _at_most(max_sample, self.length_cap), static if self.pad_packed_input else self.length_cap

    def prepare(self, dataset: datasets.Dataset, env: LoaderEnv) -> Prepared:
        length = self._static_length(self.length_cap, "the length cap", env.cp_size)
        sizes = cp_padded(sample_lengths(dataset), env.cp_size)
        weights = sizes if self.count == "tokens" else label_token_counts(dataset)
        cap_name = (
            "packing.max_packed_length" if self.max_packed_length else "packing.max_tokens_per_micro_batch"
        )
        fits = keep_fitting(cap_name, sizes, self.length_cap, True, env.cp_size)
        fits &= keep_fitting(
            "packing.max_tokens_per_micro_batch (label tokens)",
            weights,
            self.max_tokens_per_micro_batch,
            True,
            1,
        )
        if not fits.any():  # each limit keeps some samples, but no sample is within both
            raise ValueError(
                f"no sample fits both {cap_name}={self.length_cap} (tokens) and packing.max_tokens_per_micro_batch="
                f"{self.max_tokens_per_micro_batch} (label tokens): the short samples have too many label tokens; "
                "raise either limit, or cut samples with data.max_length"
            )
        plan = functools.partial(
            plan_token_budget, weights=weights, sizes=sizes, budget=self.max_tokens_per_micro_batch,
            max_size=self.length_cap, buffer_size=self.buffer_size,
        )  # fmt: skip
        return _flat_prepared(dataset, env, np.flatnonzero(fits), plan, length)


def plan_balanced_epoch(
    order: np.ndarray,
    lengths: np.ndarray,
    *,
    dp_size: int,
    samples_per_pack: int,
    packs_per_rank: int = 1,
    max_tokens_per_gpu: int | None = None,
    cost_coefficients: Sequence[float] = (1.0, 0.0),
) -> PackPlan:
    """Balanced micro-batches of an epoch from a sample ``order``: groups of
    ``G = samples_per_pack * dp_size * packs_per_rank`` samples, each split by
    :func:`plan_balanced_packs` into ``dp_size * packs_per_rank`` packs (more, a multiple of
    ``dp_size``, where the cap demands), dealt ``dp_size`` at a time in alternating direction so that
    no rank always gets the heaviest. A last partial group gets ``ceil(n / samples_per_pack)`` packs.

    Example (dp_size=2, samples_per_pack=2, order 0..3, lengths [8, 7, 6, 5]): packs [0, 3] (13)
    and [1, 2] (13) -> sample_order [0 3 1 2], pack_offsets [0 2 4].
    """
    packs: list[np.ndarray] = []
    group = samples_per_pack * dp_size * packs_per_rank
    for start in range(0, len(order), group):
        members = order[start : start + group]
        full = len(members) == group
        plan = plan_balanced_packs(
            lengths[members], num_packs=dp_size * packs_per_rank if full else -(-len(members) // samples_per_pack),
            max_tokens_per_gpu=max_tokens_per_gpu, cost_coefficients=cost_coefficients,
            multiple_of=dp_size if full else 1,
        )  # fmt: skip
        for step, first in enumerate(range(0, plan.num_packs, dp_size)):
            dealt = [members[plan.sample_order[plan.pack_offsets[p] : plan.pack_offsets[p + 1]]]
                     for p in range(first, min(first + dp_size, plan.num_packs))]  # fmt: skip
            packs.extend(dealt if step % 2 == 0 else dealt[::-1])
    return PackPlan.from_packs(packs)


@dataclass
class BalancedBatching(_Mode):
    """``packing: balanced`` (slime-style): each group of ``micro_batch_size * dp * packs_per_rank``
    samples is split into packs of balanced work (:func:`plan_balanced_epoch`), none over
    ``packed_sequence_size`` tokens; one pack = one micro-batch ``[1, T]``, T varying. Set
    ``packs_per_rank`` to the trainer's ``grad_accum_steps`` so that a group is one optimizer step.
    ``cost_coefficients`` ``(linear, quadratic)``: per-sample work ``linear*L + quadratic*L^2``.
    The plan depends on ``dp_size``: resuming on another DP size is refused (fingerprint)."""

    packed_sequence_size: int = 16384
    micro_batch_size: int = 16
    packs_per_rank: int = 1
    cost_coefficients: tuple[float, float] = (1.0, 0.0)
    drop_long_samples: bool = True
    _positive = ("packed_sequence_size", "micro_batch_size", "packs_per_rank")
    _plan_uses_dp_size = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self.cost_coefficients = check_cost_coefficients(self.cost_coefficients)

    def micro_batch(self) -> tuple[str, int | None]:
        return f"1 pack of up to {self.packed_sequence_size:,} tokens", self.packed_sequence_size

    def length_bounds(self, max_sample: int | None, cp_size: int) -> tuple[int | None, int | None]:
        """Samples and packs up to ``packed_sequence_size``."""
        return _at_most(max_sample, self.packed_sequence_size), self.packed_sequence_size

    def prepare(self, dataset: datasets.Dataset, env: LoaderEnv) -> Prepared:
        padded = cp_padded(sample_lengths(dataset), env.cp_size)
        keep = keep_fitting(
            "packing.packed_sequence_size",
            padded,
            self.packed_sequence_size,
            self.drop_long_samples,
            env.cp_size,
        )
        plan = functools.partial(
            plan_balanced_epoch, lengths=padded, dp_size=env.dp_size, samples_per_pack=self.micro_batch_size,
            packs_per_rank=self.packs_per_rank, max_tokens_per_gpu=self.packed_sequence_size,
            cost_coefficients=self.cost_coefficients,
        )  # fmt: skip
        return _flat_prepared(dataset, env, np.flatnonzero(keep), plan, None)
