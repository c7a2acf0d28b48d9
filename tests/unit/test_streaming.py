"""Streaming packing: the window planner by hand, the pack contract, exact resume, DP agreement."""

from __future__ import annotations

import io

import datasets
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from automodel.config import build_section, load_recipe
from automodel.data import pack_dataset
from automodel.data.loader import LoaderEnv
from automodel.data.planning import lower_bound_packs, plan_packs
from automodel.data.streaming import (
    PACK_KEYS,
    StreamingPackedBatching,
    StreamPacker,
    _deal,
    _mix,
    _WindowPlanner,
    pack_stream,
    plan_stream,
)


def make_rows(lengths, *, loss_mask=False, start=1):
    """Row i holds consecutive token ids (so every token is unique); labels equal input_ids."""
    rows, token = [], start
    for length in lengths:
        ids = list(range(token, token + length))
        token += length
        row = {"input_ids": ids, "labels": ids}
        if loss_mask:
            row["loss_mask"] = [t % 3 != 0 for t in ids]
        rows.append(row)
    return rows


def packs_equal(a, b):
    return len(a) == len(b) and all(all(np.array_equal(x[k], y[k]) for k in PACK_KEYS) for x, y in zip(a, b))


def round_trip(state):
    """Through torch.save / torch.load, as a checkpoint stores it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


# --- plan_stream ------------------------------------------------------------------------------


def test_plan_stream_worked_example():
    plan = plan_stream(np.array([6, 5, 4, 3, 5, 2, 4]), 10, buffer_size=4)
    assert plan.sample_order.tolist() == [0, 2, 1, 4, 3, 5, 6]
    assert plan.pack_offsets.tolist() == [0, 2, 4, 7]
    assert plan.num_packs == lower_bound_packs(np.array([6, 5, 4, 3, 5, 2, 4]), 10) == 3


def test_plan_stream_without_carry_over():
    # max_wait_rounds=1: every round packs all it holds. Round 0 [6 5 4 3] -> {6 4} {5 3};
    # end [5 2 4] -> BFD {5 4} {2}: 4 packs instead of 3 (packs of one round come in seeded order).
    plan = plan_stream(np.array([6, 5, 4, 3, 5, 2, 4]), 10, buffer_size=4, max_wait_rounds=1)
    packs = [plan.sample_order[a:b].tolist() for a, b in zip(plan.pack_offsets[:-1], plan.pack_offsets[1:])]
    assert sorted(packs[:2]) == [[0, 2], [1, 3]]
    assert sorted(packs[2:]) == [[4, 6], [5]]


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 50), min_size=1, max_size=60), seed=st.integers(0, 100))
def test_plan_stream_with_whole_data_in_buffer_is_bfd(lengths, seed):
    lengths = np.array(lengths)
    streamed = plan_stream(lengths, 50, buffer_size=len(lengths) + 1, seed=seed)
    bfd = plan_packs(lengths, 50, "bfd", seed)
    assert streamed.sample_order.tolist() == bfd.sample_order.tolist()
    assert streamed.pack_offsets.tolist() == bfd.pack_offsets.tolist()


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 64), min_size=1, max_size=300),
    capacity=st.integers(64, 200),
    buffer_size=st.integers(1, 40),
    max_wait_rounds=st.integers(1, 5),
)
def test_window_planner_properties(lengths, capacity, buffer_size, max_wait_rounds):
    """Every sample once, packs within capacity, at most buffer_size waiting after each arrival,
    and every sample leaves within max_wait_rounds rounds."""
    planner = _WindowPlanner(capacity, buffer_size, max_wait_rounds, seed=0)
    arrival_round, packs = {}, []
    for i, n in enumerate(lengths):
        arrival_round[i] = planner.rounds
        emitted = planner.add([i], [n])
        assert len(planner.keys) < buffer_size
        for pack in emitted:
            assert all(planner.rounds - arrival_round[k] <= max_wait_rounds for k in pack)
        packs += emitted
    packs += planner.finish()
    assert sorted(k for pack in packs for k in pack) == list(range(len(lengths)))
    assert all(sum(lengths[k] for k in pack) <= capacity for pack in packs)
    assert len(packs) >= lower_bound_packs(np.array(lengths), capacity)
    plan = plan_stream(np.array(lengths), capacity, buffer_size, max_wait_rounds=max_wait_rounds)
    assert [k for pack in packs for k in pack] == plan.sample_order.tolist()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"buffer_size": 0}, "buffer_size"),
        ({"max_wait_rounds": 0}, "max_wait_rounds"),
        ({"capacity": 4}, r"every length must be in \[1, 4\]"),
    ],
)
def test_plan_stream_rejects_bad_arguments(kwargs, match):
    arguments = {"lengths": np.array([3, 5]), "capacity": 10, **kwargs}
    with pytest.raises(ValueError, match=match):
        plan_stream(**arguments)


# --- pack_stream and StreamPacker ---------------------------------------------------------------


def test_pack_stream_cp_example():
    rows = [
        {"input_ids": [1, 2, 3], "labels": [1, 2, 3]},
        {"input_ids": [4, 5, 6, 7, 8], "labels": [4, 5, 6, 7, 8]},
    ]
    (pack,) = list(pack_stream(iter(rows), 16, cp_size=2))
    assert pack["input_ids"].tolist() == [1, 2, 3, 0, 4, 5, 6, 7, 8, 0, 0, 0, 0, 0, 0, 0]
    assert pack["labels"].tolist() == [1, 2, 3, -100, 4, 5, 6, 7, 8] + [-100] * 7
    assert pack["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert pack["seq_lens"].tolist() == [3, 5]
    assert pack["seq_lens_padded"].tolist() == [4, 12]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=40),
    cp_size=st.sampled_from([1, 2]),
    seed=st.integers(0, 50),
)
def test_pack_stream_with_whole_data_in_buffer_equals_pack_dataset(lengths, cp_size, seed):
    rows = make_rows(lengths, loss_mask=True)
    expected = pack_dataset(datasets.Dataset.from_list(rows), "train", 32, cp_size=cp_size, seed=seed)
    streamed = list(pack_stream(iter(rows), 32, buffer_size=len(rows) + 1, cp_size=cp_size, seed=seed))
    assert packs_equal(list(expected.with_format("numpy")), streamed)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=80),
    cp_size=st.sampled_from([1, 2, 4]),
    buffer_size=st.integers(1, 12),
)
def test_pack_stream_contract_with_small_buffer(lengths, cp_size, buffer_size):
    """Each pack is pack_dataset's layout: segments are whole samples (masked labels -100), CP
    padding to 2*cp, tail added to the last padded length, positions restart per sample."""
    size, multiple = 48, 2 * cp_size if cp_size > 1 else 1
    rows = make_rows(lengths, loss_mask=True)
    fits = {r["input_ids"][0]: r for r in rows if -(-len(r["input_ids"]) // multiple) * multiple <= size}
    seen = []
    for pack in pack_stream(iter(rows), size, buffer_size=buffer_size, cp_size=cp_size, padding_idx=-7):
        assert sum(pack["seq_lens_padded"]) == size
        assert all(p % multiple == 0 for p in pack["seq_lens_padded"])
        at = 0
        for n, padded in zip(pack["seq_lens"], pack["seq_lens_padded"]):
            row = fits[int(pack["input_ids"][at])]
            seen.append(row["input_ids"][0])
            assert pack["input_ids"][at : at + n].tolist() == row["input_ids"]
            assert pack["labels"][at : at + n].tolist() == [
                t if m else -100 for t, m in zip(row["labels"], row["loss_mask"])
            ]
            assert (pack["input_ids"][at + n : at + padded] == -7).all()
            assert (pack["labels"][at + n : at + padded] == -100).all()
            assert pack["position_ids"][at : at + n].tolist() == list(range(n))
            at += padded
    assert sorted(seen) == sorted(fits)


@pytest.mark.parametrize("cut", [0, 1, 5, 13])
def test_stream_packer_resume_equals_uninterrupted(cut):
    rng = np.random.default_rng(cut)
    rows = make_rows(rng.integers(1, 30, 60).tolist(), loss_mask=True)
    rows[7].pop("loss_mask")  # rows with and without a mask in one window
    kwargs = {"buffer_size": 9, "cp_size": 2, "seed": 3}
    expected = list(pack_stream(iter(rows), 32, **kwargs))

    packer, got, read = StreamPacker(32, **kwargs), [], 0
    while len(got) < cut:  # read until `cut` packs came out, leaving some ready ones behind
        packer.add(rows[read])
        read += 1
        if packer.num_ready:
            got.append(packer.pop())
    state = round_trip(packer.state_dict())
    resumed = StreamPacker(32, **kwargs)
    resumed.load_state_dict(state)
    got += list(_drain(resumed, rows[read:]))
    assert packs_equal(expected, got)
    assert resumed.report.num_packs == len(expected)


def _drain(packer, rows):
    while packer.num_ready:
        yield packer.pop()
    for row in rows:
        packer.add(row)
        while packer.num_ready:
            yield packer.pop()
    packer.finish()
    while packer.num_ready:
        yield packer.pop()


def test_stream_packer_report_and_long_samples():
    packer = StreamPacker(10, buffer_size=4)
    for row in make_rows([6, 5, 11, 4, 3, 5, 2, 4]):
        packer.add(row)
    packer.finish()
    report = packer.report
    assert (report.num_samples, report.num_too_long, report.num_packs, report.lower_bound) == (8, 1, 3, 3)
    assert report.real_tokens == 29 and report.fill == pytest.approx(29 / 30)

    strict = StreamPacker(12, cp_size=2, drop_long_samples=False)
    strict.add(make_rows([12])[0])
    with pytest.raises(ValueError, match=r"row 1 has 13 tokens \(16 after padding.*drop_long_samples=True"):
        strict.add(make_rows([13])[0])


@pytest.mark.parametrize(
    "row, match",
    [
        ({"input_ids": [1, 2]}, r"row 0 lacks \['labels'\]"),
        ({"input_ids": [1, 2], "labels": [1]}, "row 0: labels has 1 entries but input_ids has 2"),
        ({"input_ids": [1, 2], "labels": [1, 2], "loss_mask": [1]}, "row 0: loss_mask has 1 entries"),
        ({"input_ids": [], "labels": []}, "row 0 has an empty input_ids"),
        ({"input_ids": [1.5], "labels": [1]}, "row 0: input_ids must be a 1-D list of integers"),
        ([1, 2], "row 0 must be a mapping"),
    ],
)
def test_stream_packer_rejects_bad_rows(row, match):
    with pytest.raises(ValueError, match=match):
        StreamPacker(8).add(row)


def test_stream_packer_rejects_bad_use():
    with pytest.raises(ValueError, match="buffer_size must be a positive int"):
        StreamPacker(8, buffer_size=0)
    with pytest.raises(ValueError, match=r"multiple of 2\*cp_size=4"):
        pack_stream([], 10, cp_size=2)  # checked before the first next()
    packer = StreamPacker(8)
    packer.finish()
    with pytest.raises(ValueError, match="add after finish"):
        packer.add(make_rows([1])[0])
    with pytest.raises(ValueError, match="same packing parameters"):
        StreamPacker(8, buffer_size=5).load_state_dict(StreamPacker(8, buffer_size=6).state_dict())


# --- StreamingPackedBatching ---------------------------------------------------------------------


def take(stream, n):
    return [next(stream) for _ in range(n)]


def batches_equal(a, b):
    keys = ("input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded")
    return len(a) == len(b) and all(all(torch.equal(x[k], y[k]) for k in keys) for x, y in zip(a, b))


def sample_firsts(batch):
    """First token of every sample in a collated batch (tokens are unique per sample)."""
    firsts = []
    for row in range(batch["input_ids"].shape[0]):
        at = 0
        for n, padded in zip(batch["seq_lens"][row].tolist(), batch["seq_lens_padded"][row].tolist()):
            if n >= 0:
                firsts.append(int(batch["input_ids"][row, at]))
                at += padded
    return firsts


LENGTHS = np.random.default_rng(0).integers(1, 40, 120).tolist()


def test_deal_worked_example():
    assert _deal(np.array([5, 1, 2, 9, 4, 4]), 2).tolist() == [0, 1, 0, 1, 0, 1]


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 1000), min_size=1, max_size=200), num_ranks=st.integers(1, 8))
def test_deal_balances_counts_and_tokens(lengths, num_ranks):
    lengths = np.array(lengths)
    owner = _deal(lengths, num_ranks)
    counts = np.bincount(owner, minlength=num_ranks)
    tokens = np.bincount(owner, weights=lengths, minlength=num_ranks)
    assert counts.max() - counts.min() <= 1
    assert tokens.max() - tokens.min() <= lengths.max()


def test_streaming_batching_dp_ranks_agree_and_are_disjoint():
    mode = StreamingPackedBatching(packed_sequence_size=64, micro_batch_size=2, buffer_size=16)
    dataset = datasets.Dataset.from_list(make_rows(LENGTHS))
    streams = [mode.build(dataset, LoaderEnv(dp_rank=r, dp_size=3, seed=5)) for r in range(3)]
    counts = [s.batches_per_epoch for s in streams]
    assert len(set(counts)) == 1 and counts[0] > 0
    # The count is the fewest packs any rank forms, computed from lengths alone.
    order = np.random.default_rng(_mix(5, 0)).permutation(120)
    owner = _deal(np.array(LENGTHS)[order], 3)
    plans = [plan_stream(np.array(LENGTHS)[order[owner == r]], 64, 16, seed=_mix(5, 0)) for r in range(3)]
    assert counts[0] == min(p.num_packs for p in plans) // 2
    firsts = [sorted(f for b in take(s, counts[0]) for f in sample_firsts(b)) for s in streams]
    for r in range(3):
        assert set(firsts[r]) <= {make_rows(LENGTHS)[i]["input_ids"][0] for i in order[owner == r]}
    assert sum(len(f) for f in firsts) == len(set().union(*map(set, firsts)))


def _build(source_factory, **kwargs):
    mode = StreamingPackedBatching(
        packed_sequence_size=64, micro_batch_size=2, buffer_size=12, cp_size=2, **kwargs
    )
    return mode.build(source_factory(), LoaderEnv(dp_rank=1, dp_size=2, seed=9))


class Rows:
    """A re-iterable plain source: every iter() starts over."""

    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        yield from self.rows


SOURCES = {
    "map-style, epoch = one pass": (lambda: datasets.Dataset.from_list(make_rows(LENGTHS)), {}),
    "map-style, steps_per_epoch": (
        lambda: datasets.Dataset.from_list(make_rows(LENGTHS)),
        {"steps_per_epoch": 7},
    ),
    "IterableDataset": (
        lambda: datasets.Dataset.from_list(make_rows(LENGTHS)).to_iterable_dataset(num_shards=4),
        {"steps_per_epoch": 5},
    ),
    "plain iterable": (lambda: Rows(make_rows(LENGTHS)), {"steps_per_epoch": 4}),
}


@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("cut", [3, 11, "epoch end"])
def test_streaming_batching_resume_equals_uninterrupted(source, cut):
    factory, kwargs = SOURCES[source]
    reference = _build(factory, **kwargs)
    cut = reference.batches_per_epoch if cut == "epoch end" else cut
    total = 3 * reference.batches_per_epoch + 1  # crosses epochs (and passes of the data)
    expected = take(reference, total)

    interrupted = _build(factory, **kwargs)
    got = take(interrupted, cut)
    state = round_trip(interrupted.state_dict())
    resumed = _build(factory, **kwargs)
    resumed.load_state_dict(state)
    got += take(resumed, total - cut)
    assert batches_equal(expected, got)
    assert resumed.epoch == reference.epoch


def test_streaming_batching_epochs_differ_and_cp_padding():
    stream = _build(SOURCES["map-style, epoch = one pass"][0])
    first = take(stream, stream.batches_per_epoch)
    second = take(stream, stream.batches_per_epoch)
    assert stream.epoch == 1
    assert not batches_equal(first, second)  # a new permutation each epoch
    for batch in first + second:
        padded = batch["seq_lens_padded"]
        assert ((padded[padded >= 0] % 4) == 0).all()
        assert (padded.clamp(min=0).sum(dim=1) == 64).all()


def test_streaming_batching_needs_steps_per_epoch_for_a_stream():
    mode = StreamingPackedBatching(packed_sequence_size=64)
    stream = datasets.Dataset.from_list(make_rows([3, 4])).to_iterable_dataset()
    with pytest.raises(ValueError, match="packing.steps_per_epoch must be set to stream a IterableDataset"):
        mode.build(stream, LoaderEnv())


def test_streaming_batching_cannot_resume_a_generator():
    mode = StreamingPackedBatching(packed_sequence_size=64, buffer_size=4, steps_per_epoch=2)
    stream = mode.build((row for row in make_rows(LENGTHS)), LoaderEnv())
    take(stream, 1)
    state = stream.state_dict()
    resumed = mode.build((row for row in make_rows(LENGTHS)), LoaderEnv())
    resumed.load_state_dict(state)
    with pytest.raises(ValueError, match="cannot resume a one-shot iterator"):
        next(resumed)


def test_streaming_batching_empty_share_is_an_error():
    mode = StreamingPackedBatching(packed_sequence_size=64, steps_per_epoch=1)
    stream = mode.build(Rows(make_rows([5])), LoaderEnv(dp_rank=1, dp_size=2))
    with pytest.raises(ValueError, match="DP rank 1 of 2 got no rows in pass 0"):
        next(stream)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"buffer_size": 0}, "buffer_size must be a positive int"),
        ({"steps_per_epoch": 0}, "steps_per_epoch must be a positive int"),
        ({"packed_sequence_size": 10, "cp_size": 2}, r"multiple of 2\*cp_size=4"),
    ],
)
def test_streaming_batching_rejects_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StreamingPackedBatching(**kwargs)


def test_streaming_config_group_builds():
    cfg = load_recipe("tiny_llama_sft", ["packing=streaming", "packing.buffer_size=64", "parallel.cp_size=2"])
    mode = build_section(cfg, "packing")
    assert isinstance(mode, StreamingPackedBatching)
    assert (mode.buffer_size, mode.cp_size, mode.steps_per_epoch) == (64, 2, None)
