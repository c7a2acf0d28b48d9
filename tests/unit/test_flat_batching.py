"""VeOmni's batching modes (rmpad, dyn_bsz, pad_packed_input): the field-notes examples, properties,
resume, tightness, bad configs."""

from __future__ import annotations

import logging

import datasets
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from automodel.bench.packing import sample_lengths
from automodel.config import ConfigError, build_section, load_recipe
from automodel.data.flat_batching import (
    DynBszBatching,
    RmpadBatching,
    epoch_order,
    flatten_samples,
    pad_packed_to_length,
    plan_fixed_size,
    plan_token_budget,
)
from automodel.data.loader import LoaderEnv
from automodel.distributed import make_cp_batch_for_te, process_input_for_thd

A, B, C, D, E, F, G, H, I, J = range(1, 11)  # noqa: E741 (the field notes name tokens A..J)
VEOMNI_SAMPLES = [[A, B, C, D], [E, F], [G, H, I], [J]]


def make_dataset(lengths, *, loss_mask=False):
    """Sample i holds consecutive token ids starting after the previous sample's (first token -> sample)."""
    rows, token = [], 1
    for length in lengths:
        ids = list(range(token, token + length))
        token += length
        row = {"input_ids": ids, "labels": ids}
        if loss_mask:
            row["loss_mask"] = [t % 2 for t in ids]
        rows.append(row)
    return datasets.Dataset.from_list(rows)


def first_tokens(lengths) -> dict[int, int]:
    starts = np.cumsum([0, *lengths])[:-1] + 1
    return {int(s): i for i, s in enumerate(starts)}


def samples_of(batch, first_token_to_sample) -> list[int]:
    """Sample indices in a flattened [1, T] micro-batch, in order (the pad segment is no sample)."""
    ids = batch["input_ids"][0].tolist()
    starts = np.cumsum([0, *batch["seq_lens_padded"][0].tolist()])[:-1]
    return [first_token_to_sample[ids[s]] for s in starts if ids[s] in first_token_to_sample]


def take(stream, n):
    return [next(stream) for _ in range(n)]


def cu_seqlens(batch):
    return process_input_for_thd(batch)["cu_seqlens"].tolist()


# --- the field-notes examples ----------------------------------------------------------------


def test_rmpad_veomni_example_through_the_stream():
    stream = RmpadBatching(micro_batch_size=2, max_seq_len=8, shuffle=False).build(
        make_dataset([4, 2, 3, 1]), LoaderEnv()
    )
    first, second = take(stream, 2)
    assert first["input_ids"].tolist() == [[A, B, C, D, E, F]]
    assert first["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1]]
    assert first["seq_lens"].tolist() == first["seq_lens_padded"].tolist() == [[4, 2]]
    assert first["labels"].tolist() == [[A, B, C, D, E, F]]
    assert first["qkv_format"] == "thd"
    assert cu_seqlens(first) == [0, 4, 6]
    assert second["input_ids"].tolist() == [[G, H, I, J]]
    assert second["position_ids"].tolist() == [[0, 1, 2, 0]]
    assert cu_seqlens(second) == [0, 3, 4]
    assert stream.batches_per_epoch == 2


def test_flatten_samples_veomni_example():
    batch = flatten_samples([{"input_ids": s, "labels": s} for s in VEOMNI_SAMPLES[:2]])
    assert batch["input_ids"].tolist() == [[A, B, C, D, E, F]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1]]
    assert batch["input_ids"].dtype == batch["labels"].dtype == batch["position_ids"].dtype == torch.int64


def test_dyn_bsz_veomni_example_budget_10():
    stream = DynBszBatching(max_tokens_per_micro_batch=10, shuffle=False).build(make_dataset([4, 2, 3, 1]), LoaderEnv())
    assert stream.batches_per_epoch == 1
    batch = next(stream)
    assert batch["input_ids"].tolist() == [[A, B, C, D, E, F, G, H, I, J]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2, 0]]
    assert cu_seqlens(batch) == [0, 4, 6, 9, 10]


