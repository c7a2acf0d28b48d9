"""``automodel.data.long_samples``: the pieces of each choice worked by hand, properties over random
lengths, and the Arrow cut against a per-row reference."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from automodel.data.long_samples import Pieces, cut_rows, piece_sums, plan_pieces


def as_lists(pieces: Pieces) -> list[tuple[int, int, int]]:
    return list(zip(pieces.rows.tolist(), pieces.starts.tolist(), pieces.lengths.tolist(), strict=True))


def test_pieces_by_hand():
    assert as_lists(plan_pieces([10, 3], 4, "split")) == [(0, 0, 4), (0, 4, 4), (0, 8, 2), (1, 0, 3)]
    assert as_lists(plan_pieces([10, 3], 4, "truncate")) == [(0, 0, 4), (1, 0, 3)]
    assert as_lists(plan_pieces([10, 3], 4, "drop")) == [(1, 0, 3)]
    assert as_lists(plan_pieces([8, 4], 4, "split")) == [(0, 0, 4), (0, 4, 4), (1, 0, 4)]
    assert as_lists(plan_pieces([10, 3], None, "drop")) == [(0, 0, 10), (1, 0, 3)]
    with pytest.raises(ValueError, match="long_samples='cut'"):
        plan_pieces([1], 1, "cut")


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 60), min_size=1, max_size=30),
    st.integers(1, 20),
    st.sampled_from(["split", "truncate", "drop"]),
)
def test_pieces_fit_and_split_covers_every_position_once(lengths, limit, mode):
    pieces = plan_pieces(lengths, limit, mode)
    assert (pieces.lengths >= 1).all() and (pieces.lengths <= limit).all()
    covered = [set() for _ in lengths]
    for row, start, length in as_lists(pieces):
        assert not covered[row] & set(range(start, start + length))  # no position twice
        covered[row] |= set(range(start, start + length))
    for row, n in enumerate(lengths):
        expected = {"split": n, "truncate": min(n, limit), "drop": n if n <= limit else 0}[mode]
        assert covered[row] == set(range(expected))  # the first positions, in order


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(1, 30), min_size=1, max_size=12),
    st.integers(1, 9),
    st.sampled_from(["split", "truncate", "drop"]),
)
def test_cut_rows_and_piece_sums_equal_slicing_each_row(lengths, limit, mode):
    rng = np.random.default_rng(len(lengths) * 100 + limit)
    rows = [rng.integers(0, 2, n).tolist() for n in lengths]
    table = pa.table({"loss_mask": pa.array(rows, pa.list_(pa.int8())), "input_ids": pa.array(
        [list(range(100 * i, 100 * i + n)) for i, n in enumerate(lengths)], pa.list_(pa.int32()))})  # fmt: skip
    pieces = plan_pieces(lengths, limit, mode)
    cut = cut_rows(table, ["input_ids", "loss_mask"], pieces).to_pydict()
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    sums = piece_sums(np.concatenate([np.asarray(r) for r in rows]), starts, pieces)
    for k, (row, start, length) in enumerate(as_lists(pieces)):
        assert cut["loss_mask"][k] == rows[row][start : start + length]
        assert cut["input_ids"][k] == list(range(100 * row + start, 100 * row + start + length))
        assert sums[k] == sum(rows[row][start : start + length])
