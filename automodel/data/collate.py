"""Collation of packs into ``[B, S]`` batches for the THD path.

Shape legend: B = packs in the batch, S = packed_sequence_size, D = most samples in one pack.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from automodel.distributed.thd import SEQ_LENS_PADDING_VALUE

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