def test_pad_to_8_example():
    batch = flatten_samples([{"input_ids": s, "labels": s} for s in VEOMNI_SAMPLES[:2]])
    padded = pad_packed_to_length(batch, 8, padding_idx=0)
    assert padded["input_ids"].tolist() == [[A, B, C, D, E, F, 0, 0]]
    assert padded["labels"].tolist() == [[A, B, C, D, E, F, -100, -100]]
    assert padded["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 0, 1]]
    assert padded["seq_lens"].tolist() == padded["seq_lens_padded"].tolist() == [[4, 2, 2]]
    thd = process_input_for_thd(padded)
    assert thd["cu_seqlens"].tolist() == thd["cu_seqlens_padded"].tolist() == [0, 4, 6, 8]
    assert int(thd["max_seqlen"]) == 4
    assert not thd["padding_mask"].any()  # the pad segment is a segment of its own, not CP padding


def test_pad_to_10_example():
    samples = [[A, B, C], [D, E], [F, G]]
    batch = flatten_samples([{"input_ids": s, "labels": s} for s in samples])
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1]]
    assert cu_seqlens(batch) == [0, 3, 5, 7]
    padded = pad_packed_to_length(batch, 10)
    assert padded["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 0, 1, 2]]
    assert cu_seqlens(padded) == [0, 3, 5, 7, 10]
    assert int(process_input_for_thd(padded)["max_seqlen"]) == 3


def test_pad_default_length_micro_batch_size_times_max_seq_len_example():
    config = RmpadBatching(micro_batch_size=2, max_seq_len=4, pad_packed_input=True, shuffle=False)
    assert config.static_length == 8
    batch = next(config.build(make_dataset([4, 1]), LoaderEnv(padding_idx=0)))
    assert batch["input_ids"].tolist() == [[A, B, C, D, E, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 0, 1, 2]]
    assert cu_seqlens(batch) == [0, 4, 5, 8]


def test_pad_keeps_a_full_row_and_pads_rows_of_a_batch_each_with_one_segment():
    batch = flatten_samples([{"input_ids": [A, B], "labels": [A, B]}])
    assert pad_packed_to_length(batch, 2)["seq_lens"].tolist() == [[2]]
    two_rows = {
        "input_ids": torch.tensor([[1, 2, 3], [4, 5, 6]]),
        "labels": torch.tensor([[1, 2, 3], [4, 5, 6]]),
        "position_ids": torch.tensor([[0, 1, 2], [0, 0, 1]]),
        "seq_lens": torch.tensor([[3, -1000], [1, 2]]),
        "seq_lens_padded": torch.tensor([[3, -1000], [1, 2]]),
        "extra": "kept",
    }
    padded = pad_packed_to_length(two_rows, 5, padding_idx=7)
    assert padded["input_ids"].tolist() == [[1, 2, 3, 7, 7], [4, 5, 6, 7, 7]]
    assert padded["seq_lens"].tolist() == [[3, 2, -1000], [1, 2, 2]]
    assert padded["extra"] == "kept"
    assert process_input_for_thd(padded)["cu_seqlens"].tolist() == [0, 3, 5, 6, 8, 10]


def test_loss_mask_turns_labels_into_ignore_index():
    batch = flatten_samples([{"input_ids": [5, 6, 7], "labels": [6, 7, 8], "loss_mask": [0, 1, 1]}])
    assert batch["labels"].tolist() == [[-100, 7, 8]]


# --- context parallelism -----------------------------------------------------------------------


def test_cp_pads_every_sample_and_the_pad_segment_to_multiples_of_2cp():
    samples = [{"input_ids": s, "labels": s} for s in VEOMNI_SAMPLES[:2]]
    batch = flatten_samples(samples, padding_idx=0, cp_size=2)
    assert batch["input_ids"].tolist() == [[A, B, C, D, E, F, 0, 0]]
    assert batch["labels"].tolist() == [[A, B, C, D, E, F, -100, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert batch["seq_lens"].tolist() == [[4, 2]] and batch["seq_lens_padded"].tolist() == [[4, 4]]
    padded = pad_packed_to_length(batch, 12, cp_size=2)
    thd = process_input_for_thd(padded)
    assert thd["cu_seqlens"].tolist() == [0, 4, 6, 10]  # real lengths 4, 2 and the pad segment 4
    assert thd["cu_seqlens_padded"].tolist() == [0, 4, 8, 12]
    assert thd["padding_mask"].tolist() == [False] * 6 + [True] * 2 + [False] * 4
    shards = [make_cp_batch_for_te(None, padded, cp_size=2, cp_rank=r) for r in range(2)]
    # Each sequence has 4 slots: 2*cp = 4 chunks of 1; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert shards[0]["input_ids"].tolist() == [A, D, E, 0, 0, 0]
    assert shards[1]["input_ids"].tolist() == [B, C, F, 0, 0, 0]
    assert shards[0]["position_ids"].tolist() == [0, 3, 0, 3, 0, 3]


def test_pad_rejects_lengths_that_break_cp_divisibility_or_are_too_short():
    batch = flatten_samples([{"input_ids": [A, B, C], "labels": [A, B, C]}], cp_size=2)  # 4 slots
    with pytest.raises(ValueError, match=r"segment of 2, not a multiple of 2\*cp_size=4"):
        pad_packed_to_length(batch, 6, cp_size=2)
    with pytest.raises(ValueError, match="holds 4 tokens, more than pad_packed_to_length=3"):
        pad_packed_to_length(batch, 3)


@pytest.mark.parametrize("mode", ["rmpad", "dyn_bsz"])
def test_cp_static_batches_shard_on_every_rank(mode):
    lengths = [5, 1, 7, 3, 2, 8, 4, 6]
    if mode == "rmpad":
        config = RmpadBatching(micro_batch_size=3, max_seq_len=8, cp_size=2, pad_packed_input=True)
    else:
        config = DynBszBatching(max_tokens_per_micro_batch=16, cp_size=2, pad_packed_input=True, buffer_size=3)
    stream = config.build(make_dataset(lengths), LoaderEnv(seed=3))
    for batch in take(stream, stream.batches_per_epoch):
        assert batch["input_ids"].shape == (1, config.static_length)
        assert (batch["seq_lens_padded"][batch["seq_lens_padded"] > 0] % 4 == 0).all()
        tokens = sorted(
            t for r in range(2) for t in make_cp_batch_for_te(None, batch, cp_size=2, cp_rank=r)["input_ids"].tolist()
        )
        assert tokens == sorted(batch["input_ids"][0].tolist())


# --- planning ----------------------------------------------------------------------------------


def test_plan_token_budget_docstring_example():
    plan = plan_token_budget(np.arange(4), np.array([4, 2, 3, 1]), np.array([4, 2, 3, 1]), 6, 6, buffer_size=4)
    assert plan.sample_order.tolist() == [0, 1, 2, 3]
    assert plan.pack_offsets.tolist() == [0, 2, 4]


def test_plan_fixed_size_docstring_example():
    plan = plan_fixed_size(np.array([3, 0, 2, 1, 4]), 2)
    assert plan.sample_order.tolist() == [3, 0, 2, 1] and plan.pack_offsets.tolist() == [0, 2, 4]


def online_buffer_reference(order, weights, sizes, budget, max_size, buffer_size):
    """The bounded-buffer online algorithm one sample at a time in plain Python: keep the buffer
    full, then take, largest weight first (ties: earliest arrival), every sample that still fits."""
    arrivals, buffer, batches = list(order), [], []
    while arrivals or buffer:
        while len(buffer) < buffer_size and arrivals:
            buffer.append((len(order) - len(arrivals), arrivals.pop(0)))
        room_w, room_s, taken = budget, max_size, []
        for rank, sample in sorted(buffer, key=lambda e: (-weights[e[1]], e[0])):
            if weights[sample] <= room_w and sizes[sample] <= room_s:
                room_w, room_s = room_w - weights[sample], room_s - sizes[sample]
                taken.append((rank, sample))
        buffer = [e for e in buffer if e not in taken]
        batches.append([sample for _, sample in sorted(taken)])
    return batches


@settings(max_examples=80, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 12), min_size=1, max_size=60),
    labels=st.lists(st.integers(0, 12), min_size=60, max_size=60),
    budget=st.integers(12, 30),
    extra=st.integers(0, 10),
    buffer_size=st.integers(1, 8),
    label_mode=st.booleans(),
    seed=st.integers(0, 5),
)
def test_plan_token_budget_is_the_online_buffer_algorithm(sizes, labels, budget, extra, buffer_size, label_mode, seed):
    sizes = np.array(sizes)
    weights = np.minimum(np.array(labels[: len(sizes)]), sizes) if label_mode else sizes
    max_size = budget + extra if label_mode else budget
    order = np.random.default_rng(seed).permutation(len(sizes))
    plan = plan_token_budget(order, weights, sizes, budget, max_size, buffer_size)
    batches = [plan.sample_order[a:b].tolist() for a, b in zip(plan.pack_offsets[:-1], plan.pack_offsets[1:])]
    assert batches == online_buffer_reference(order.tolist(), weights, sizes, budget, max_size, buffer_size)
    assert sorted(plan.sample_order.tolist()) == list(range(len(sizes)))  # every sample exactly once
    assert all(weights[b].sum() <= budget and sizes[b].sum() <= max_size and len(b) for b in batches)


def test_dyn_bsz_is_within_half_a_percent_of_the_lower_bound_and_beats_an_arrival_scan():
    lengths = sample_lengths("lognormal", 50_000, 4096, seed=1)
    order = epoch_order(len(lengths), seed=0, epoch=0, shuffle=True)
    plan = plan_token_budget(order, lengths, lengths, 4096, 4096, buffer_size=200)
    bound = -(-int(lengths.sum()) // 4096)
    assert plan.num_packs <= bound * 1.005
    arrival_scan = arrival_order_scan_reference(order, lengths, 4096, 200)
    assert plan.num_packs < arrival_scan


def arrival_order_scan_reference(order, lengths, budget, buffer_size):
    """VeOmni's dyn_bsz fill (field notes): scan the buffer in arrival order, take what fits."""
    arrivals, buffer, batches = list(order[::-1]), [], 0
    while arrivals or buffer:
        while len(buffer) < buffer_size and arrivals:
            buffer.append(arrivals.pop())
        room, kept = budget, []
        for sample in buffer:
            if lengths[sample] <= room:
                room -= lengths[sample]
            else:
                kept.append(sample)
        buffer, batches = kept, batches + 1
    return batches


# --- epochs, data parallelism, resume ------------------------------------------------------------


def build(mode, lengths, dp_rank=0, dp_size=1, seed=0, loss_mask=False, **kwargs):
    if mode == "rmpad":
        config = RmpadBatching(**{"micro_batch_size": 2, "max_seq_len": 16, **kwargs})
    else:
        config = DynBszBatching(**{"max_tokens_per_micro_batch": 16, "buffer_size": 4, **kwargs})
    return config.build(make_dataset(lengths, loss_mask=loss_mask), LoaderEnv(dp_rank, dp_size, seed))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(["rmpad", "dyn_bsz"]),
    lengths=st.lists(st.integers(1, 20), min_size=6, max_size=40),
    dp_size=st.integers(1, 3),
    seed=st.integers(0, 3),
)
def test_every_sample_once_per_epoch_disjoint_across_ranks_equal_counts(mode, lengths, dp_size, seed):
    to_sample = first_tokens(lengths)
    fitting = [i for i, n in enumerate(lengths) if n <= 16]
    try:
        streams = [build(mode, lengths, r, dp_size, seed) for r in range(dp_size)]
    except ValueError as error:  # too few samples for one micro-batch per rank
        assert "0 micro-batches per data-parallel rank" in str(error)
        return
    # Per rank and epoch: the samples of each micro-batch and the epoch's plan (the stream moves to the
    # next epoch when it hands out that epoch's first micro-batch; dyn_bsz plans differ by epoch).
    seen = [[[] for _ in range(2)] for _ in streams]
    plans, sizes = [None, None], []
    for rank, stream in enumerate(streams):
        while True:
            try:
                batch = next(stream)
            except ValueError as error:  # a later epoch's plan has fewer micro-batches than ranks
                assert mode == "dyn_bsz" and "gives 0 micro-batches on this data-parallel rank" in str(error)
                return
            if stream.epoch == 2:
                break
            seen[rank][stream.epoch].append(samples_of(batch, to_sample))
            plans[stream.epoch] = stream.loader.dataset.plan
            sizes.append(batch["input_ids"].shape[1])
    for epoch in range(2):
        assert len({len(seen[rank][epoch]) for rank in range(dp_size)}) == 1  # equal counts per rank
        samples = [i for rank in range(dp_size) for batch in seen[rank][epoch] for i in batch]
        assert len(samples) == len(set(samples)) and set(samples) <= set(fitting)  # disjoint, at most once
        if mode == "rmpad":
            assert all(len(batch) == 2 for rank in range(dp_size) for batch in seen[rank][epoch])
            assert len(samples) == len(fitting) // (2 * dp_size) * 2 * dp_size  # only the remainder left out
        else:
            plan = plans[epoch]
            dealt = plan.num_packs // dp_size * dp_size
            assert plan.num_packs - dealt < dp_size  # only the last M % dp micro-batches left out
            assert sorted(samples) == sorted(plan.sample_order[: plan.pack_offsets[dealt]].tolist())
            assert sorted(plan.sample_order.tolist()) == fitting
    if mode == "dyn_bsz":
        assert max(sizes) <= 16


def test_epochs_reshuffle_and_seed_decides_the_order():
    lengths = [3] * 12
    to_sample = first_tokens(lengths)
    stream = build("rmpad", lengths, seed=1)
    epoch0 = [samples_of(b, to_sample) for b in take(stream, 6)]
    epoch1 = [samples_of(b, to_sample) for b in take(stream, 6)]
    assert sorted(sum(epoch0, [])) == sorted(sum(epoch1, [])) == list(range(12))
    assert epoch0 != epoch1
    again = build("rmpad", lengths, seed=1)
    assert [samples_of(b, to_sample) for b in take(again, 6)] == epoch0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(["rmpad", "dyn_bsz"]),
    lengths=st.lists(st.integers(1, 16), min_size=12, max_size=30),
    consumed=st.integers(0, 12),
    dp_rank=st.integers(0, 1),
    pad=st.booleans(),
)
def test_resume_yields_exactly_the_remaining_micro_batches(mode, lengths, consumed, dp_rank, pad):
    def fresh():
        return build(mode, lengths, dp_rank, 2, seed=7, loss_mask=True, pad_packed_input=pad)

    reference = take(fresh(), consumed + 6)  # crosses at least one epoch boundary for small epochs
    stream = fresh()
    take(stream, consumed)
    state = stream.state_dict()
    resumed = fresh()
    resumed.load_state_dict(state)
    for expected, got in zip(reference[consumed:], take(resumed, 6)):
        assert expected.keys() == got.keys()
        for key in expected:
            assert torch.equal(expected[key], got[key]) if torch.is_tensor(expected[key]) else expected[key] == got[key]


