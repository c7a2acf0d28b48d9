"""``pack_dataset``: tokenized SFT samples -> fixed-size packs for the THD data path.

Reads the token columns straight from Arrow (no per-sample Python), plans with
:mod:`automodel.data.planning`, and writes the packed columns into preallocated arrays that become
Arrow list columns without a copy.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Mapping
from dataclasses import dataclass

import datasets
import numba
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from datasets.fingerprint import Hasher
from datasets.table import InMemoryTable
from tqdm.auto import tqdm

from automodel.data.collate import cp_multiple, cp_padded
from automodel.data.planning import (
    PACKING_ALGORITHMS,
    PackPlan,
    check_positive_int,
    lower_bound_packs,
    plan_packs,
)
from automodel.loss import CROSS_ENTROPY_IGNORE_INDEX

logger = logging.getLogger(__name__)

_INT32 = np.iinfo(np.int32)


@dataclass(frozen=True)
class PackingReport:
    algorithm: str
    packed_sequence_size: int
    num_samples: int
    num_too_long: int  # longer than a pack (after CP padding): dropped
    num_over_max_packs: int  # fit, but left out because max_packs was reached
    num_packs: int
    lower_bound: int  # ceil(padded tokens of all samples that fit / packed_sequence_size)
    real_tokens: int

    @property
    def fill(self) -> float:
        """Share of pack slots holding real tokens."""
        return self.real_tokens / max(1, self.num_packs * self.packed_sequence_size)

    def __str__(self) -> str:
        text = (
            f"packed {self.num_samples - self.num_too_long - self.num_over_max_packs:,} of {self.num_samples:,} samples into {self.num_packs:,} packs of "
            f"{self.packed_sequence_size} tokens ({self.algorithm}): fill {self.fill:.2%}"
        )
        if not self.num_over_max_packs:
            text += f", {self.num_packs / max(1, self.lower_bound) - 1:+.3%} packs over the lower bound {self.lower_bound:,}"
        return text


def pack_dataset(
    dataset,
    split,
    packed_sequence_size,
    max_packs=None,
    padding_idx=0,
    drop_long_samples=True,
    cp_size=1,
    *,
    algorithm="bfd",
    seed=0,
    pad_to_multiple_of=1,
    vocab_size=None,
) -> datasets.Dataset:
    """Pack tokenized samples into rows of exactly ``packed_sequence_size`` tokens.

    Args:
        dataset: ``datasets.Dataset`` or ``DatasetDict`` with list columns ``input_ids``, ``labels``
            (already aligned targets) and optionally ``loss_mask`` (0 turns the label into -100); or
            a list (or any map-style dataset) of such rows, a missing ``loss_mask`` masking nothing.
        split: the split to pack when ``dataset`` is a ``DatasetDict``.
        packed_sequence_size: S, tokens per pack.
        max_packs: keep only the first ``max_packs`` packs; samples left out are reported.
        padding_idx: token id of padding.
        drop_long_samples: drop (and report) samples longer than S after CP padding; with False
            such a sample raises ValueError.
        cp_size: context-parallel size W. With W > 1 each sample is padded at its end to a
            multiple of 2W, and S must be a multiple of 2W.
        algorithm: ``"bfd"`` (best-fit decreasing, packs shuffled by ``seed``) or ``"sequential"``
            (next-fit in dataset order, pack for pack what NeMo AutoModel produces).
        seed: shuffles the packs of ``"bfd"``.
        pad_to_multiple_of: also pad each sample to a multiple of this (S must be one too).
        vocab_size: when given, an ``input_ids`` or ``labels`` id at or above it is a ValueError
            naming the sample (negative ids always are, but the -100 label).

    Returns:
        A ``datasets.Dataset`` with one row per pack (int32 list columns):

        - ``input_ids``, ``labels``, ``position_ids``: ``[S]``. Positions restart at 0 for every
            sample and count through its CP padding; CP padding and tail padding hold
            ``padding_idx`` / -100; tail positions continue from the last one (clamped to S-1).
        - ``seq_lens``: ``[D]`` real lengths of the D samples in the pack.
        - ``seq_lens_padded``: ``[D]`` CP-padded lengths, the tail padding added to the last entry,
            so they sum to S and each is a multiple of 2W.

    Example (S=16, W=2, samples [1 2 3] and [4 5 6 7 8])::

        input_ids       [1 2 3 0 4 5 6 7 8 0 0 0 0 0 0 0]
        position_ids    [0 1 2 3 0 1 2 3 4 5 6 7 8 9 10 11]
        seq_lens        [3 5]
        seq_lens_padded [4 12]
    """
    _check_arguments(
        packed_sequence_size,
        max_packs,
        padding_idx,
        drop_long_samples,
        cp_size,
        algorithm,
        seed,
        pad_to_multiple_of,
        vocab_size,
    )
    dataset = _select_split(dataset, split)
    lengths, columns = _token_columns(dataset, vocab_size)

    padded_lens = cp_padded(lengths, cp_size, pad_to_multiple_of)
    keep = keep_fitting(
        "packed_sequence_size",
        padded_lens,
        packed_sequence_size,
        drop_long_samples,
        cp_size,
        pad_to_multiple_of,
    )
    fitting = np.flatnonzero(keep)
    plan = plan_packs(padded_lens[fitting], packed_sequence_size, algorithm, seed)
    lower_bound = lower_bound_packs(padded_lens[fitting], packed_sequence_size)
    if max_packs is not None and max_packs < plan.num_packs:  # the first max_packs packs
        plan = PackPlan(plan.sample_order[: plan.pack_offsets[max_packs]], plan.pack_offsets[: max_packs + 1])
    plan = PackPlan(fitting[plan.sample_order], plan.pack_offsets)  # index the input rows

    report = PackingReport(
        algorithm=algorithm,
        packed_sequence_size=packed_sequence_size,
        num_samples=len(lengths),
        num_too_long=int((~keep).sum()),
        num_over_max_packs=len(fitting) - len(plan.sample_order),
        num_packs=plan.num_packs,
        lower_bound=lower_bound,
        real_tokens=int(lengths[plan.sample_order].sum()),
    )
    if report.num_over_max_packs:
        logger.warning("pack_dataset left out %d of %d samples: max_packs=%d was reached",
                       report.num_over_max_packs, report.num_samples, max_packs)  # fmt: skip
    table = _build_table(lengths, columns, plan, padded_lens, packed_sequence_size, padding_idx)
    logger.info("pack_dataset: %s", report)
    fingerprint = Hasher.hash(
        (
            getattr(dataset, "_fingerprint", None),
            packed_sequence_size,
            max_packs,
            padding_idx,
            drop_long_samples,
            cp_size,
            algorithm,
            seed,
            pad_to_multiple_of,
        )
    )
    return datasets.Dataset(InMemoryTable(table), fingerprint=fingerprint)


def _check_arguments(
    packed_sequence_size,
    max_packs,
    padding_idx,
    drop_long_samples,
    cp_size,
    algorithm,
    seed,
    pad_to_multiple_of=1,
    vocab_size=None,
):
    check_positive_int("packed_sequence_size", packed_sequence_size)
    if vocab_size is not None:
        check_positive_int("vocab_size", vocab_size)
    check_positive_int("cp_size", cp_size)
    check_positive_int("pad_to_multiple_of", pad_to_multiple_of)
    if max_packs is not None:
        check_positive_int("max_packs", max_packs)
    if (
        isinstance(padding_idx, bool)
        or not isinstance(padding_idx, (int, np.integer))
        or not (_INT32.min <= padding_idx <= _INT32.max)
    ):
        raise ValueError(f"padding_idx must be an int32 token id, got {padding_idx!r}")
    if not isinstance(drop_long_samples, bool):
        raise ValueError(f"drop_long_samples must be True or False, got {drop_long_samples!r}")
    multiple = cp_multiple(cp_size, pad_to_multiple_of)
    if packed_sequence_size % multiple:
        raise ValueError(
            f"packed_sequence_size={packed_sequence_size} must be a multiple of {multiple} (2*cp_size={2 * cp_size} "
            f"under CP, and pad_to_multiple_of={pad_to_multiple_of}) so that every padded sequence, the tail "
            "padding included, keeps that alignment"
        )
    if algorithm not in PACKING_ALGORITHMS:
        raise ValueError(f"algorithm must be one of {PACKING_ALGORITHMS}, got {algorithm!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an int, got {seed!r}")


def _select_split(dataset, split) -> datasets.Dataset:
    if isinstance(dataset, datasets.DatasetDict):
        if split not in dataset:
            raise ValueError(f"split {split!r} is not in the DatasetDict; available splits: {list(dataset)}")
        dataset = dataset[split]
    elif (
        hasattr(dataset, "__len__")
        and hasattr(dataset, "__getitem__")
        and not isinstance(dataset, (datasets.Dataset, str, Mapping))
    ):  # a list of rows, or a map-style dataset of them (NeMo AutoModel's ChatDataset, a torch Dataset)
        dataset = _dataset_of_rows([dataset[i] for i in range(len(dataset))])
    if not isinstance(dataset, datasets.Dataset):
        raise TypeError(
            f"dataset must be a map-style datasets.Dataset or DatasetDict (lengths are planned over the whole "
            f"dataset), got {type(dataset).__name__}; stream an IterableDataset with packing: streaming instead"
        )
    return dataset  # read_lengths refuses an empty one


def _dataset_of_rows(rows: list) -> datasets.Dataset:
    """The token columns of a list of row dicts as a ``datasets.Dataset``."""
    if not rows:
        raise ValueError("dataset is empty: nothing to pack or batch")
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ValueError(
                f"row {i} is a {type(row).__name__}: rows must be dicts of token lists (input_ids, labels)"
            )
    names = [c for c in ("input_ids", "labels", "loss_mask") if any(c in row for row in rows)]
    # plain lists: Arrow refuses a column mixing tensors or arrays of different dtypes
    columns = {name: [np.asarray(row.get(name)).tolist() for row in rows] for name in names}
    for i, (ids, mask) in enumerate(zip(columns.get("input_ids", ()), columns.get("loss_mask", ()))):
        if mask is None and ids is not None:  # a row without a loss_mask masks nothing
            columns["loss_mask"][i] = [1] * len(ids)
    return datasets.Dataset.from_dict(columns)


def _token_columns(
    dataset: datasets.Dataset, vocab_size: int | None = None
) -> tuple[np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """``[R]`` sample lengths, and for each token column present (``input_ids``, ``labels``,
    ``loss_mask``, as bool) its flat values and ``[R]`` row starts (views of the Arrow buffers)."""
    lengths = read_lengths(dataset, vocab_size)
    names = [c for c in ("input_ids", "labels", "loss_mask") if c in dataset.column_names]
    table = dataset.select_columns(names).with_format("arrow")[:]
    columns = {name: _list_column(table, name) for name in names}
    if "loss_mask" in columns:
        columns["loss_mask"] = (columns["loss_mask"][0] != 0, columns["loss_mask"][1])
    return lengths, columns


def read_lengths(dataset: datasets.Dataset, vocab_size: int | None = None) -> np.ndarray:
    """``[N]`` int64 token count of every sample: the one length reader of the batching modes.

    Checks the columns: ``input_ids`` and ``labels`` present, ``labels``/``loss_mask`` as long as
    ``input_ids``, no empty sample, at least one sample; token ids not negative (a label may be
    -100, ignored) and, when ``vocab_size`` is given, below it (the embedding would index past its table).
    """
    missing = [c for c in ("input_ids", "labels") if c not in dataset.column_names]
    if missing:
        raise ValueError(
            f"dataset lacks column(s) {missing}: samples need input_ids and labels (and optionally loss_mask), "
            f"found {dataset.column_names}"
        )
    if len(dataset) == 0:
        raise ValueError("dataset is empty: nothing to pack or batch")
    names = [c for c in ("input_ids", "labels", "loss_mask") if c in dataset.column_names]
    table = dataset.select_columns(names).with_format("arrow")[:]
    for name in names:
        column = table.column(name)
        if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)
                or pa.types.is_fixed_size_list(column.type)):  # fmt: skip
            raise ValueError(f"{name} must hold lists of token ids, got Arrow type {column.type}")
        if column.null_count:
            raise ValueError(
                f"{name}: sample {int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])} is null"
            )
    lengths = {c: pc.list_value_length(table.column(c)).to_numpy(zero_copy_only=False) for c in names}
    tokens = lengths["input_ids"].astype(np.int64)
    if tokens.min() == 0:
        raise ValueError(f"input_ids: sample {int(np.argmin(tokens))} is empty; remove empty samples")
    for name in names[1:]:
        bad = np.flatnonzero(lengths[name] != tokens)
        if len(bad):
            i = int(bad[0])
            raise ValueError(
                f"{name}: sample {i} has {lengths[name][i]} entries but input_ids has {tokens[i]}"
            )
    for name in names[:2]:
        _check_token_ids(table.column(name), name, vocab_size)
    return tokens


def _check_token_ids(column: pa.ChunkedArray, name: str, vocab_size: int | None) -> None:
    """ValueError naming the first sample of ``column`` (a list column of ids) with an id below 0
    (``labels``: but -100) or at or above ``vocab_size``."""
    values = pc.list_flatten(column)
    if not pa.types.is_integer(values.type):
        return  # float ids: the packer's own check names them
    ignored = values if name == "input_ids" else pc.if_else(pc.equal(values, -100), 0, values)
    low, high = pc.min_max(ignored).values()
    if low.as_py() >= 0 and (vocab_size is None or high.as_py() < vocab_size):
        return
    flat = ignored.to_numpy() if isinstance(ignored, pa.Array) else ignored.combine_chunks().to_numpy()
    bad = int(np.flatnonzero((flat < 0) | (flat >= (vocab_size or np.iinfo(np.int64).max)))[0])
    starts = np.cumsum(pc.list_value_length(column).to_numpy(zero_copy_only=False), dtype=np.int64)
    sample = int(np.searchsorted(starts, bad, side="right"))
    allowed = f"[0, vocab_size={vocab_size})" if vocab_size is not None else "0 or more"
    ignore = " or -100 (ignored)" if name == "labels" else ""
    raise ValueError(
        f"{name}: sample {sample} holds token id {int(flat[bad])}; ids must be {allowed}{ignore}. Re-tokenize "
        "that sample with the run's tokenizer"
    )


def keep_fitting(
    limit: str,
    padded_lens: np.ndarray,
    cap: int,
    drop_long_samples: bool,
    cp_size: int,
    pad_to_multiple_of: int = 1,
    whole: bool = True,
) -> np.ndarray:
    """``[N]`` bool, True for samples whose padded length fits ``cap`` (the setting named ``limit``):
    the one over-long report.

    The rest are dropped and logged with counts, or raise ValueError when ``drop_long_samples`` is False.
    When ``padded_lens`` is the ``whole`` data (not a streamed chunk), none fitting is a ValueError
    naming ``limit`` (not an empty epoch blamed on the data-parallel size).
    """
    too_long = padded_lens > cap
    if too_long.any():
        i = int(np.argmax(too_long))
        multiple = cp_multiple(cp_size, pad_to_multiple_of)
        rule = f"2*cp_size={multiple}" if pad_to_multiple_of == 1 else multiple
        after = f" after padding to a multiple of {rule}" if multiple > 1 else ""
        if whole and too_long.all():
            raise ValueError(
                f"no sample fits {limit}={cap}: all {len(too_long)} are longer{after}, the shortest "
                f"{int(padded_lens.min())} tokens; raise {limit}, or cut samples with data.max_length (at most {cap})"
            )
        if not drop_long_samples:
            raise ValueError(
                f"drop_long_samples=False but sample {i} has {padded_lens[i]} tokens{after}, more than {limit}={cap}: "
                f"raise {limit}, shorten the sample, or set drop_long_samples=True"
            )
        dropped_tokens, tokens = int(padded_lens[too_long].sum()), int(padded_lens.sum())
        logger.warning(
            "dropped %d of %d samples (%.3f%%), %d of %d tokens (%.3f%%), longer than %s=%d tokens%s",
            int(too_long.sum()),
            len(too_long),
            100 * too_long.mean(),
            dropped_tokens,
            tokens,
            100 * dropped_tokens / max(1, tokens),
            limit,
            cap,
            after,
        )
    return ~too_long


def _list_column(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Values and row starts of an integer list column."""
    column = table.column(name)  # read_lengths checked: lists, no null rows
    array = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    if pa.types.is_fixed_size_list(array.type):
        array = array.cast(pa.list_(array.type.value_type))
    if not (pa.types.is_integer(array.type.value_type) or pa.types.is_boolean(array.type.value_type)):
        raise ValueError(f"{name} must hold integers, got lists of {array.type.value_type}")
    offsets = array.offsets.to_numpy().astype(np.int64, copy=False)
    if array.values.null_count:
        raise ValueError(f"{name} contains null token ids")
    values = array.values.to_numpy(zero_copy_only=False)
    if values.dtype not in (np.int32, np.int64, np.bool_):
        values = values.astype(np.int64)
    return values, offsets[:-1]


