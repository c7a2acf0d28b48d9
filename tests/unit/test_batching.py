"""The epoch engine under every batching mode (one contract), the row builder, and the planners."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from automodel.data.batching import (
    BalancedBatching,
    DynBszBatching,
    LoaderEnv,
    PackedBatching,
    PaddedBatching,
    RmpadBatching,
    plan_balanced_epoch,
)
from automodel.data.collate import build_row, padded_sequence_thd_collater
from automodel.data.planning import karmarkar_karp, plan_balanced_packs, plan_packs, plan_token_budget
from automodel.data.preference import SIDES, PreferenceBatching
from automodel.data.streaming import StreamingPackedBatching
from automodel.distributed import make_cp_batch_for_te, process_input_for_thd

MARK = 1000  # a sample's first token is MARK + its index, so a batch tells which samples it holds


def tagged_dataset(lengths) -> datasets.Dataset:
    rows = [{"input_ids": [MARK + i] + [7] * (n - 1), "labels": [1] * n} for i, n in enumerate(lengths)]
    return datasets.Dataset.from_list(rows)


LENGTHS = np.random.default_rng(0).integers(1, 30, 90).tolist()
DATA = tagged_dataset(LENGTHS)


def sample_ids(batch) -> list[int]:
    ids = []
    for row, padded in zip(batch["input_ids"], batch["seq_lens_padded"]):
        padded = padded[padded > 0]
        ids += (row[torch.cumsum(padded, 0) - padded] - MARK).tolist()
    return ids


MODES = {
    "bfd": PackedBatching(packed_sequence_size=64, micro_batch_size=2),
    "sequential": PackedBatching(algorithm="sequential", packed_sequence_size=64, micro_batch_size=1),
    "none": PaddedBatching(micro_batch_size=4, max_length=28),
    "rmpad": RmpadBatching(micro_batch_size=3, max_seq_len=32),
    "rmpad-static": RmpadBatching(micro_batch_size=3, max_seq_len=32, pad_packed_input=True),
    "dyn_bsz": DynBszBatching(max_tokens_per_micro_batch=64, buffer_size=8),
    "dyn_bsz-labels": DynBszBatching(
        max_tokens_per_micro_batch=40, count="label_tokens", max_packed_length=64
    ),
    "balanced": BalancedBatching(packed_sequence_size=64, micro_batch_size=3, packs_per_rank=2),
}


def take(stream, n):
    return [next(stream) for _ in range(n)]


@pytest.mark.parametrize("cp_size", [1, 2])
@pytest.mark.parametrize("name", list(MODES))
def test_contract(name, cp_size):
    mode = MODES[name]
    envs = [LoaderEnv(dp_rank=r, dp_size=2, cp_size=cp_size, seed=3) for r in range(2)]
    ranks = [mode.build(DATA, env) for env in envs]
    per_rank = ranks[0].batches_per_epoch
    assert per_rank == ranks[1].batches_per_epoch > 0  # equal counts
    epoch0 = [take(stream, per_rank) for stream in ranks]
    seen = [sample_ids(b) for rank in epoch0 for b in rank]
    flat = [i for ids in seen for i in ids]
    assert len(flat) == len(set(flat))  # DP ranks disjoint, nothing twice in an epoch
    plan = ranks[0].plan(
        0
    )  # every kept sample is in the plan once; the dealt ones are exactly what ranks got
    kept_samples = set()
    for batch_index in range(plan.num_packs):
        units = plan.sample_order[plan.pack_offsets[batch_index] : plan.pack_offsets[batch_index + 1]]
        kept_samples |= set(units.tolist()) if name not in ("bfd", "sequential") else set()
    if name not in ("bfd", "sequential"):
        assert kept_samples == set(ranks[0].prepared.kept.tolist())
        dealt = plan.pack_offsets[per_rank * 2]
        assert sorted(flat) == sorted(plan.sample_order[:dealt].tolist())
    else:
        dealt_packs = plan.sample_order[: plan.pack_offsets[per_rank * 2]]
        assert len(flat) == sum(
            int((np.asarray(ranks[0].prepared.units[int(p)]["seq_lens"]) > 0).sum()) for p in dealt_packs
        )
    # CP ranks of a group (same dp_rank) get the same micro-batches
    twin = mode.build(DATA, envs[0])
    for a, b in zip(epoch0[0][:2], take(twin, 2)):
        assert all(torch.equal(a[k], b[k]) for k in ("input_ids", "labels", "seq_lens_padded"))
    # the next epoch is reshuffled
    epoch1 = take(ranks[0], per_rank)
    assert ranks[0].epoch == 1
    assert [sample_ids(b) for b in epoch1] != [sample_ids(b) for b in epoch0[0]]
    # rows go through the THD path; real tokens are the samples' lengths, CP-padded lengths divide by 2W
    for batch in epoch0[0][:2]:
        thd = make_cp_batch_for_te(None, batch, cp_size=cp_size, cp_rank=0)
        assert int((~process_input_for_thd(batch)["padding_mask"]).sum()) == sum(
            LENGTHS[i] for i in sample_ids(batch)
        )
        assert thd["input_ids"].numel() * cp_size == batch["input_ids"].numel()


@pytest.mark.parametrize("name", ["bfd", "rmpad", "dyn_bsz", "balanced"])
def test_mid_epoch_resume_is_identical(name):
    env = LoaderEnv(dp_rank=1, dp_size=2, seed=5)
    stream = MODES[name].build(DATA, env)
    take(stream, 3)
    state = stream.state_dict()
    assert state["consumed"] == 6 and state["epoch"] == 0  # global position
    rest = take(stream, stream.batches_per_epoch)  # crosses into epoch 1
    resumed = MODES[name].build(DATA, env)
    resumed.load_state_dict(state)
    for a, b in zip(rest, take(resumed, len(rest))):
        assert torch.equal(a["input_ids"], b["input_ids"])


@pytest.mark.parametrize("name", ["bfd", "rmpad", "dyn_bsz"])
def test_resume_on_another_dp_size_continues_the_global_sequence(name):
    mode = MODES[name]
    single = mode.build(DATA, LoaderEnv(seed=2))
    global_sequence = [sample_ids(b) for b in take(single, 12)]
    ranks = [mode.build(DATA, LoaderEnv(dp_rank=r, dp_size=2, seed=2)) for r in range(2)]
    got = [[sample_ids(b) for b in take(stream, 4)] for stream in ranks]
    assert [got[k % 2][k // 2] for k in range(8)] == global_sequence[:8]  # 2 ranks x 4 batches
    states = [stream.state_dict() for stream in ranks]
    assert states[0] == states[1]
    resumed = mode.build(DATA, LoaderEnv(seed=2))  # one rank now
    resumed.load_state_dict(states[0])
    assert [sample_ids(b) for b in take(resumed, 4)] == global_sequence[8:]


def test_balanced_refuses_another_dp_size():
    state = MODES["balanced"].build(DATA, LoaderEnv(dp_size=2, seed=1)).state_dict()
    with pytest.raises(ValueError, match="fingerprint"):
        MODES["balanced"].build(DATA, LoaderEnv(seed=1)).load_state_dict(state)


@pytest.mark.parametrize("name", ["bfd", "none", "rmpad", "dyn_bsz", "balanced"])
def test_build_eval_covers_every_sample_once_with_equal_counts(name):
    passes = [list(MODES[name].build_eval(DATA, LoaderEnv(dp_rank=r, dp_size=4))) for r in range(4)]
    assert len({len(p) for p in passes}) == 1
    real = [i for p in passes for b in p if (b["labels"] != -100).any() for i in sample_ids(b)]
    fillers = [b for p in passes for b in p if (b["labels"] == -100).all()]
    expected = [i for i, n in enumerate(LENGTHS) if n <= {"none": 28, "rmpad": 32}.get(name, 64)]
    assert sorted(real) == expected and len(fillers) < 4


@pytest.mark.parametrize(
    "mode, limit",
    [
        (PackedBatching(packed_sequence_size=16), "packed_sequence_size=16"),
        (PaddedBatching(max_length=16), "packing.max_length=16"),
        (RmpadBatching(max_seq_len=16), "packing.max_seq_len=16"),
        (DynBszBatching(max_tokens_per_micro_batch=16), "packing.max_tokens_per_micro_batch=16"),
        (
            DynBszBatching(max_tokens_per_micro_batch=16, count="label_tokens", max_packed_length=16),
            "packing.max_packed_length=16",
        ),
        (BalancedBatching(packed_sequence_size=16), "packing.packed_sequence_size=16"),
    ],
)
def test_over_long_samples_are_reported_with_the_limit_they_exceed(mode, limit, caplog):
    mode.build(tagged_dataset([10, 20, 5, 30]), LoaderEnv())
    assert (
        f"dropped 2 of 4 samples (50.000%), 50 of 65 tokens (76.923%), longer than {limit} tokens"
        in caplog.text
    )


def test_streaming_contract():
    mode = StreamingPackedBatching(
        packed_sequence_size=64, micro_batch_size=1, steps_per_epoch=6, buffer_size=10
    )
    rows = DATA.to_iterable_dataset(num_shards=2)
    ranks = [mode.build(rows, LoaderEnv(dp_rank=r, dp_size=2, seed=4)) for r in range(2)]
    epoch0 = [[sample_ids(b) for b in take(stream, 6)] for stream in ranks]
    seen = [i for rank in epoch0 for ids in rank for i in ids]
    assert len(seen) == len(set(seen))  # disjoint shares, no sample twice within a pass
    state = ranks[0].state_dict()
    assert state == ranks[1].state_dict() and state["consumed"] == 12
    epoch1 = [sample_ids(b) for b in take(ranks[0], 3)]
    assert ranks[0].epoch == 1 and epoch1 != epoch0[0][:3]
    resumed = mode.build(rows, LoaderEnv(dp_rank=0, dp_size=2, seed=4))
    resumed.load_state_dict(state)
    assert [sample_ids(b) for b in take(resumed, 3)] == epoch1
    with pytest.raises(ValueError, match="fingerprint"):
        mode.build(rows, LoaderEnv(seed=4)).load_state_dict(state)


@pytest.mark.parametrize(
    "mode, field",
    [
        (lambda: PackedBatching(algorithm="ffd"), "algorithm"),
        (lambda: PackedBatching(micro_batch_size=0), "micro_batch_size"),
        (lambda: PaddedBatching(shuffle="yes"), "shuffle"),
        (lambda: RmpadBatching(pad_packed_to_length=64), "pad_packed_to_length"),
        (
            lambda: RmpadBatching(max_seq_len=8, pad_packed_input=True, pad_packed_to_length=4),
            "pad_packed_to_length",
        ),
        (lambda: DynBszBatching(count="label_tokens"), "max_packed_length"),
        (lambda: DynBszBatching(count="words"), "count"),
        (lambda: BalancedBatching(cost_coefficients=(0, 0)), "cost_coefficients"),
        (lambda: StreamingPackedBatching(steps_per_epoch=0), "steps_per_epoch"),
    ],
)
def test_bad_sections_name_the_field(mode, field):
    with pytest.raises(ValueError, match=field):
        mode()


def test_too_few_micro_batches_for_the_ranks():
    with pytest.raises(ValueError, match="dp_size"):
        RmpadBatching(micro_batch_size=100).build(DATA, LoaderEnv(dp_size=2))


# --- the row builder, worked by hand ------------------------------------------------------------


def test_build_row_layout_and_tail_padding():
    a = {"input_ids": [11, 12, 13, 14], "labels": [12, 13, 14, 15], "loss_mask": [0, 1, 1, 1]}
    b = {"input_ids": [21, 22], "labels": [22, 23]}
    row = build_row([a, b], padding_idx=0, cp_size=1, length=8)
    assert row["input_ids"].tolist() == [11, 12, 13, 14, 21, 22, 0, 0]
    assert row["labels"].tolist() == [-100, 13, 14, 15, 22, 23, -100, -100]
    assert row["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert row["seq_lens"].tolist() == [4, 2] and row["seq_lens_padded"].tolist() == [4, 4]
    cp = build_row([b, a], padding_idx=9, cp_size=2)
    assert cp["input_ids"].tolist() == [21, 22, 9, 9, 11, 12, 13, 14]
    assert cp["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert cp["seq_lens_padded"].tolist() == [4, 4]
    with pytest.raises(ValueError, match="length"):
        build_row([a, b], cp_size=2, length=10)  # 8 tokens + 2 is not a multiple of 4


def test_pad_packed_input_counts_only_real_tokens():
    """The issue's defect: samples of 4 and 2 tokens padded to 10 reported 10 real tokens."""
    data = tagged_dataset([4, 2])
    mode = RmpadBatching(micro_batch_size=2, max_seq_len=5, pad_packed_input=True, shuffle=False)
    batch = next(mode.build(data, LoaderEnv()))
    assert batch["input_ids"].shape == (1, 10)
    assert batch["seq_lens"].tolist() == [[4, 2]] and batch["seq_lens_padded"].tolist() == [[4, 6]]
    thd = process_input_for_thd(batch)
    assert int((~thd["padding_mask"]).sum()) == 6
    assert thd["cu_seqlens"].tolist() == [0, 4, 6] and thd["cu_seqlens_padded"].tolist() == [0, 4, 10]


