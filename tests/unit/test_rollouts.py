"""slime's RL packing API: pack -> pad for CP -> unpack gives every field of every sample back."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from automodel.data.rollouts import (
    pack_sequences,
    pad_packed_sequence_with_cp,
    to_thd_batch,
    unpack_sequences,
)
from automodel.distributed import make_cp_batch_for_te


@st.composite
def rollouts(draw):
    k = draw(st.integers(1, 12))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    lengths = rng.integers(1, 40, k)
    tokens = [rng.integers(0, 50, n).tolist() for n in lengths]  # 0 is a real token here
    responses = [int(rng.integers(0, n)) for n in lengths]
    per_token = lambda: [rng.normal(size=r).astype(np.float32).tolist() for r in responses]  # noqa: E731
    return dict(
        tokens=tokens, loss_masks=[rng.integers(0, 2, r).tolist() for r in responses],
        rewards=rng.normal(size=k).astype(np.float32).tolist(), raw_rewards=[{"score": i} for i in range(k)],
        response_lengths=responses, advantages=per_token(), returns=per_token(),
        rollout_log_probs=per_token() if draw(st.booleans()) else None,
    )  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(
    rollouts(),
    st.integers(1, 4),
    st.one_of(st.none(), st.integers(40, 120)),
    st.one_of(st.none(), st.integers(1, 4)),
)
def test_unpack_of_padded_pack_returns_every_field(x, cp_size, cap, num_packs):
    if num_packs is not None:
        num_packs = min(num_packs, len(x["tokens"]))
    packs = pack_sequences(**x, max_tokens_per_gpu=cap, num_packs=num_packs)
    seen = []
    for pack in packs:
        assert cap is None or len(pack["tokens"]) <= cap  # the cap holds
        padded = pad_packed_sequence_with_cp(pack, cp_size)
        assert int(padded["cu_seqlens"][-1]) == len(padded["tokens"])
        assert all(
            int(d) % (2 * cp_size if cp_size > 1 else 1) == 0 for d in torch.diff(padded["cu_seqlens"])
        )
        for i, sample in zip(pack["sample_indices"], unpack_sequences(padded)):
            seen.append(i)
            assert sample["tokens"].tolist() == x["tokens"][i]
            assert sample["position_ids"].tolist() == list(range(len(x["tokens"][i])))
            assert sample["loss_masks"].tolist() == x["loss_masks"][i]
            assert sample["advantages"].tolist() == x["advantages"][i]
            assert sample["returns"].tolist() == x["returns"][i]
            assert (
                sample["rollout_log_probs"].tolist() == (x["rollout_log_probs"] or [[]] * len(x["tokens"]))[i]
            )
            assert float(sample["rewards"]) == x["rewards"][i]
            assert sample["raw_reward"] == x["raw_rewards"][i]
            assert sample["response_lengths"] == x["response_lengths"][i]
            n, r = len(x["tokens"][i]), x["response_lengths"][i]
            labelled = [t for t in sample["labels"].tolist() if t != -100]
            assert labelled == x["tokens"][i][n - r :]  # the response, predicted one position earlier
    assert sorted(seen) == list(range(len(x["tokens"])))
    if num_packs is not None:
        assert len(packs) >= num_packs


def test_example_layout_and_cp_padding():
    packs = pack_sequences(
        [[5, 6, 7], [8, 9]], [[1], [1]], [1.0, 0.0], ["a", "b"], [1, 1], [[0.5], [-0.5]], [[1.0], [0.0]]
    )
    (pack,) = packs
    assert pack["tokens"].tolist() == [5, 6, 7, 8, 9]
    assert pack["labels"].tolist() == [-100, 7, -100, 9, -100]
    assert pack["cu_seqlens"].tolist() == [0, 3, 5]
    padded = pad_packed_sequence_with_cp(pack, 2)
    assert padded["tokens"].tolist() == [5, 6, 7, 0, 8, 9, 0, 0]
    assert padded["cu_seqlens"].tolist() == [0, 4, 8]
    assert padded["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    # the pack feeds the CP sharding of the training path: rank 1 holds chunks 1 and 2 of each sample
    thd = make_cp_batch_for_te(None, to_thd_batch(padded), cp_size=2, cp_rank=1)
    assert thd["input_ids"].tolist() == [6, 7, 9, 0]
    assert thd["cu_seqlens"].tolist() == [0, 3, 5]


def test_cap_is_kept_where_ceil_of_total_over_cap_is_too_few():
    # ceil(24 / 10) = 3 packs cannot hold four 6-token samples under 10 tokens each: four packs
    packs = pack_sequences([[1] * 6] * 4, [[1]] * 4, [0.0] * 4, [0] * 4, [1] * 4, [[0.0]] * 4, [[0.0]] * 4,
                           max_tokens_per_gpu=10)  # fmt: skip
    assert [len(p["tokens"]) for p in packs] == [6, 6, 6, 6]


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(response_lengths=[3, 1]), r"response_lengths\[0\]=3 must be an int in \[0, 3\)"),
        (
            dict(advantages=[[0.5, 1.0], [0.0]]),
            r"advantages\[0\] has 2 entries; sample 0 has 1 response tokens",
        ),
        (dict(rewards=[1.0]), "rewards has 1 entries for 2 samples"),
    ],
)
def test_bad_rollouts_are_named(change, message):
    x = dict(tokens=[[5, 6, 7], [8, 9]], loss_masks=[[1], [1]], rewards=[1.0, 0.0], raw_rewards=["a", "b"],
             response_lengths=[1, 1], advantages=[[0.5], [-0.5]], returns=[[1.0], [0.0]])  # fmt: skip
    with pytest.raises(ValueError, match=message):
        pack_sequences(**{**x, **change})


def test_unknown_key_is_refused():
    (pack,) = pack_sequences([[5, 6]], [[1]], [1.0], [None], [1], [[0.0]], [[0.0]])
    with pytest.raises(ValueError, match="key 'values'"):
        unpack_sequences({**pack, "values": torch.zeros(3)})
