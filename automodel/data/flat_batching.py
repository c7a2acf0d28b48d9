"""VeOmni's batching modes: flattened micro-batches without padding, fixed-size or token-budget.

``packing: rmpad`` (:class:`RmpadBatching`, VeOmni's ``rmpad_with_pos_ids`` with ``dyn_bsz`` off)
    ``micro_batch_size`` samples per micro-batch, flattened into ONE row with no padding between
    them. For SFT: every sample once per epoch, a fixed number of samples per step.
``packing: dyn_bsz`` (:class:`DynBszBatching`, ``dyn_bsz`` on)
    each micro-batch takes as many samples as fit a token budget, chosen largest-first from a
    bounded buffer of upcoming samples. For pretraining: a steady number of tokens per step.

Both emit the collater contract (``input_ids``, ``labels``, ``position_ids`` ``[1, T]``;
``seq_lens``, ``seq_lens_padded`` ``[1, D]``; ``qkv_format="thd"``), with positions restarting at 0
for every sample, so ``process_input_for_thd`` derives ``cu_seqlens`` from the sample lengths. With
``pad_packed_input`` a micro-batch is padded to a fixed length (static shapes for compiled kernels
and CUDA graphs): the padding is one more segment (see :func:`pad_packed_to_length`).

Under context parallelism (``cp_size`` W > 1) every sample is padded at its end to a multiple of 2W
(``seq_lens`` real, ``seq_lens_padded`` padded), so TE's dual-chunk sharding splits each sample.

An epoch is planned up front from the sample lengths, ``seed`` and the epoch number: the same plan
on every rank, micro-batch ``j`` of the epoch going to DP rank ``j % dp_size`` (the remainder that
cannot be dealt evenly is dropped and reported). The plan is a pure function of those inputs, so the
resumable state is the loader's position in it (``MicroBatchStream.state_dict``); for ``dyn_bsz``
the plan is exactly what the bounded-buffer online algorithm emits when fed the epoch's samples one
by one, so replaying it to a position restores the buffer it had there.

Shape legend: N = samples in the dataset, M = micro-batches in an epoch (all ranks), B = rows of a
collated batch (1 for these modes), T = tokens of a micro-batch, D = segments in a row.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import datasets
import numba
import numpy as np
import pyarrow.compute as pc
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from automodel.data.collate import CROSS_ENTROPY_IGNORE_INDEX
from automodel.data.loader import LoaderEnv, MicroBatchStream, check_positive_int
from automodel.data.planning import PackPlan
from automodel.distributed.thd import SEQ_LENS_PADDING_VALUE

logger = logging.getLogger(__name__)

COUNTS = ("tokens", "label_tokens")


# --------------------------------------------------------------------------------------------------
# Pure transforms: samples -> one flattened row -> (optionally) a fixed length
# --------------------------------------------------------------------------------------------------


def flatten_samples(
    samples: Sequence[Mapping[str, Any]], padding_idx: int = 0, cp_size: int = 1
) -> dict[str, Any]:
    """Concatenate samples into one row with no padding between them (``rmpad_with_pos_ids``).

    Args:
        samples: each with ``input_ids`` and ``labels`` (equal lengths, >= 1) and optionally
            ``loss_mask`` (0 turns the label into -100).
        padding_idx: token id of CP padding.
        cp_size: W; with W > 1 each sample is padded at its end to a multiple of 2W (tokens
            ``padding_idx``, labels -100, positions counting on) so that TE's CP sharding splits it.

    Returns:
        ``input_ids``, ``labels``, ``position_ids``: int64 ``[1, T]``; ``seq_lens`` (real lengths)
        and ``seq_lens_padded`` (CP-padded lengths, summing to T): int64 ``[1, D]`` with D samples;
        ``qkv_format="thd"``.

    Example (S1=[A B C D], S2=[E F])::

        input_ids       [[A B C D E F]]
        position_ids    [[0 1 2 3 0 1]]
        seq_lens        [[4 2]]          -> cu_seqlens [0 4 6]
        seq_lens_padded [[4 2]]

    With cp_size=2 (multiples of 4): input_ids [[A B C D E F 0 0]], position_ids
    [[0 1 2 3 0 1 2 3]], seq_lens [[4 2]], seq_lens_padded [[4 4]].
    """
    if len(samples) == 0:
        raise ValueError("flatten_samples needs at least one sample")
    multiple = 2 * cp_size if cp_size > 1 else 1
    lengths = np.empty(len(samples), np.int64)
    for i, sample in enumerate(samples):
        missing = [k for k in ("input_ids", "labels") if k not in sample]
        if missing:
            raise ValueError(
                f"sample {i} lacks {missing}; samples need input_ids and labels (keys: {sorted(sample)})"
            )
        lengths[i] = len(sample["input_ids"])
        for key in ("labels", "loss_mask"):
            if key in sample and len(sample[key]) != lengths[i]:
                raise ValueError(
                    f"sample {i}: {key} has {len(sample[key])} entries but input_ids has {lengths[i]}"
                )
    if lengths.min() == 0:
        raise ValueError(f"sample {int(np.argmin(lengths))} has an empty input_ids; remove empty samples")
    padded = -(-lengths // multiple) * multiple
    starts = np.cumsum(padded) - padded
    total = int(padded.sum())
    input_ids_T = np.full(total, padding_idx, np.int64)
    labels_T = np.full(total, CROSS_ENTROPY_IGNORE_INDEX, np.int64)
    for sample, start, length in zip(samples, starts, lengths):
        input_ids_T[start : start + length] = sample["input_ids"]
        labels = np.asarray(sample["labels"])
        if "loss_mask" in sample:
            labels = np.where(np.asarray(sample["loss_mask"]) != 0, labels, CROSS_ENTROPY_IGNORE_INDEX)
        labels_T[start : start + length] = labels
    position_ids_T = np.arange(total) - np.repeat(starts, padded)
    return {
        "input_ids": torch.from_numpy(input_ids_T).unsqueeze(0),
        "labels": torch.from_numpy(labels_T).unsqueeze(0),
        "position_ids": torch.from_numpy(position_ids_T).unsqueeze(0),
        "seq_lens": torch.from_numpy(lengths).unsqueeze(0),
        "seq_lens_padded": torch.from_numpy(padded).unsqueeze(0),
        "qkv_format": "thd",
    }


def pad_packed_to_length(
    batch: dict[str, Any], length: int, padding_idx: int = 0, cp_size: int = 1
) -> dict[str, Any]:
    """Pad every row of a collated batch to ``length`` tokens (``pad_packed_input``: static shapes).

    The padding is ONE extra segment per row: tokens ``padding_idx``, labels -100, positions
    counting from 0. It is appended to both ``seq_lens`` and ``seq_lens_padded`` (real length =
    padded length), so ``process_input_for_thd`` recomputes ``cu_seqlens``, ``cu_seqlens_padded``
    and ``max_seqlen`` with it as a sequence of its own: attention runs over it (isolated from the
    real samples, and without padding between sequences, which FlashAttention needs), its labels
    are ignored by the loss, and ``padding_mask`` is False on it (that mask covers only the CP
    padding inside a sample's padded length). A row already ``length`` long is left as it is.

    Args:
        batch: ``input_ids``, ``labels``, ``position_ids`` ``[B, S]``; ``seq_lens`` and
            ``seq_lens_padded`` ``[B, D]`` right-padded with -1000. Other keys pass through.
        length: L >= S, the fixed row length. With ``cp_size`` W > 1, L - S must be a multiple
            of 2W so that the pad segment splits into 2W chunks like every sample.
        padding_idx: token id of the padding.
        cp_size: W, the context-parallel size the batch was built for.

    Returns:
        The batch with rows of L tokens and ``[B, D']`` layout tensors (D' = D or D + 1).

    Example (L=8)::

        input_ids    [[A B C D E F]]     ->  [[A B C D E F 0 0]]
        position_ids [[0 1 2 3 0 1]]     ->  [[0 1 2 3 0 1 0 1]]
        seq_lens     [[4 2]]             ->  [[4 2 2]]          cu_seqlens [0 4 6] -> [0 4 6 8]
    """
    input_ids = batch["input_ids"]
    num_rows, size = input_ids.shape[:2]
    multiple = 2 * cp_size if cp_size > 1 else 1
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)):
        raise ValueError(f"length must be an int, got {length!r}")
    if size > length:
        raise ValueError(
            f"the micro-batch holds {size} tokens, more than pad_packed_to_length={length}; raise "
            "pad_packed_to_length or lower the micro-batch's size (micro_batch_size, max_seq_len or the token budget)"
        )
    if (length - size) % multiple:
        raise ValueError(
            f"padding {size} tokens to {length} adds a segment of {length - size}, not a multiple of "
            f"2*cp_size={multiple}; use a pad_packed_to_length that is a multiple of {multiple}"
        )
    if size == length:
        return dict(batch)
    pad = length - size
    padded = dict(batch)
    padded["input_ids"] = torch.cat(
        [input_ids, input_ids.new_full((num_rows, pad, *input_ids.shape[2:]), padding_idx)], 1
    )
    labels = batch["labels"]
    padded["labels"] = torch.cat([labels, labels.new_full((num_rows, pad), CROSS_ENTROPY_IGNORE_INDEX)], 1)
    positions = batch["position_ids"]
    padded["position_ids"] = torch.cat(
        [positions, torch.arange(pad, dtype=positions.dtype).expand(num_rows, pad)], 1
    )
    for key in ("seq_lens", "seq_lens_padded"):
        padded[key] = _append_segment(batch[key], pad)
    return padded


def _append_segment(seq_lens_BD: torch.Tensor, value: int) -> torch.Tensor:
    """Write ``value`` into each row's first sentinel slot, widening by one column where needed."""
    used_B = (seq_lens_BD != SEQ_LENS_PADDING_VALUE).sum(1)
    width = int(used_B.max()) + 1
    out = seq_lens_BD.new_full(
        (seq_lens_BD.shape[0], max(width, seq_lens_BD.shape[1])), SEQ_LENS_PADDING_VALUE
    )
    out[:, : seq_lens_BD.shape[1]] = seq_lens_BD
    out[torch.arange(len(out)), used_B] = value
    return out[:, :width]


# --------------------------------------------------------------------------------------------------
# Planning: which samples form which micro-batch, from lengths alone
# --------------------------------------------------------------------------------------------------


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

    Args:
        order: ``[K]`` sample indices in arrival order.
        weights: ``[N]`` what the budget counts per sample (slots, or label tokens).
        sizes: ``[N]`` physical slots per sample (length rounded up for CP).
        budget: most weight per micro-batch.
        max_size: most slots per micro-batch (equal to ``budget`` when weights are sizes).
        buffer_size: samples the buffer holds.

    Returns:
        A :class:`PackPlan` of the micro-batches in the order they are emitted.

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


def plan_fixed_size(order: np.ndarray, micro_batch_size: int) -> PackPlan:
    """``micro_batch_size`` consecutive samples of ``order`` per micro-batch; a last partial one is
    left out (``rmpad`` with ``dyn_bsz`` off).

    Example: order [3 0 2 1 4], micro_batch_size 2 -> micro-batches [3 0], [2 1]; sample 4 left out.
    """
    num_batches = len(order) // micro_batch_size
    offsets = np.arange(num_batches + 1, dtype=np.int64) * micro_batch_size
    return PackPlan(np.asarray(order[: offsets[-1]], dtype=np.int64), offsets)


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """``[num_samples]`` sample order of one epoch: a permutation drawn from (seed, epoch), or 0..N-1."""
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    return np.random.default_rng((seed, epoch)).permutation(num_samples).astype(np.int64)


# --------------------------------------------------------------------------------------------------
# The stream: a per-epoch plan dealt to DP ranks, materialized one micro-batch at a time
# --------------------------------------------------------------------------------------------------


class _PlannedMicroBatches(torch.utils.data.Dataset):
    """Map-style dataset whose item ``k`` is this DP rank's ``k``-th micro-batch of the current epoch:
    micro-batch ``k * dp_size + dp_rank`` of the epoch's plan (so all ranks get the same count)."""

    def __init__(
        self,
        rows: datasets.Dataset,
        kept: np.ndarray,
        plan_epoch: Callable[[np.ndarray], PackPlan],
        env: LoaderEnv,
        shuffle: bool,
        collate: Callable[[list[dict[str, Any]]], dict[str, Any]],
    ):
        self.rows = rows
        self.kept = kept  # [N'] dataset rows that can be batched at all
        self.plan_epoch = plan_epoch
        self.env = env
        self.shuffle = shuffle
        self.collate = collate
        self.epoch = -1
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            order = self.kept[epoch_order(len(self.kept), self.env.seed, epoch, self.shuffle)]
            self.plan = self.plan_epoch(order)
            self.epoch = epoch

    def __len__(self) -> int:
        return self.plan.num_packs // self.env.dp_size

    def __getitem__(self, k: int) -> dict[str, Any]:
        if not 0 <= k < len(self):
            raise IndexError(k)
        batch = k * self.env.dp_size + self.env.dp_rank
        indices = self.plan.sample_order[self.plan.pack_offsets[batch] : self.plan.pack_offsets[batch + 1]]
        columns = self.rows[indices.tolist()]
        samples = [dict(zip(columns, values)) for values in zip(*columns.values())]
        return self.collate(samples)

    def left_out(self) -> int:
        """Samples of this epoch in no micro-batch that a rank gets (the plan's remainder, and the
        last ``M % dp_size`` micro-batches)."""
        return len(self.kept) - int(self.plan.pack_offsets[len(self) * self.env.dp_size])


def _identity(batch: dict[str, Any]) -> dict[str, Any]:
    return batch


def _collate(
    samples: list[dict[str, Any]], padding_idx: int, cp_size: int, length: int | None
) -> dict[str, Any]:
    batch = flatten_samples(samples, padding_idx, cp_size)
    return batch if length is None else pad_packed_to_length(batch, length, padding_idx, cp_size)


def _planned_stream(
    dataset: datasets.Dataset,
    kept: np.ndarray,
    plan_epoch: Callable[[np.ndarray], PackPlan],
    env: LoaderEnv,
    *,
    mode: str,
    cp_size: int,
    length: int | None,
    shuffle: bool,
    num_workers: int,
) -> MicroBatchStream:
    columns = [c for c in ("input_ids", "labels", "loss_mask") if c in dataset.column_names]
    rows = dataset.select_columns(columns).with_format("numpy")
    collate = functools.partial(_collate, padding_idx=env.padding_idx, cp_size=cp_size, length=length)
    micro_batches = _PlannedMicroBatches(rows, kept, plan_epoch, env, shuffle, collate)
    left_out = micro_batches.left_out()
    if left_out:
        logger.warning(
            "packing %s: %d of %d samples (%.3f%%) left out of epoch 0 (each epoch drops about as many): "
            "the epoch's remainder that does not fill micro-batches dealt evenly to %d data-parallel rank(s)",
            mode,
            left_out,
            len(dataset),
            100 * left_out / len(dataset),
            env.dp_size,
        )
    loader = StatefulDataLoader(micro_batches, batch_size=None, collate_fn=_identity, num_workers=num_workers)
    return MicroBatchStream(loader, micro_batches.set_epoch)


def _sample_stats(dataset: datasets.Dataset, label_counts: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """Tokens ``[N]`` and, if asked, label tokens ``[N]`` (label != -100 where loss_mask != 0) per sample."""
    missing = [c for c in ("input_ids", "labels") if c not in dataset.column_names]
    if missing:
        raise ValueError(f"dataset lacks column(s) {missing}; the batching modes need input_ids and labels")
    if len(dataset) == 0:
        raise ValueError("dataset is empty: nothing to batch")
    columns = ["input_ids", "labels"] + (["loss_mask"] if "loss_mask" in dataset.column_names else [])
    table = dataset.select_columns(columns).with_format("arrow")[:]
    lengths = {
        c: pc.list_value_length(table.column(c)).to_numpy(zero_copy_only=False).astype(np.int64)
        for c in columns
    }
    tokens = lengths["input_ids"]
    if tokens.min() == 0:
        raise ValueError(f"sample {int(np.argmin(tokens))} has an empty input_ids; remove empty samples")
    for column in columns[1:]:
        bad = np.flatnonzero(lengths[column] != tokens)
        if len(bad):
            i = int(bad[0])
            raise ValueError(
                f"sample {i}: {column} has {lengths[column][i]} entries but input_ids has {tokens[i]}"
            )
    if not label_counts:
        return tokens, None
    learnable = pc.not_equal(pc.list_flatten(table.column("labels")), CROSS_ENTROPY_IGNORE_INDEX)
    if "loss_mask" in columns:
        learnable = pc.and_(learnable, pc.not_equal(pc.list_flatten(table.column("loss_mask")), 0))
    cumulative = np.concatenate([[0], np.cumsum(learnable.to_numpy(zero_copy_only=False), dtype=np.int64)])
    ends = np.cumsum(tokens)
    return tokens, cumulative[ends] - cumulative[ends - tokens]


def _report_too_long(mode: str, too_long: np.ndarray, what: str) -> None:
    if too_long.any():
        logger.warning(
            "packing %s: dropped %d of %d samples (%.3f%%) %s",
            mode,
            int(too_long.sum()),
            len(too_long),
            100 * too_long.mean(),
            what,
        )


# --------------------------------------------------------------------------------------------------
# The two ``packing`` config sections
# --------------------------------------------------------------------------------------------------


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"packing.{name} must be true or false, got {value!r}")


def _check_num_workers(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"packing.num_workers must be an int >= 0, got {value!r}")


def _check_padding(
    pad_packed_input: bool,
    pad_packed_to_length: int | None,
    static_length: int | None,
    most_tokens: int,
    what: str,
    cp_size: int,
) -> None:
    """The fixed length must hold the longest micro-batch and keep every segment CP-divisible."""
    _check_bool("pad_packed_input", pad_packed_input)
    if pad_packed_to_length is not None:
        check_positive_int("packing.pad_packed_to_length", pad_packed_to_length)
        if not pad_packed_input:
            raise ValueError(
                f"packing.pad_packed_to_length={pad_packed_to_length} has no effect without "
                "packing.pad_packed_input=true; set it or remove pad_packed_to_length"
            )
    if static_length is None:
        return
    if static_length < most_tokens:
        raise ValueError(
            f"packing.pad_packed_to_length={static_length} is shorter than the longest possible micro-batch "
            f"({what} = {most_tokens}); use pad_packed_to_length >= {most_tokens}"
        )
    if cp_size > 1 and static_length % (2 * cp_size):
        raise ValueError(
            f"packing.pad_packed_to_length={static_length} must be a multiple of 2*cp_size={2 * cp_size} so that "
            "the pad segment splits into 2*cp_size chunks like every CP-padded sample; use "
            f"{-(-static_length // (2 * cp_size)) * 2 * cp_size} (or a max_seq_len / budget that is a multiple of "
            f"{2 * cp_size})"
        )


@dataclass
class RmpadBatching:
    """``packing: rmpad``: ``micro_batch_size`` samples per micro-batch, flattened into one row.

    The SFT mode (VeOmni's ``rmpad_with_pos_ids`` with ``dyn_bsz`` off): every sample exactly once
    per epoch, in an order shuffled per epoch with the run's seed, disjoint across DP ranks. What
    cannot be split evenly (fewer than ``dp_size * micro_batch_size`` samples at the end of the
    epoch) is dropped and reported, like ``DistributedSampler(drop_last=True)``. The row length
    varies with the samples drawn unless ``pad_packed_input`` is set.

    Example (S1=[A B C D], S2=[E F], S3=[G H I], S4=[J], micro_batch_size 2, no shuffle)::

        [A B C D E F] positions [0 1 2 3 0 1]     then     [G H I J] positions [0 1 2 0]

    Attributes:
        micro_batch_size: samples per micro-batch.
        max_seq_len: longest sample kept (after CP padding); longer samples are dropped and
            reported. Truncate long samples in the data section (``data.max_length``) instead to keep them.
        cp_size: W, set to the run's CP size (the recipes interpolate ``${parallel.cp_size}``); each
            sample is padded to a multiple of 2W.
        pad_packed_input: pad every micro-batch to ``pad_packed_to_length`` tokens (one extra
            segment, see :func:`pad_packed_to_length`).
        pad_packed_to_length: the fixed length; default ``micro_batch_size * max_seq_len``, the
            longest micro-batch possible. Must be at least that, and a multiple of 2W.
    """

    micro_batch_size: int = 1
    max_seq_len: int = 2048
    cp_size: int = 1
    pad_packed_input: bool = False
    pad_packed_to_length: int | None = None
    shuffle: bool = True
    num_workers: int = 0

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "max_seq_len", "cp_size"):
            check_positive_int(f"packing.{name}", getattr(self, name))
        _check_bool("shuffle", self.shuffle)
        _check_num_workers(self.num_workers)
        _check_padding(
            self.pad_packed_input,
            self.pad_packed_to_length,
            self.static_length,
            self.micro_batch_size * self.max_seq_len,
            "micro_batch_size * max_seq_len",
            self.cp_size,
        )

    @property
    def static_length(self) -> int | None:
        """Tokens of every micro-batch with ``pad_packed_input``, else None (lengths vary)."""
        if not self.pad_packed_input:
            return None
        return self.pad_packed_to_length or self.micro_batch_size * self.max_seq_len

    def build(self, dataset: datasets.Dataset, env: LoaderEnv) -> MicroBatchStream:
        lengths, _ = _sample_stats(dataset, label_counts=False)
        multiple = 2 * self.cp_size if self.cp_size > 1 else 1
        too_long = -(-lengths // multiple) * multiple > self.max_seq_len
        _report_too_long(
            "rmpad",
            too_long,
            f"longer than max_seq_len={self.max_seq_len}"
            + (f" after padding to a multiple of {multiple}" if multiple > 1 else ""),
        )
        plan_epoch = functools.partial(plan_fixed_size, micro_batch_size=self.micro_batch_size)
        return _planned_stream(
            dataset,
            np.flatnonzero(~too_long),
            plan_epoch,
            env,
            mode="rmpad",
            cp_size=self.cp_size,
            length=self.static_length,
            shuffle=self.shuffle,
            num_workers=self.num_workers,
        )


@dataclass
class DynBszBatching:
    """``packing: dyn_bsz``: each micro-batch takes as many samples as fit a token budget.

    The pretraining mode (VeOmni's ``dyn_bsz``): steps see a near-constant number of tokens instead
    of a constant number of samples. Samples arrive in an order shuffled per epoch; a buffer of
    ``buffer_size`` holds the next ones, and each micro-batch takes, largest first, every buffered
    sample that still fits (:func:`plan_token_budget`). On the lognormal benchmark (budget 4096,
    buffer 200) this is within 0.3% of the fewest micro-batches possible; VeOmni's arrival-order
    scan of the same buffer is at 0.5%. Every sample that fits is used once per epoch, except the
    samples of the last ``M % dp_size`` micro-batches (dropped and reported).

    Example (S1=[A B C D], S2=[E F], S3=[G H I], S4=[J], budget 10)::

        [A B C D E F G H I J] positions [0 1 2 3 0 1 0 1 2 0]

    Attributes:
        max_tokens_per_micro_batch: the budget, counted as ``count`` says.
        count: ``"tokens"``: the slots a sample occupies (its length rounded up to 2W under CP), so
            the budget is also the hard cap on a micro-batch's length. ``"label_tokens"``: its
            label tokens (loss_mask != 0 and label != -100), which balances the loss weight of
            micro-batches; the physical length is then capped by ``max_packed_length``.
        max_packed_length: with ``count="label_tokens"`` (required there), the most slots a
            micro-batch may occupy; at least ``max_tokens_per_micro_batch``.
        buffer_size: samples the buffer holds (VeOmni's default is 200).
        cp_size: W (``${parallel.cp_size}``); each sample is padded to a multiple of 2W.
        pad_packed_input: pad every micro-batch to ``pad_packed_to_length`` (one extra segment).
        pad_packed_to_length: the fixed length; default the hard cap on a micro-batch's length.
            Samples that alone exceed the cap (or, with label_tokens, the budget) are dropped and reported.
    """

    max_tokens_per_micro_batch: int = 4096
    count: str = "tokens"
    max_packed_length: int | None = None
    buffer_size: int = 200
    cp_size: int = 1
    pad_packed_input: bool = False
    pad_packed_to_length: int | None = None
    shuffle: bool = True
    num_workers: int = 0

    def __post_init__(self) -> None:
        for name in ("max_tokens_per_micro_batch", "buffer_size", "cp_size"):
            check_positive_int(f"packing.{name}", getattr(self, name))
        _check_bool("shuffle", self.shuffle)
        _check_num_workers(self.num_workers)
        if self.max_packed_length is not None:
            check_positive_int("packing.max_packed_length", self.max_packed_length)
        if self.count not in COUNTS:
            raise ValueError(f"packing.count must be one of {COUNTS}, got {self.count!r}")
        if self.count == "tokens" and self.max_packed_length is not None:
            raise ValueError(
                "packing.max_packed_length applies only to count=label_tokens; with count=tokens the budget "
                "max_tokens_per_micro_batch is the length cap: remove max_packed_length"
            )
        if self.count == "label_tokens":
            if self.max_packed_length is None:
                raise ValueError(
                    "packing.count=label_tokens needs packing.max_packed_length, the hard cap on a micro-batch's "
                    f"length in tokens (e.g. {2 * self.max_tokens_per_micro_batch})"
                )
            if self.max_packed_length < self.max_tokens_per_micro_batch:
                raise ValueError(
                    f"packing.max_packed_length={self.max_packed_length} < max_tokens_per_micro_batch="
                    f"{self.max_tokens_per_micro_batch}: the label budget could never be reached; raise "
                    "max_packed_length or use count=tokens"
                )
        _check_padding(
            self.pad_packed_input,
            self.pad_packed_to_length,
            self.static_length,
            self.length_cap,
            "max_packed_length" if self.count == "label_tokens" else "max_tokens_per_micro_batch",
            self.cp_size,
        )

    @property
    def length_cap(self) -> int:
        """The most tokens (CP padding included) a micro-batch may hold."""
        return self.max_packed_length if self.count == "label_tokens" else self.max_tokens_per_micro_batch

    @property
    def static_length(self) -> int | None:
        """Tokens of every micro-batch with ``pad_packed_input``, else None (lengths vary)."""
        if not self.pad_packed_input:
            return None
        return self.pad_packed_to_length or self.length_cap

    def build(self, dataset: datasets.Dataset, env: LoaderEnv) -> MicroBatchStream:
        lengths, label_tokens = _sample_stats(dataset, label_counts=self.count == "label_tokens")
        multiple = 2 * self.cp_size if self.cp_size > 1 else 1
        sizes = -(-lengths // multiple) * multiple
        weights = sizes if label_tokens is None else label_tokens
        too_long = (sizes > self.length_cap) | (weights > self.max_tokens_per_micro_batch)
        _report_too_long(
            "dyn_bsz",
            too_long,
            f"that alone exceed the length cap {self.length_cap}"
            + (f" (after padding to a multiple of {multiple})" if multiple > 1 else "")
            + (f" or the label budget {self.max_tokens_per_micro_batch}" if label_tokens is not None else ""),
        )
        plan_epoch = functools.partial(
            plan_token_budget,
            weights=weights,
            sizes=sizes,
            budget=self.max_tokens_per_micro_batch,
            max_size=self.length_cap,
            buffer_size=self.buffer_size,
        )
        stream = _planned_stream(
            dataset,
            np.flatnonzero(~too_long),
            plan_epoch,
            env,
            mode="dyn_bsz",
            cp_size=self.cp_size,
            length=self.static_length,
            shuffle=self.shuffle,
            num_workers=self.num_workers,
        )
        plan = stream.loader.dataset.plan
        kept = ~too_long
        bound = max(
            -(-int(weights[kept].sum()) // self.max_tokens_per_micro_batch),
            -(-int(sizes[kept].sum()) // self.length_cap),
        )
        logger.info(
            "packing dyn_bsz: epoch 0 has %d micro-batches, %+.3f%% over the lower bound %d",
            plan.num_packs,
            100 * (plan.num_packs / max(1, bound) - 1),
            bound,
        )
        return stream