def test_veomni_examples():
    data = datasets.Dataset.from_list(
        [{"input_ids": s, "labels": s} for s in ([1, 2, 3, 4], [5, 6], [7, 8, 9], [10])]
    )
    rmpad = RmpadBatching(micro_batch_size=2, max_seq_len=4, shuffle=False).build(data, LoaderEnv())
    first, second = take(rmpad, 2)
    assert first["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6]] and first["position_ids"].tolist() == [
        [0, 1, 2, 3, 0, 1]
    ]
    assert second["input_ids"].tolist() == [[7, 8, 9, 10]] and second["position_ids"].tolist() == [
        [0, 1, 2, 0]
    ]
    dyn = next(DynBszBatching(max_tokens_per_micro_batch=10, shuffle=False).build(data, LoaderEnv()))
    assert dyn["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2, 0]]


def test_padded_collater():
    batch = padded_sequence_thd_collater(
        [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8], "labels": [8]}], cp_size=1
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["seq_lens"].tolist() == [[3], [1]] and batch["seq_lens_padded"].tolist() == [[3], [3]]


# --- planners: hand-worked examples and properties ---------------------------------------------


def test_token_budget_example():
    plan = plan_token_budget(
        np.arange(4), np.array([4, 2, 3, 1]), np.array([4, 2, 3, 1]), 6, 6, buffer_size=4
    )
    assert plan.sample_order.tolist() == [0, 1, 2, 3] and plan.pack_offsets.tolist() == [0, 2, 4]


