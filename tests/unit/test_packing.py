"""pack_dataset and the planners: hand-worked values, NeMo parity, properties, bad input."""

from __future__ import annotations

import logging

import datasets
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from automodel.data import pack_dataset, plan_packs
from automodel.data.planning import lower_bound_packs


def make_dataset(lengths, *, loss_mask=False, start=1):
    """Sample i holds consecutive token ids; labels equal input_ids (easy to trace)."""
    rows, token = [], start
    for length in lengths:
        ids = list(range(token, token + length))
        token += length
        row = {"input_ids": ids, "labels": ids}
        if loss_mask:
            row["loss_mask"] = [t % 2 for t in ids]
        rows.append(row)
    return datasets.Dataset.from_list(rows)


def nemo_next_fit_reference(samples, size, cp_size=1, padding_idx=0):
    """NeMo AutoModel's sequential pack, written out from its documented contract (field-notes.md),
    one sample at a time in plain Python. Valid where NeMo is correct: every sample fits."""
    m = 2 * cp_size if cp_size > 1 else 1
    packs, current = [], []

    def close(group):
        ids, labels, pos, lens, padded = [], [], [], [], []
        for s in group:
            n = len(s["input_ids"])
            p = -(-n // m) * m
            ids += list(s["input_ids"]) + [padding_idx] * (p - n)
            labels += list(s["labels"]) + [-100] * (p - n)
            pos += list(range(p))
            lens.append(n)
            padded.append(p)
        tail = size - len(ids)
        pos += [min(pos[-1] + 1 + i, size - 1) for i in range(tail)]
        ids += [padding_idx] * tail
        labels += [-100] * tail
        padded[-1] += tail
        return {
            "input_ids": ids,
            "labels": labels,
            "position_ids": pos,
            "seq_lens": lens,
            "seq_lens_padded": padded,
        }

    used = 0
    for s in samples:
        p = -(-len(s["input_ids"]) // m) * m
        if used + p > size:
            packs.append(close(current))
            current, used = [], 0
        current.append(s)
        used += p
    if current:
        packs.append(close(current))
    return packs


# --- hand-worked examples -------------------------------------------------------------------


def test_sequential_example_from_nemo_contract():
    packed = pack_dataset(make_dataset([3, 4, 2, 5]), "train", 10, algorithm="sequential")
    assert packed.to_list() == [
        {
            "input_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 0],
            "labels": [1, 2, 3, 4, 5, 6, 7, 8, 9, -100],
            "position_ids": [0, 1, 2, 0, 1, 2, 3, 0, 1, 2],
            "seq_lens": [3, 4, 2],
            "seq_lens_padded": [3, 4, 3],
        },
        {
            "input_ids": [10, 11, 12, 13, 14, 0, 0, 0, 0, 0],
            "labels": [10, 11, 12, 13, 14, -100, -100, -100, -100, -100],
            "position_ids": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9],
            "seq_lens": [5],
            "seq_lens_padded": [10],
        },
    ]


def test_cp_padding_example_from_nemo_contract():
    packed = pack_dataset(make_dataset([3, 5]), "train", 16, cp_size=2, algorithm="sequential")
    assert packed.to_list() == [
        {
            "input_ids": [1, 2, 3, 0, 4, 5, 6, 7, 8, 0, 0, 0, 0, 0, 0, 0],
            "labels": [1, 2, 3, -100, 4, 5, 6, 7, 8] + [-100] * 7,
            "position_ids": [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
            "seq_lens": [3, 5],
            "seq_lens_padded": [4, 12],
        }
    ]


def test_loss_mask_zero_turns_label_into_ignore_index():
    # tokens 1..5, loss_mask = token % 2 -> labels kept at odd tokens only
    packed = pack_dataset(make_dataset([5], loss_mask=True), "train", 6, algorithm="sequential")
    assert packed[0]["labels"] == [1, -100, 3, -100, 5, -100]
    assert packed[0]["input_ids"] == [1, 2, 3, 4, 5, 0]


def test_padding_idx_is_used_for_cp_and_tail_padding():
    packed = pack_dataset(make_dataset([3]), "train", 8, padding_idx=7, cp_size=2, algorithm="sequential")
    assert packed[0]["input_ids"] == [1, 2, 3, 7, 7, 7, 7, 7]
    assert packed[0]["seq_lens_padded"] == [8]


def test_best_fit_decreasing_worked_example():
    # lengths 5 3 7 2 4 1, capacity 8. Longest first: 7 opens A (room 1); 5 opens B (room 3);
    # 4 fits nowhere, opens C (room 4); 3 -> best fit B (room 3 -> 0); 2 -> C (4 -> 2);
    # 1 -> A (room 1 is the tightest; -> 0). Packs: A = {2, 5}, B = {0, 1}, C = {3, 4}.
    plan = plan_packs(np.array([5, 3, 7, 2, 4, 1]), 8, "bfd", seed=0)
    packs = [plan.sample_order[a:b].tolist() for a, b in zip(plan.pack_offsets[:-1], plan.pack_offsets[1:])]
    assert sorted(packs) == [[0, 1], [2, 5], [3, 4]]
    # pack order is the seeded shuffle of the opening order A, B, C
    opening_order = [[2, 5], [0, 1], [3, 4]]
    position = np.random.default_rng(np.random.SeedSequence(0, spawn_key=(1,))).permutation(3)
    assert packs == [opening_order[i] for i in np.argsort(position)]


def test_bfd_shuffle_depends_on_seed_only():
    lengths = np.random.default_rng(1).integers(1, 50, 300)
    a, b = plan_packs(lengths, 64, "bfd", seed=3), plan_packs(lengths, 64, "bfd", seed=3)
    c = plan_packs(lengths, 64, "bfd", seed=4)
    assert np.array_equal(a.sample_order, b.sample_order) and np.array_equal(a.pack_offsets, b.pack_offsets)
    assert not np.array_equal(a.sample_order, c.sample_order)


def test_sequential_plan_is_next_fit():
    plan = plan_packs(np.array([4, 4, 3, 6, 1, 1]), 8, "sequential")
    assert plan.sample_order.tolist() == [0, 1, 2, 3, 4, 5]
    assert plan.pack_offsets.tolist() == [0, 2, 3, 6]


def test_max_packs_keeps_first_packs_and_reports(caplog):
    with caplog.at_level(logging.WARNING):
        packed = pack_dataset(make_dataset([3, 4, 2, 5]), "train", 10, max_packs=1, algorithm="sequential")
    assert len(packed) == 1 and packed[0]["seq_lens"] == [3, 4, 2]
    assert "left out 1 of 4 samples" in caplog.text and "max_packs" in caplog.text


def test_long_samples_are_dropped_counted_and_reported_once(caplog):
    with caplog.at_level(logging.WARNING):
        packed = pack_dataset(make_dataset([3, 11, 2, 12]), "train", 10, algorithm="sequential")
    assert packed["seq_lens"] == [[3, 2]]
    drops = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(drops) == 1
    assert (
        "dropped 2 of 4 samples (50.000%), 23 of 28 tokens (82.143%), longer than packed_sequence_size=10 tokens"
        in drops[0].getMessage()
    )


def test_report_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="automodel.data.packing"):
        pack_dataset(make_dataset([3, 4, 2, 5]), "train", 10, algorithm="bfd")
    assert "packed 4 of 4 samples into 2 packs of 10 tokens (bfd): fill 70.00%" in caplog.text


def test_dataset_dict_split_and_extra_columns():
    ds = make_dataset([2, 3]).add_column("text", ["a", "b"])
    packed = pack_dataset(datasets.DatasetDict(train=ds), "train", 8, algorithm="sequential")
    assert packed.column_names == ["input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded"]
    assert packed[0]["input_ids"] == [1, 2, 3, 4, 5, 0, 0, 0]


def test_packing_leaves_torch_thread_count_alone():
    """numba's OpenMP layer resizes the pool torch shares; a rank set to 1 thread must stay at 1, or
    the ranks of a multi-process job oversubscribe the cores (a 2-rank CPU run was 4x slower)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pack_dataset(make_dataset([3, 4, 2, 5]), "train", 10, algorithm="bfd")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_reads_through_an_indices_mapping():
    ds = make_dataset([2, 3, 4]).select([2, 0])
    packed = pack_dataset(ds, "train", 8, algorithm="sequential")
    assert packed[0]["input_ids"] == [6, 7, 8, 9, 1, 2, 0, 0]


def test_int64_token_ids_beyond_int32_are_kept():
    big = 2**40
    ds = datasets.Dataset.from_list([{"input_ids": [big, big + 1], "labels": [big + 1, -100]}])
    packed = pack_dataset(ds, "train", 4, algorithm="sequential")
    assert packed[0]["input_ids"] == [big, big + 1, 0, 0]


# --- properties ----------------------------------------------------------------------------


@st.composite
def packing_cases(draw):
    cp_size = draw(st.sampled_from([1, 1, 2, 3, 4]))
    multiple = 2 * cp_size if cp_size > 1 else 1
    size = multiple * draw(st.integers(2, 16))
    lengths = draw(st.lists(st.integers(1, size + 4), min_size=1, max_size=40))
    return lengths, size, cp_size


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=packing_cases(), algorithm=st.sampled_from(["bfd", "sequential"]), seed=st.integers(0, 3))
def test_packing_invariants(case, algorithm, seed):
    lengths, size, cp_size = case
    multiple = 2 * cp_size if cp_size > 1 else 1
    if all(length > size for length in lengths):
        with pytest.raises(ValueError, match="no sample fits"):
            pack_dataset(
                make_dataset(lengths, loss_mask=True), "train", size, cp_size=cp_size, algorithm=algorithm
            )
        return
    packed = pack_dataset(
        make_dataset(lengths, loss_mask=True), "train", size, cp_size=cp_size, algorithm=algorithm, seed=seed
    )
    seen = []
    for pack in packed:
        assert len(pack["input_ids"]) == len(pack["labels"]) == len(pack["position_ids"]) == size
        assert sum(pack["seq_lens_padded"]) == size
        assert all(p % multiple == 0 for p in pack["seq_lens_padded"])
        offset = 0
        for real, padded in zip(pack["seq_lens"], pack["seq_lens_padded"]):
            ids = pack["input_ids"][offset : offset + real]
            seen.append(ids[0])
            assert ids == list(range(ids[0], ids[0] + real))  # a whole sample, in order
            assert pack["labels"][offset : offset + real] == [t if t % 2 else -100 for t in ids]
            assert pack["labels"][offset + real : offset + padded] == [-100] * (padded - real)
            assert pack["position_ids"][offset : offset + real] == list(range(real))
            offset += padded
    starts = np.cumsum([0, *lengths])[:-1] + 1
    fitting = [int(s) for s, n in zip(starts, lengths) if -(-n // multiple) * multiple <= size]
    assert sorted(seen) == fitting  # every fitting sample exactly once, every other dropped


@settings(max_examples=60, deadline=None)
@given(case=packing_cases())
def test_sequential_equals_nemo_pack_for_pack(case):
    lengths, size, cp_size = case
    multiple = 2 * cp_size if cp_size > 1 else 1
    lengths = [n for n in lengths if -(-n // multiple) * multiple <= size]  # where NeMo is correct
    if not lengths:
        return
    ds = make_dataset(lengths)
    expected = nemo_next_fit_reference(ds.to_list(), size, cp_size)
    assert pack_dataset(ds, "train", size, cp_size=cp_size, algorithm="sequential").to_list() == expected


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 64), min_size=1, max_size=300), capacity=st.integers(64, 200))
def test_bfd_plan_is_a_valid_partition_and_no_two_packs_could_merge(lengths, capacity):
    lengths = np.array(lengths)
    plan = plan_packs(lengths, capacity, "bfd")
    assert sorted(plan.sample_order.tolist()) == list(range(len(lengths)))
    loads = np.sort(np.add.reduceat(lengths[plan.sample_order], plan.pack_offsets[:-1]))
    assert loads.max() <= capacity
    assert plan.num_packs >= lower_bound_packs(lengths, capacity)
    # Best fit opens a pack only for a sample no open pack can hold, so any two packs overflow
    # together. (It is not always at most next-fit's count: [18, 32, 38, 9, 9, 30, 33] in packs of
    # 88 is 3 packs decreasing, 2 in this order.)
    assert plan.num_packs == 1 or loads[0] + loads[1] > capacity


def test_bfd_can_lose_to_next_fit_on_a_lucky_order():
    lengths, capacity = np.array([18, 32, 38, 9, 9, 30, 33]), 88
    assert plan_packs(lengths, capacity, "sequential").num_packs == 2  # 18+32+38 = 88, 9+9+30+33 = 81
    assert plan_packs(lengths, capacity, "bfd").num_packs == 3  # 38+33+9, 32+30+18, 9


def test_bfd_is_within_a_tenth_of_a_percent_of_the_lower_bound():
    rng = np.random.default_rng(0)
    lengths = np.clip(np.rint(rng.lognormal(np.log(400), 0.9, 20_000)), 16, 4096).astype(np.int64)
    plan = plan_packs(lengths, 4096, "bfd")
    assert plan.num_packs <= lower_bound_packs(lengths, 4096) * 1.001


# --- bad input -----------------------------------------------------------------------------

GOOD = make_dataset([3, 4])


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(packed_sequence_size=10, cp_size=4), "packed_sequence_size=10"),
        (dict(packed_sequence_size=0), "packed_sequence_size"),
        (dict(packed_sequence_size=8.0), "packed_sequence_size"),
        (dict(packed_sequence_size=8, max_packs=0), "max_packs"),
        (dict(packed_sequence_size=8, cp_size=0), "cp_size"),
        (dict(packed_sequence_size=8, algorithm="ffd"), "algorithm"),
        (dict(packed_sequence_size=8, drop_long_samples="yes"), "drop_long_samples"),
        (dict(packed_sequence_size=8, padding_idx=2**40), "padding_idx"),
        (dict(packed_sequence_size=3, drop_long_samples=False), "more than packed_sequence_size=3"),
    ],
)
def test_bad_arguments(kwargs, field):
    with pytest.raises(ValueError, match=field):
        pack_dataset(GOOD, "train", **kwargs)


def test_too_long_error_names_cp_padded_length():
    with pytest.raises(
        ValueError, match=r"sample 2 has 8 tokens after padding to a multiple of 2\*cp_size=4"
    ):
        pack_dataset(make_dataset([3, 4, 5]), "train", 4, cp_size=2, drop_long_samples=False)


@pytest.mark.parametrize(
    "rows, field",
    [
        ([{"input_ids": [1, 2]}], "labels"),
        ([{"input_ids": [1, 2], "labels": [1]}], "labels"),
        ([{"input_ids": [1, 2], "labels": [1, 2], "loss_mask": [1]}], "loss_mask"),
        ([{"input_ids": [1], "labels": [1]}, {"input_ids": [], "labels": []}], "input_ids"),
        ([{"input_ids": [1], "labels": [1]}, {"input_ids": None, "labels": [1]}], "input_ids"),
        ([{"input_ids": ["a"], "labels": [1]}], "input_ids"),
        ([{"input_ids": 5, "labels": 5}], "input_ids"),
    ],
)
def test_malformed_rows(rows, field):
    with pytest.raises(ValueError, match=field):
        pack_dataset(datasets.Dataset.from_list(rows), "train", 8)


def test_missing_split_and_wrong_types():
    with pytest.raises(ValueError, match="split"):
        pack_dataset(datasets.DatasetDict(train=GOOD), "validation", 8)
    with pytest.raises(ValueError, match="dataset is empty"):
        pack_dataset(GOOD.select([]), "train", 8)
    with pytest.raises(TypeError, match="dataset"):
        pack_dataset("rows.jsonl", "train", 8)  # a list of rows packs (tests/unit/test_nemo_contracts.py)
    with pytest.raises(TypeError, match="IterableDataset"):
        pack_dataset(GOOD.to_iterable_dataset(), "train", 8)
