"""The one row builder and the collater: samples -> rows -> ``[B, S]`` batches for the THD path.

Shape legend: B = rows in the batch, S = tokens of a row, D = most sequences in one row.

The layout rules, shared by every batching mode (and by :func:`pack_dataset`'s compiled kernel):

- with ``cp_size`` W > 1 every sample is padded at its end to a multiple of 2W (tokens
  ``padding_idx``, labels -100) so that TE's dual-chunk CP sharding splits it;
- positions restart at 0 for each sample and count through its CP padding;
- ``loss_mask`` 0 turns the label into -100;
- tail padding (to a fixed row length) joins the LAST sample's padded length and continues its
  positions (clamped to S-1): it is padding, never counted as real (``seq_lens`` stay real lengths).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from automodel.distributed.thd import SEQ_LENS_PADDING_VALUE, BatchKeyError
from automodel.distributed.thd_checks import check_integers
from automodel.loss import CROSS_ENTROPY_IGNORE_INDEX

_TOKEN_KEYS = ("input_ids", "labels", "position_ids")
_LAYOUT_KEYS = ("seq_lens", "seq_lens_padded")


def cp_multiple(cp_size: int, pad_to_multiple_of: int = 1) -> int:
    """Every sample's padded length is a multiple of this: ``2 * cp_size`` under CP (else 1), and of
    ``pad_to_multiple_of``."""
    return math.lcm(2 * cp_size if cp_size > 1 else 1, pad_to_multiple_of)


def cp_padded(lengths: np.ndarray, cp_size: int, pad_to_multiple_of: int = 1) -> np.ndarray:
    """``[N]`` lengths rounded up to a multiple of :func:`cp_multiple` (each sample's CP-padded length)."""
    multiple = cp_multiple(cp_size, pad_to_multiple_of)
    return -(-lengths // multiple) * multiple


def build_row(
    samples: Sequence[Mapping[str, Any]], padding_idx: int = 0, cp_size: int = 1, length: int | None = None
) -> dict[str, np.ndarray]:
    """Lay samples out back to back in one row (the layout rules above).

    Args:
        samples: each with ``input_ids`` and ``labels`` (equal lengths >= 1), optional ``loss_mask``.
        padding_idx: token id of padding.
        cp_size: W; each sample is padded to a multiple of 2W.
        length: the row length; ``None`` ends the row after the last (CP-padded) sample.

    Returns:
        ``input_ids``, ``labels``, ``position_ids`` int64 ``[S]``; ``seq_lens`` (real) and
        ``seq_lens_padded`` (summing to S) int64 ``[D]``.

    Example (length 8, samples [A B C D] and [E F])::

        input_ids [A B C D E F 0 0]   position_ids [0 1 2 3 0 1 2 3]
        seq_lens  [4 2]               seq_lens_padded [4 4]      (real tokens: 6)
    """
    if len(samples) == 0:
        raise ValueError("samples is empty: a row needs at least one sample")
    lengths = np.array([len(sample["input_ids"]) for sample in samples], np.int64)
    multiple = cp_multiple(cp_size)
    padded = cp_padded(lengths, cp_size)
    total = int(padded.sum())
    size = total if length is None else length
    if size < total or (size - total) % multiple:
        raise ValueError(
            f"length={length} must be >= the {total} tokens of the row and exceed them by a multiple of "
            f"2*cp_size={multiple}; raise the row length (pad_packed_to_length)"
        )
    padded[-1] += size - total
    starts = np.cumsum(padded) - padded
    input_ids = np.full(size, padding_idx, np.int64)
    labels = np.full(size, CROSS_ENTROPY_IGNORE_INDEX, np.int64)
    for sample, start, n in zip(samples, starts, lengths):
        input_ids[start : start + n] = sample["input_ids"]
        sample_labels = np.asarray(sample["labels"])
        if sample.get("loss_mask") is not None:
            sample_labels = np.where(
                np.asarray(sample["loss_mask"]) != 0, sample_labels, CROSS_ENTROPY_IGNORE_INDEX
            )
        labels[start : start + n] = sample_labels
    positions = np.arange(size) - np.repeat(starts, padded)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": np.minimum(positions, size - 1),
        "seq_lens": lengths,
        "seq_lens_padded": padded,
    }


class RowLengthError(ValueError, RuntimeError):
    """Rows of a batch that cannot be stacked. Also a ``RuntimeError``: NeMo AutoModel's collater
    raises that (from ``torch.stack``) and its callers catch it."""


PAD_TOKEN_IDS_KEY = "___PAD_TOKEN_IDS___"  # NeMo AutoModel's per-sample pad id metadata


def packed_sequence_thd_collater(batch: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Stack rows (of :func:`pack_dataset` or :func:`build_row`) into a batch.

    Args:
        batch: rows, each with ``input_ids``, ``labels``, ``position_ids`` of S entries and
            ``seq_lens``, ``seq_lens_padded`` of one entry per sample (lists, numpy arrays or tensors).
            Or unpacked samples (no ``seq_lens``): ``input_ids``, ``labels``, optional
            ``attention_mask`` (1s then 0s: the 0s are padding) and ``loss_mask``, optional
            ``___PAD_TOKEN_IDS___`` metadata (its ``input_ids`` entry is the pad id, else 0);
            each becomes one sequence of a row as long as the longest sample (:func:`build_row`).

    Returns:
        ``input_ids``, ``labels``, ``position_ids``: int64 ``[B, S]``; ``seq_lens``,
        ``seq_lens_padded``: int64 ``[B, D]`` right-padded with -1000; ``qkv_format="thd"``.
        An empty batch gives ``{}``.

    Raises:
        RowLengthError: rows of different lengths (a ``ValueError`` and a ``RuntimeError``).

    Example::

        packs     seq_lens [3, 2] and [6]        ->  seq_lens [[3, 2], [6, -1000]]
        samples   attention_mask [1 1 0] and [1] ->  seq_lens [[2], [1]]   seq_lens_padded [[3], [3]]
    """
    if isinstance(batch, Mapping) or not all(isinstance(row, Mapping) for row in batch):
        other = next((type(r).__name__ for r in batch if not isinstance(r, Mapping)), "")
        given = "a " + type(batch).__name__ if isinstance(batch, Mapping) else f"a row of type {other}"
        raise TypeError(
            f"packed_sequence_thd_collater takes a list of rows (dicts), got {given}; one row: "
            "packed_sequence_thd_collater([row])"
        )
    if len(batch) == 0:
        return {}
    packed = ["seq_lens" in row for row in batch]
    if not any(packed):
        batch = _rows_of_samples(batch)
    elif not all(packed):
        raise ValueError(
            f"row {packed.index(False)} lacks seq_lens but row {packed.index(True)} has them: a batch holds either "
            "packed rows (pack_dataset) or unpacked samples, not both"
        )
    for i, pack in enumerate(batch):
        missing = [k for k in (*_TOKEN_KEYS, *_LAYOUT_KEYS) if k not in pack]
        if missing:
            raise ValueError(
                f"pack {i} lacks {missing}: give rows of pack_dataset (keys present: {sorted(pack)})"
            )
        for key in (*_TOKEN_KEYS, *_LAYOUT_KEYS):
            check_integers(pack[key], f"pack {i}: {key}", ndim=1)
    collated: dict[str, Any] = {}
    for key in _TOKEN_KEYS:
        rows = [np.asarray(pack[key]) for pack in batch]
        if len({len(row) for row in rows}) > 1 or len(rows[0]) != len(batch[0]["input_ids"]):
            raise RowLengthError(  # the torch.stack wording NeMo AutoModel's callers may match on
                f"{key}: every row of a batch must have the same length (packed_sequence_size), got "
                f"{[len(row) for row in rows]}: stack expects each tensor to be equal size"
            )
        collated[key] = torch.from_numpy(np.stack(rows).astype(np.int64, copy=False))
    for key in _LAYOUT_KEYS:
        rows = [torch.as_tensor(np.asarray(pack[key]), dtype=torch.int64) for pack in batch]
        collated[key] = pad_sequence(rows, batch_first=True, padding_value=SEQ_LENS_PADDING_VALUE)
    collated["qkv_format"] = "thd"
    return collated


def _rows_of_samples(samples: Sequence[Mapping[str, Any]]) -> list[dict[str, np.ndarray]]:
    """Unpacked samples -> one row each, as long as the longest; a sample's real tokens end where
    its ``attention_mask`` turns 0."""
    padding_idx = (samples[0].get(PAD_TOKEN_IDS_KEY) or {}).get("input_ids") or 0
    width = max(len(sample.get("input_ids", ())) for sample in samples)
    if width == 0:
        raise ValueError(f"every one of the {len(samples)} samples is empty: nothing to collate")
    rows = []
    for i, sample in enumerate(samples):
        missing = [k for k in ("input_ids", "labels") if k not in sample]
        if missing:
            raise BatchKeyError(f"sample {i} lacks {missing} (keys present: {sorted(sample)})")
        length = len(sample["input_ids"])
        lengths = {
            k: len(sample[k]) for k in ("labels", "loss_mask", "attention_mask") if sample.get(k) is not None
        }
        if any(n != length for n in lengths.values()):
            raise ValueError(f"sample {i}: input_ids has {length} entries but {lengths}")
        real = length
        if sample.get("attention_mask") is not None:
            mask = np.asarray(sample["attention_mask"]) != 0
            real = int(mask.sum())
            if not mask[:real].all():
                raise ValueError(
                    f"sample {i}: attention_mask must be 1s followed by 0s (right padding), got "
                    f"{mask.astype(int).tolist()}; left padding or gaps have no THD layout"
                )
        kept = {
            k: np.asarray(sample[k])[:real]
            for k in ("input_ids", "labels", "loss_mask")
            if sample.get(k) is not None
        }
        rows.append(build_row([kept], padding_idx, length=width))
    return rows


def padded_sequence_thd_collater(
    batch: Sequence[dict[str, Any]], padding_idx: int = 0, cp_size: int = 1
) -> dict[str, Any]:
    """Classic padded batches (``packing: none``): one sample per row, padded to the longest
    sample of the batch (rounded up to a multiple of 2W) by the tail-padding rule.

    Example (samples of 3 and 1 tokens, cp_size=1)::

        input_ids [[5 6 7], [8 0 0]]   seq_lens [[3], [1]]   seq_lens_padded [[3], [3]]
    """
    if len(batch) == 0:
        return {}
    width = int(cp_padded(max(len(sample["input_ids"]) for sample in batch), cp_size))
    return packed_sequence_thd_collater(
        [build_row([sample], padding_idx, cp_size, width) for sample in batch]
    )