def test_balanced_examples():
    assert karmarkar_karp([8, 7, 6, 5, 4], 2) == [[1, 3, 4], [0, 2]]
    plan = plan_balanced_packs(np.array([6, 6, 6, 2]), max_tokens_per_gpu=10)
    assert plan.num_packs == 3 and plan.sample_order[: plan.pack_offsets[1]].tolist() == [0, 3]
    epoch = plan_balanced_epoch(np.arange(4), np.array([8, 7, 6, 5]), dp_size=2, samples_per_pack=2)
    assert epoch.sample_order.tolist() == [0, 3, 1, 2] and epoch.pack_offsets.tolist() == [0, 2, 4]


lengths_lists = st.lists(st.integers(1, 50), min_size=1, max_size=60)


def assert_partition_within(plan, lengths: np.ndarray, cap: int) -> None:
    """The plan holds every sample exactly once, and no pack more than ``cap`` tokens."""
    assert sorted(plan.sample_order.tolist()) == list(range(len(lengths)))
    assert np.add.reduceat(lengths[plan.sample_order], plan.pack_offsets[:-1]).max() <= cap


@settings(max_examples=30, deadline=None)
@given(lengths=lengths_lists, algorithm=st.sampled_from(["bfd", "sequential"]))
def test_every_sample_packed_once_within_capacity(lengths, algorithm):
    lengths = np.array(lengths)
    plan = plan_packs(lengths, 50, algorithm)
    assert_partition_within(plan, lengths, 50)