def test_resume_with_a_worker_process():
    lengths = [5, 3, 8, 2, 7, 4, 6, 1, 3, 5]
    reference = take(build("dyn_bsz", lengths, seed=2, num_workers=1), 7)
    stream = build("dyn_bsz", lengths, seed=2, num_workers=1)
    take(stream, 3)
    resumed = build("dyn_bsz", lengths, seed=2, num_workers=1)
    resumed.load_state_dict(stream.state_dict())
    assert [b["input_ids"].tolist() for b in take(resumed, 4)] == [b["input_ids"].tolist() for b in reference[3:]]


def test_label_token_budget_caps_labels_and_length():
    lengths = [8, 2, 6, 4, 8, 3, 5, 7, 1, 6]
    stream = build(
        "dyn_bsz", lengths, loss_mask=True, count="label_tokens", max_tokens_per_micro_batch=5, max_packed_length=12
    )
    to_sample = first_tokens(lengths)
    seen = []
    for batch in take(stream, stream.batches_per_epoch):
        assert int((batch["labels"] != -100).sum()) <= 5
        assert batch["input_ids"].shape[1] <= 12
        seen += samples_of(batch, to_sample)
    assert sorted(seen) == list(range(len(lengths)))


# --- dropped samples are counted and reported ----------------------------------------------------