def _build_table(
    lengths: np.ndarray,
    columns: dict,
    plan: PackPlan,
    padded_lens: np.ndarray,
    pack_size: int,
    padding_idx: int,
) -> pa.Table:
    num_packs = plan.num_packs
    num_slots = num_packs * pack_size
    (ids, ids_starts), (labels, labels_starts) = columns["input_ids"], columns["labels"]
    # Without loss_mask the kernel reads a dummy (has_loss_mask False).
    mask, mask_starts = columns.get("loss_mask", (np.ones(1, np.bool_), np.zeros(len(lengths), np.int64)))
    token_dtype = np.int32 if _fits_int32(ids) and _fits_int32(labels) else np.int64
    out_ids = _prefaulted_empty(num_slots, token_dtype)
    out_labels = _prefaulted_empty(num_slots, token_dtype)
    out_positions = _prefaulted_empty(num_slots, np.int32)
    step = max(
        num_packs // 100, -(-(1 << 22) // pack_size)
    )  # progress chunks of >= 4M slots: one kernel launch each
    torch_threads = torch.get_num_threads()
    with tqdm(total=num_packs, desc="Packing", unit="pack", disable=None, leave=False) as progress:
        for first in range(0, num_packs, step):
            last = min(num_packs, first + step)
            _fill_packs(
                first,
                last,
                plan.pack_offsets,
                plan.sample_order,
                lengths,
                padded_lens,
                ids,
                ids_starts,
                labels,
                labels_starts,
                mask,
                mask_starts,
                "loss_mask" in columns,
                pack_size,
                padding_idx,
                CROSS_ENTROPY_IGNORE_INDEX,
                out_ids,
                out_labels,
                out_positions,
            )
            progress.update(last - first)
    # numba's OpenMP layer resizes the OpenMP pool torch shares to every core; left so, each rank of a
    # multi-process job computes with all cores, and their spinning threads starve each other.
    torch.set_num_threads(torch_threads)

    seq_lens = lengths[plan.sample_order].astype(np.int32)
    seq_lens_padded = padded_lens[plan.sample_order].astype(np.int32)
    used = np.add.reduceat(seq_lens_padded.astype(np.int64), plan.pack_offsets[:-1])
    seq_lens_padded[plan.pack_offsets[1:] - 1] += (pack_size - used).astype(np.int32)

    token_offsets = np.arange(num_packs + 1, dtype=np.int64) * pack_size
    return pa.table(
        {
            "input_ids": _list_array(token_offsets, out_ids),
            "labels": _list_array(token_offsets, out_labels),
            "position_ids": _list_array(token_offsets, out_positions),
            "seq_lens": _list_array(plan.pack_offsets, seq_lens),
            "seq_lens_padded": _list_array(plan.pack_offsets, seq_lens_padded),
        }
    )