@settings(max_examples=30, deadline=None)
@given(lengths=lengths_lists, buffer_size=st.integers(1, 20))
def test_token_budget_uses_every_sample_once(lengths, buffer_size):
    lengths = np.array(lengths)
    plan = plan_token_budget(np.arange(len(lengths))[::-1], lengths, lengths, 60, 60, buffer_size)
    assert_partition_within(plan, lengths, 60)


@settings(max_examples=20, deadline=None)
@given(lengths=lengths_lists, num_packs=st.integers(1, 4))
def test_balanced_packs_partition_the_samples(lengths, num_packs):
    lengths = np.array(lengths)
    plan = plan_balanced_packs(lengths, num_packs=min(num_packs, len(lengths)), max_tokens_per_gpu=80)
    assert_partition_within(plan, lengths, 80)


def test_bfd_epoch_zero_is_not_in_length_order():
    """BFD opens packs longest first; its pack shuffle and the epoch order are separate streams, so
    epoch 0 does not undo the shuffle (it once did: numpy seeds ``seed`` and ``(seed, 0)`` alike, and
    the default recipe then saw packs of long samples first and a loss spike at the short ones)."""
    lengths = np.random.default_rng(2).integers(1, 60, 400).tolist()
    stream = PackedBatching(packed_sequence_size=64).build(tagged_dataset(lengths), LoaderEnv(seed=1234))
    longest = [max(lengths[i] for i in sample_ids(next(stream))) for _ in range(stream.batches_per_epoch)]
    assert longest != sorted(longest, reverse=True)
    falls = sum(a > b for a, b in zip(longest, longest[1:]))
    assert falls < 0.75 * len(longest), longest  # sorted order would fall at nearly every step


