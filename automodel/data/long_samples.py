"""``data.long_samples``: a sample longer than the limit is ``split`` into pieces, ``truncate``-d or
``drop``-ped, and the log counts rows and tokens for each choice.

A sample is n aligned next-token positions (``input_ids``, ``labels``, ``loss_mask``: see
:func:`automodel.data.sft.shift_for_next_token`); the limit L is ``data.max_length``, else the most
tokens the batching mode fits in a row. ``split`` cuts it into ``ceil(n / L)`` pieces of L positions
(the last one shorter), each its own sequence in a pack (THD: positions restart at 0, no attention
to the piece before), so every label is learned exactly once; this is how pretraining pipelines cut
documents (the first tokens of a piece see none of the text before it). ``truncate`` keeps the
first L positions, ``drop`` drops the sample. Pure numpy on lengths; :func:`cut_rows` applies the
plan to Arrow list columns.

Example (L = 4, samples of 10 and 3 positions)::

    split     pieces (row, start, length): (0, 0, 4) (0, 4, 4) (0, 8, 2) (1, 0, 3)   nothing lost
    truncate  (0, 0, 4) (1, 0, 3)                                                   6 positions lost
    drop      (1, 0, 3)                                                             10 positions lost
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

logger = logging.getLogger(__name__)

LONG_SAMPLES = ("split", "truncate", "drop")


@dataclass(frozen=True)
class Pieces:
    """The samples after the rule: piece k is positions ``[starts[k], starts[k] + lengths[k])`` of
    input row ``rows[k]``; all ``[K]`` int64, in row order."""

    rows: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray


def check_long_samples(value: str, field: str = "data.long_samples") -> None:
    if value not in LONG_SAMPLES:
        raise ValueError(
            f"{field}={value!r}: must be one of {LONG_SAMPLES} (split: pieces that fit, no token lost)"
        )


def plan_pieces(lengths_N: np.ndarray, limit: int | None, mode: str) -> Pieces:
    """The pieces of rows of ``lengths_N`` positions under ``mode`` and ``limit`` (None: no limit).

    Example: ``plan_pieces([10, 3], 4, "split")`` -> rows ``[0 0 0 1]``, starts ``[0 4 8 0]``,
    lengths ``[4 4 2 3]``."""
    check_long_samples(mode, "long_samples")
    lengths_N = np.asarray(lengths_N, np.int64)
    rows = np.arange(len(lengths_N), dtype=np.int64)
    if limit is None or not (lengths_N > limit).any():
        return Pieces(rows, np.zeros_like(rows), lengths_N.copy())
    if mode == "drop":
        rows = rows[lengths_N <= limit]
        return Pieces(rows, np.zeros_like(rows), lengths_N[rows])
    if mode == "truncate":
        return Pieces(rows, np.zeros_like(rows), np.minimum(lengths_N, limit))
    counts = np.maximum(1, -(-lengths_N // limit))
    rows = np.repeat(rows, counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    starts = (np.arange(len(rows), dtype=np.int64) - first) * limit
    return Pieces(rows, starts, np.minimum(limit, lengths_N[rows] - starts))


@dataclass(frozen=True)
class LongSampleReport:
    """Rows and tokens (positions; ``learned``: those with loss_mask 1) before and after the rule."""

    mode: str
    limit: int
    rows: int
    long_rows: int
    pieces: int  # samples out of the long rows (split: pieces; truncate: long_rows; drop: 0)
    tokens: int
    long_tokens: int  # tokens of the long rows
    lost_tokens: int
    learned: int
    lost_learned: int

    def __str__(self) -> str:
        rows = f"{self.long_rows:,} of {self.rows:,} rows ({_share(self.long_rows, self.rows)})"
        tokens = f"{self.long_tokens:,} of {self.tokens:,} tokens ({_share(self.long_tokens, self.tokens)})"
        if self.mode == "split":
            return (
                f"split {rows} longer than {self.limit} tokens into {self.pieces:,} pieces: {tokens} in pieces, "
                "no token lost (data.long_samples=split)"
            )
        lost = (
            f"{self.lost_tokens:,} of {self.tokens:,} tokens lost ({_share(self.lost_tokens, self.tokens)}), "
            f"{self.lost_learned:,} of {self.learned:,} learned tokens ({_share(self.lost_learned, self.learned)})"
        )
        what = (
            f"truncated {rows} to {self.limit} tokens"
            if self.mode == "truncate"
            else (f"dropped {rows} longer than {self.limit} tokens")
        )
        return f"{what}: {lost}; data.long_samples=split keeps every token"


def _share(part: int, whole: int) -> str:
    return f"{100 * part / max(1, whole):.2f}%"


def report(
    lengths_N: np.ndarray,
    learned_N: np.ndarray,
    pieces: Pieces,
    learned_K: np.ndarray,
    limit: int | None,
    mode: str,
) -> LongSampleReport | None:
    """The report of ``pieces`` (planned from ``lengths_N``), logged as a warning; None (and nothing
    logged) when no row is longer than ``limit``. ``learned_N``/``learned_K``: learned tokens per
    row and per piece."""
    long = lengths_N > limit if limit is not None else np.zeros(len(lengths_N), bool)
    if not long.any():
        return None
    from_long = long[pieces.rows]
    result = LongSampleReport(
        mode=mode,
        limit=int(limit),
        rows=len(lengths_N),
        long_rows=int(long.sum()),
        pieces=int(from_long.sum()),
        tokens=int(lengths_N.sum()),
        long_tokens=int(lengths_N[long].sum()),
        lost_tokens=int(lengths_N.sum() - pieces.lengths.sum()),
        learned=int(learned_N.sum()),
        lost_learned=int(learned_N.sum() - learned_K.sum()),
    )
    (logger.info if mode == "split" else logger.warning)("%s", result)
    return result


def piece_sums(values: np.ndarray, row_starts_N: np.ndarray, pieces: Pieces) -> np.ndarray:
    """``[K]`` sum of ``values`` (flat, rows back to back from ``row_starts_N``) over each piece."""
    cumulative = np.concatenate([[0], np.cumsum(values, dtype=np.int64)])
    first = row_starts_N[pieces.rows] + pieces.starts
    return cumulative[first + pieces.lengths] - cumulative[first]


def cut_rows(table: pa.Table, columns: list[str], pieces: Pieces) -> pa.Table:
    """The list ``columns`` of ``table`` cut into ``pieces`` (one row each); other columns dropped.
    A split's pieces tile the rows, so its values are reused as they are (new offsets only)."""
    out = {}
    for name in columns:
        column = table.column(name)
        array = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
        row_starts = array.offsets.to_numpy().astype(np.int64)
        values = array.values
        first = row_starts[pieces.rows] + pieces.starts
        offsets = np.concatenate([[0], np.cumsum(pieces.lengths)])
        if len(first) and np.array_equal(first, row_starts[0] + offsets[:-1]):  # contiguous: same values
            ends = np.append(first, first[-1] + pieces.lengths[-1]).astype(np.int32)
            out[name] = pa.ListArray.from_arrays(pa.array(ends), values)
            continue
        take = np.repeat(first - offsets[:-1], pieces.lengths) + np.arange(offsets[-1], dtype=np.int64)
        out[name] = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), values.take(pa.array(take)))
    return pa.table(out)