def test_long_samples_and_remainder_are_reported_once(caplog):
    with caplog.at_level(logging.WARNING, logger="automodel.data.flat_batching"):
        stream = build("rmpad", [3, 20, 4, 5, 2, 6, 7], dp_size=2, max_seq_len=8)
    messages = [r.getMessage() for r in caplog.records]
    assert "packing rmpad: dropped 1 of 7 samples (14.286%) longer than max_seq_len=8" in messages
    assert any("packing rmpad: 2 of 7 samples (28.571%) left out of epoch 0" in m for m in messages)
    assert len(messages) == 2
    take(stream, 3 * stream.batches_per_epoch)
    assert len(caplog.records) == 2


def test_dyn_bsz_drops_what_fits_no_micro_batch(caplog):
    with caplog.at_level(logging.WARNING, logger="automodel.data.flat_batching"):
        build("dyn_bsz", [5, 7, 9], cp_size=2, max_tokens_per_micro_batch=8)
    assert caplog.records[0].getMessage() == (
        "packing dyn_bsz: dropped 1 of 3 samples (33.333%) that alone exceed the length cap 8 "
        "(after padding to a multiple of 4)"
    )


# --- bad configs -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls, kwargs, match",
    [
        (RmpadBatching, dict(micro_batch_size=0), "packing.micro_batch_size must be a positive int, got 0"),
        (RmpadBatching, dict(max_seq_len=2.5), "packing.max_seq_len must be a positive int, got 2.5"),
        (RmpadBatching, dict(pad_packed_input="yes"), "packing.pad_packed_input must be true or false"),
        (RmpadBatching, dict(pad_packed_to_length=64), "has no effect without packing.pad_packed_input=true"),
        (RmpadBatching, dict(micro_batch_size=2, max_seq_len=8, pad_packed_input=True, pad_packed_to_length=12),
         r"pad_packed_to_length=12 is shorter than the longest possible micro-batch \(micro_batch_size \* max_seq_len = 16\)"),
        (RmpadBatching, dict(micro_batch_size=1, max_seq_len=10, cp_size=4, pad_packed_input=True),
         r"pad_packed_to_length=10 must be a multiple of 2\*cp_size=8 .* use 16"),
        (RmpadBatching, dict(num_workers=-1), "packing.num_workers must be an int >= 0"),
        (DynBszBatching, dict(count="samples"), r"packing.count must be one of \('tokens', 'label_tokens'\)"),
        (DynBszBatching, dict(buffer_size=0), "packing.buffer_size must be a positive int, got 0"),
        (DynBszBatching, dict(max_tokens_per_micro_batch=-8), "max_tokens_per_micro_batch must be a positive int"),
        (DynBszBatching, dict(max_packed_length=64), "max_packed_length applies only to count=label_tokens"),
        (DynBszBatching, dict(count="label_tokens"), "count=label_tokens needs packing.max_packed_length"),
        (DynBszBatching, dict(count="label_tokens", max_tokens_per_micro_batch=64, max_packed_length=32),
         "the label budget could never be reached"),
        (DynBszBatching, dict(max_tokens_per_micro_batch=64, pad_packed_input=True, pad_packed_to_length=32),
         r"shorter than the longest possible micro-batch \(max_tokens_per_micro_batch = 64\)"),
        (DynBszBatching, dict(max_tokens_per_micro_batch=30, cp_size=2, pad_packed_input=True),
         r"pad_packed_to_length=30 must be a multiple of 2\*cp_size=4"),
    ],
)
def test_bad_configs(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_bad_config_from_a_recipe_override_names_the_section():
    cfg = load_recipe("tiny_llama_sft", ["packing=dyn_bsz", "packing.count=label_tokens"])
    with pytest.raises(ConfigError, match="packing: packing.count=label_tokens needs packing.max_packed_length"):
        build_section(cfg, "packing")


@pytest.mark.parametrize(
    "rows, match",
    [
        ([{"input_ids": [1, 2]}], r"dataset lacks column\(s\) \['labels'\]"),
        ([{"input_ids": [1, 2], "labels": [1]}], "sample 0: labels has 1 entries but input_ids has 2"),
        ([{"input_ids": [1], "labels": [1]}, {"input_ids": [], "labels": []}], "sample 1 has an empty input_ids"),
    ],
)
def test_malformed_datasets(rows, match):
    with pytest.raises(ValueError, match=match):
        RmpadBatching().build(datasets.Dataset.from_list(rows), LoaderEnv())


def test_flatten_samples_rejects_bad_samples():
    with pytest.raises(ValueError, match="at least one sample"):
        flatten_samples([])
    with pytest.raises(ValueError, match=r"sample 0 lacks \['labels'\]"):
        flatten_samples([{"input_ids": [1]}])
    with pytest.raises(ValueError, match="sample 0: loss_mask has 1 entries but input_ids has 2"):
        flatten_samples([{"input_ids": [1, 2], "labels": [1, 2], "loss_mask": [1]}])
