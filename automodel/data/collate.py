"""Collation of packs into ``[B, S]`` batches for the THD path.

Shape legend: B = packs in the batch, S = packed_sequence_size, D = most samples in one pack.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from automodel.distributed.thd import SEQ_LENS_PADDING_VALUE

CROSS_ENTROPY_IGNORE_INDEX = -100

_TOKEN_KEYS = ("input_ids", "labels", "position_ids")
_LAYOUT_KEYS = ("seq_lens", "seq_lens_padded")


def packed_sequence_thd_collater(batch: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Stack packs (rows of :func:`pack_dataset`) into a batch.

    Args:
        batch: packs, each with ``input_ids``, ``labels``, ``position_ids`` of S entries and
            ``seq_lens``, ``seq_lens_padded`` of one entry per sample (lists, numpy arrays or tensors).

    Returns:
        ``input_ids``, ``labels``, ``position_ids``: int64 ``[B, S]``; ``seq_lens``,
        ``seq_lens_padded``: int64 ``[B, D]`` right-padded with -1000; ``qkv_format="thd"``.
        An empty batch gives ``{}``.

    Example::

        packs     seq_lens [3, 2] and [6]        ->  seq_lens [[3, 2], [6, -1000]]
    """
    if len(batch) == 0:
        return {}
    for i, pack in enumerate(batch):
        missing = [k for k in (*_TOKEN_KEYS, *_LAYOUT_KEYS) if k not in pack]
        if missing:
            raise ValueError(
                f"pack {i} lacks {missing}; packed_sequence_thd_collater takes rows of pack_dataset "
                f"(keys present: {sorted(pack)})"
            )
    sizes = [len(pack["input_ids"]) for pack in batch]
    if len(set(sizes)) > 1:
        raise ValueError(
            f"packs in one batch must have equal length (packed_sequence_size), got lengths {sizes}; "
            "pack every row with the same packed_sequence_size"
        )
    collated: dict[str, Any] = {}
    for key in _TOKEN_KEYS:
        rows = [np.asarray(pack[key]) for pack in batch]
        if any(len(row) != sizes[0] for row in rows):
            raise ValueError(f"{key} must have {sizes[0]} entries in every pack, like input_ids")
        collated[key] = torch.from_numpy(np.stack(rows).astype(np.int64, copy=False))
    for key in _LAYOUT_KEYS:
        collated[key] = _right_pad([np.asarray(pack[key]) for pack in batch], SEQ_LENS_PADDING_VALUE)
    collated["qkv_format"] = "thd"
    return collated


def _right_pad(rows: list[np.ndarray], pad_value: int) -> torch.Tensor:
    out = np.full((len(rows), max(len(row) for row in rows)), pad_value, dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return torch.from_numpy(out)


def padded_sequence_thd_collater(
    batch: Sequence[dict[str, Any]], padding_idx: int = 0, pad_to_multiple_of: int = 1
) -> dict[str, Any]:
    """Classic padded batches (``packing: none``) in the same output contract as packed ones.

    Each sample (``input_ids``, ``labels``, optional ``loss_mask``) fills one row, padded at its end
    to the longest sample rounded up to ``pad_to_multiple_of``; its padding is a padded tail of its
    only sequence, so the THD path and attention treat it exactly as pack padding.

    Example (samples of 3 and 1 tokens, pad_to_multiple_of=2)::

        input_ids [[5 6 7 0], [8 0 0 0]]   seq_lens [[3], [1]]   seq_lens_padded [[4], [4]]
    """
    if len(batch) == 0:
        return {}
    lengths = [len(sample["input_ids"]) for sample in batch]
    width = -(-max(lengths) // pad_to_multiple_of) * pad_to_multiple_of
    input_ids = np.full((len(batch), width), padding_idx, dtype=np.int64)
    labels = np.full((len(batch), width), CROSS_ENTROPY_IGNORE_INDEX, dtype=np.int64)
    for row, (sample, length) in enumerate(zip(batch, lengths)):
        input_ids[row, :length] = sample["input_ids"]
        sample_labels = np.asarray(sample["labels"])
        if "loss_mask" in sample:
            sample_labels = np.where(np.asarray(sample["loss_mask"]) != 0, sample_labels, CROSS_ENTROPY_IGNORE_INDEX)
        labels[row, :length] = sample_labels
    return {
        "input_ids": torch.from_numpy(input_ids),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.arange(width).expand(len(batch), width).contiguous(),
        "seq_lens": torch.tensor(lengths).unsqueeze(1),
        "seq_lens_padded": torch.full((len(batch), 1), width),
        "qkv_format": "thd",
    }