def test_each_mode_says_what_a_micro_batch_holds_and_the_log_scales_it_by_dp():
    """The ``global batch per optimizer step`` line of a run's setup: micro-batches per step over all
    ranks, the most tokens they hold, and what ``max_steps`` covers (DP 2: twice one process's)."""
    from automodel.data.preference import PreferenceBatching
    from automodel.training.finetune import global_batch

    assert PackedBatching(micro_batch_size=2).micro_batch() == ("2 packs of up to 2,048 tokens", 4096)
    assert PaddedBatching().micro_batch() == ("8 sample(s) of up to 2,048 tokens, padded", 16384)
    assert RmpadBatching(micro_batch_size=4, max_seq_len=512).micro_batch() == (
        "4 sample(s) in one row of up to 2,048 tokens", 2048)  # fmt: skip
    assert DynBszBatching(count="label_tokens", max_packed_length=8192).micro_batch() == (
        "one row of up to 8,192 tokens, 4,096 label tokens at most", 8192)  # fmt: skip
    assert BalancedBatching().micro_batch() == ("1 pack of up to 16,384 tokens", 16384)
    assert StreamingPackedBatching().micro_batch() == ("1 pack of up to 2,048 tokens", 2048)
    assert PreferenceBatching().micro_batch() == ("4 preference pairs in one row (chosen and rejected)", None)
    tail = "metrics.jsonl's label_tokens and real_tokens are per step, over all ranks"
    assert global_batch(1, 2, PackedBatching(), 120) == (
        "global batch per optimizer step: 2 micro-batches (dp 1 x grad_accum_steps 2), each 1 pack of up to 2,048 "
        f"tokens: up to 4,096 tokens per step; max_steps 120 covers 240 micro-batches; {tail}")  # fmt: skip
    assert global_batch(2, 2, PackedBatching(), 120) == (
        "global batch per optimizer step: 4 micro-batches (dp 2 x grad_accum_steps 2), each 1 pack of up to 2,048 "
        "tokens: up to 8,192 tokens per step; max_steps 120 covers 480 micro-batches (2x one process's at this "
        f"grad_accum_steps); {tail}")  # fmt: skip


@pytest.mark.parametrize("max_sample", [None, 20])
@pytest.mark.parametrize("cp_size", [1, 2])
@pytest.mark.parametrize("name", [*MODES, "streaming", "preference"])
def test_length_bounds_hold_every_micro_batch_of_an_epoch(name, cp_size, max_sample):
    """What the check at setup is told (``length_bounds``): no sample and no micro-batch row of the
    mode is longer, with samples of at most ``max_sample`` tokens (data.max_length) or unbounded."""
    lengths = [min(n, max_sample or n) for n in LENGTHS]
    env = LoaderEnv(cp_size=cp_size, seed=5)
    if name == "streaming":
        mode = StreamingPackedBatching(packed_sequence_size=64, micro_batch_size=2, steps_per_epoch=12)
        batches = take(mode.build(tagged_dataset(lengths).to_iterable_dataset(), env), 12)
    elif name == "preference":
        mode = PreferenceBatching(pairs_per_micro_batch=3)
        sides = {
            f"{side}_{c}": tagged_dataset(lengths[k::2])[c]
            for k, side in enumerate(SIDES)
            for c in ("input_ids", "labels")
        }
        pairs = datasets.Dataset.from_dict(
            {**sides, **{f"{s}_loss_mask": sides[f"{s}_labels"] for s in SIDES}}
        )
        stream = mode.build(pairs, env)
        batches = take(stream, stream.batches_per_epoch)
    else:
        mode = MODES[name]
        stream = mode.build(tagged_dataset(lengths), env)
        batches = take(stream, stream.batches_per_epoch)
    sample, row = mode.length_bounds(max_sample, cp_size)
    if name == "preference" and max_sample is None:
        assert (sample, row) == (None, None)  # measured on the tokenized pairs instead
        return
    for batch in batches:
        assert int(batch["seq_lens"][batch["seq_lens"] > 0].max()) <= sample
        assert batch["input_ids"].numel() <= row
    assert max(int(b["input_ids"].numel()) for b in batches) > row // 4  # a bound, not a blind guess