def _prefaulted_empty(size: int, dtype) -> np.ndarray:
    """``np.empty`` whose pages the kernel maps up front (Linux): faulting hundreds of MB in one page
    at a time during the copy costs more than the copy itself."""
    nbytes = size * np.dtype(dtype).itemsize
    if not hasattr(mmap, "MAP_POPULATE") or nbytes < 1 << 26:
        return np.empty(size, dtype)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    return np.frombuffer(buffer, dtype)


def _fits_int32(values: np.ndarray) -> bool:
    if values.dtype != np.int64 or len(values) == 0:
        return True
    return _INT32.min <= values.min() and values.max() <= _INT32.max


def _list_array(offsets: np.ndarray, values: np.ndarray) -> pa.Array:
    """A list column over ``values`` without copying them (large_list past 2**31 - 1 values)."""
    values_array = pa.Array.from_buffers(
        pa.from_numpy_dtype(values.dtype), len(values), [None, pa.py_buffer(values)]
    )
    if offsets[-1] <= _INT32.max:
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), values_array)
    return pa.LargeListArray.from_arrays(pa.array(offsets), values_array)


@numba.njit(cache=True, parallel=True)
def _fill_packs(
    first_pack, last_pack, pack_offsets, sample_order, lengths, padded_lens,
    input_ids, input_ids_starts, labels, labels_starts, loss_mask, loss_mask_starts, has_loss_mask,
    pack_size, padding_idx, ignore_index, out_ids, out_labels, out_positions,
):  # fmt: skip
    for pack in numba.prange(first_pack, last_pack):  # packs own disjoint slots
        slot = pack * pack_size
        for k in range(pack_offsets[pack], pack_offsets[pack + 1]):
            sample = sample_order[k]
            length, padded = lengths[sample], padded_lens[sample]
            ids_at, labels_at = input_ids_starts[sample], labels_starts[sample]
            out_ids[slot : slot + length] = input_ids[ids_at : ids_at + length]
            out_labels[slot : slot + length] = labels[labels_at : labels_at + length]
            if has_loss_mask:
                mask_at = loss_mask_starts[sample]
                for t in range(length):
                    if not loss_mask[mask_at + t]:
                        out_labels[slot + t] = ignore_index
            # CP padding; positions count through it
            out_ids[slot + length : slot + padded] = padding_idx
            out_labels[slot + length : slot + padded] = ignore_index
            for t in range(padded):
                out_positions[slot + t] = t
            slot += padded
        # Tail padding continues the last position, clamped to pack_size - 1 (NeMo AutoModel's rule).
        end = (pack + 1) * pack_size
        last_position = out_positions[slot - 1]
        out_ids[slot:end] = padding_idx
        out_labels[slot:end] = ignore_index
        for t in range(slot, end):
            out_positions[t] = min(last_position + 1 + t - slot, pack_size - 1)
