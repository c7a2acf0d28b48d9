"""Collater, THD conversion and CP sharding: hand-worked values, properties, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from automodel.data import packed_sequence_thd_collater
from automodel.distributed import make_cp_batch_for_te, process_input_for_thd, thd_get_partitioned_indices

I32 = torch.int32


def cu(values):
    return torch.tensor(values, dtype=I32)


def te_kernel_reference(cu_seqlens_padded, total_tokens, world_size, rank):
    """TE's kernel arithmetic token by token, as documented in te-thd-cp.md: with cu_s = cu // W, local
    token j belongs to the last sequence s with cu_s[s] <= j (searching entries 1..batch-1, clamped
    to [0, batch-1]); L = cu_s[s+1]-cu_s[s], i = j-cu_s[s], half = L//2,
    chunk = r if i < half else 2W-2-r; result i + cu_s[s]*W + half*chunk."""
    cu_s = [int(c) // world_size for c in cu_seqlens_padded]
    batch = len(cu_s) - 1
    out = []
    for j in range(total_tokens // world_size):
        s = 0
        for k in range(1, batch):
            if cu_s[k] <= j:
                s = k
        length, i = cu_s[s + 1] - cu_s[s], j - cu_s[s]
        half = length // 2
        chunk = rank if i < half else 2 * world_size - 2 - rank
        out.append(i + cu_s[s] * world_size + half * chunk)
    return out


# --- packed_sequence_thd_collater -----------------------------------------------------------


def test_collater_stacks_and_pads_seq_lens():
    packs = [
        {
            "input_ids": [1, 2, 3, 9, 4, 5],
            "labels": [2, 3, -100, -100, 5, -100],
            "position_ids": [0, 1, 2, 3, 0, 1],
            "seq_lens": [3, 2],
            "seq_lens_padded": [4, 2],
        },
        {
            "input_ids": np.arange(6),
            "labels": torch.arange(6),
            "position_ids": list(range(6)),
            "seq_lens": [6],
            "seq_lens_padded": [6],
        },
    ]
    batch = packed_sequence_thd_collater(packs)
    assert batch["qkv_format"] == "thd"
    assert batch["input_ids"].dtype == torch.int64 and batch["input_ids"].shape == (2, 6)
    assert batch["labels"][1].tolist() == [0, 1, 2, 3, 4, 5]
    assert batch["seq_lens"].tolist() == [[3, 2], [6, -1000]]
    assert batch["seq_lens_padded"].tolist() == [[4, 2], [6, -1000]]


def test_collater_empty_and_bad_batches():
    assert packed_sequence_thd_collater([]) == {}
    pack = {
        "input_ids": [1, 2],
        "labels": [1, 2],
        "position_ids": [0, 1],
        "seq_lens": [2],
        "seq_lens_padded": [2],
    }
    with pytest.raises(ValueError, match="input_ids"):
        packed_sequence_thd_collater([pack, dict(pack, input_ids=[1, 2, 3])])
    with pytest.raises(ValueError, match="seq_lens_padded"):
        packed_sequence_thd_collater([pack, {k: v for k, v in pack.items() if k != "seq_lens_padded"}])
    with pytest.raises(ValueError, match="labels"):
        packed_sequence_thd_collater([dict(pack, labels=[1])])


# --- process_input_for_thd ------------------------------------------------------------------


def nemo_docstring_batch():
    return {
        "input_ids": torch.tensor([[1, 2, 3, 99, 4, 5], [6, 7, 8, 9, 10, 11]]),
        "labels": torch.tensor([[2, 3, 99, 4, 5, 6], [7, 8, 9, 10, 11, 12]]),
        "position_ids": torch.tensor([[0, 1, 2, 0, 0, 1], [0, 1, 2, 3, 4, 5]]),
        "seq_lens": torch.tensor([[3, 2], [6, -1000]]),
        "seq_lens_padded": torch.tensor([[4, 2], [6, -1000]]),
        "qkv_format": "thd",
    }


def test_process_input_for_thd_worked_example():
    out = process_input_for_thd(nemo_docstring_batch())
    assert out["input_ids"].tolist() == [1, 2, 3, 99, 4, 5, 6, 7, 8, 9, 10, 11]
    assert out["position_ids"].tolist() == [0, 1, 2, 0, 0, 1, 0, 1, 2, 3, 4, 5]
    assert out["cu_seqlens"].dtype == I32 and out["cu_seqlens"].tolist() == [0, 3, 5, 11]
    assert out["cu_seqlens_padded"].dtype == I32 and out["cu_seqlens_padded"].tolist() == [0, 4, 6, 12]
    assert out["max_seqlen"].dtype == I32 and int(out["max_seqlen"]) == 6
    assert out["padding_mask"].tolist() == [False] * 3 + [True] + [False] * 8
    assert out["qkv_format"] == "thd"
    assert "seq_lens" not in out and "seq_lens_padded" not in out


def test_padding_mask_comes_from_layout_not_token_ids():
    # pad id 0 also appears as a real token (e.g. pad == eos): only the layout marks padding
    batch = {
        "input_ids": torch.tensor([[0, 5, 0, 0]]),
        "labels": torch.tensor([[5, 0, -100, -100]]),
        "position_ids": torch.tensor([[0, 1, 2, 3]]),
        "seq_lens": torch.tensor([[2]]),
        "seq_lens_padded": torch.tensor([[4]]),
    }
    out = process_input_for_thd(batch, padding_token_id=0)
    assert out["padding_mask"].tolist() == [False, False, True, True]


def test_embeddings_input_keeps_hidden_dim():
    batch = nemo_docstring_batch()
    batch["input_ids"] = torch.randn(2, 6, 3)
    out = process_input_for_thd(batch)
    assert out["input_ids"].shape == (12, 3)
    assert torch.equal(out["input_ids"][6:], batch["input_ids"][1])


@pytest.mark.parametrize(
    "change, match",
    [
        (
            {"seq_lens": torch.tensor([[3, -1000], [6, -1000]])},
            "must use the sentinel -1000 in the same places",
        ),
        (
            {
                "seq_lens": torch.tensor([[-1000, 3], [6, -1000]]),
                "seq_lens_padded": torch.tensor([[-1000, 6], [6, -1000]]),
            },
            "sentinel -1000 may only right-pad seq_lens",
        ),
        (
            {"seq_lens": torch.tensor([[5, 2], [6, -1000]])},
            r"sequence 0: need 0 <= seq_lens <= seq_lens_padded, got 5 and 4",
        ),
        (
            {"seq_lens_padded": torch.tensor([[4, 3], [6, -1000]])},
            r"pack 0: seq_lens_padded \[4, 3\] sums to 7, more than the S=6 tokens",
        ),
        ({"labels": torch.zeros(2, 5, dtype=torch.long)}, r"labels must have shape \[B, S\]=\(2, 6\)"),
        ({"seq_lens": torch.tensor([3, 2])}, r"seq_lens and seq_lens_padded must both be \[B, D\]"),
    ],
)
def test_process_input_for_thd_bad_layouts(change, match):
    with pytest.raises(ValueError, match=match):
        process_input_for_thd({**nemo_docstring_batch(), **change})


def test_process_input_for_thd_missing_key():
    batch = nemo_docstring_batch()
    del batch["position_ids"]
    with pytest.raises(ValueError, match=r"lacks \['position_ids'\]"):
        process_input_for_thd(batch)


# --- thd_get_partitioned_indices ------------------------------------------------------------


def test_partition_one_sequence_two_ranks():
    # 8 tokens, W=2 -> 4 chunks of 2; rank 0 takes chunks 0 and 3, rank 1 chunks 1 and 2
    assert thd_get_partitioned_indices(cu([0, 8]), 8, 2, 0).tolist() == [0, 1, 6, 7]
    assert thd_get_partitioned_indices(cu([0, 8]), 8, 2, 1).tolist() == [2, 3, 4, 5]


def test_partition_two_sequences_and_an_empty_one():
    # sequences of 4, 0 and 8 tokens, W=2: chunk sizes 1, -, 2
    cu_seqlens_padded = cu([0, 4, 4, 12])
    rank0 = thd_get_partitioned_indices(cu_seqlens_padded, 12, 2, 0)
    assert rank0.dtype == I32 and rank0.tolist() == [0, 3, 4, 5, 10, 11]
    assert thd_get_partitioned_indices(cu_seqlens_padded, 12, 2, 1).tolist() == [1, 2, 6, 7, 8, 9]


def test_partition_world_size_one_is_identity():
    assert thd_get_partitioned_indices(cu([0, 3, 7]), 7, 1, 0).tolist() == list(range(7))


@st.composite
def cp_layouts(draw):
    world = draw(st.integers(1, 4))
    chunks = draw(st.lists(st.integers(0, 4), min_size=1, max_size=6))
    return world, [0, *np.cumsum([c * 2 * world for c in chunks]).tolist()]


@settings(max_examples=80, deadline=None)
@given(layout=cp_layouts())
def test_partition_properties(layout):
    world, offsets = layout
    total = offsets[-1]
    if total == 0:
        return
    shards = [thd_get_partitioned_indices(cu(offsets), total, world, r).tolist() for r in range(world)]
    assert sorted(sum(shards, [])) == list(range(total))  # a permutation of all tokens
    for r, shard in enumerate(shards):
        assert shard == te_kernel_reference(offsets, total, world, r)
        expected = []  # chunks r and 2W-1-r of every sequence, in sequence order
        for start, end in zip(offsets[:-1], offsets[1:]):
            size = (end - start) // (2 * world)
            expected += list(range(start + r * size, start + (r + 1) * size))
            expected += list(range(start + (2 * world - 1 - r) * size, start + (2 * world - r) * size))
        assert shard == expected


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.tensor([0, 8]), 8, 2, 0), "must be int32"),
        ((cu([[0, 8]]), 8, 2, 0), "must be 1-D with at least 2 entries"),
        ((cu([0]), 0, 2, 0), "must be 1-D with at least 2 entries"),
        ((cu([0, 8, 4]), 4, 2, 0), r"non-decreasing: entry 2 \(4\) < entry 1 \(8\)"),
        (
            (cu([0, 8, 14]), 14, 2, 0),
            r"sequence 1 has padded length 6, which is not a multiple of 2\*cp_size=4",
        ),
        ((cu([0, 8]), 16, 2, 0), r"total_tokens=16 must equal cu_seqlens_padded\[-1\]=8"),
        ((cu([4, 8]), 8, 2, 0), "must start at 0, got 4"),
        ((cu([0, 8]), 8, 2, 2), r"rank must be an int in \[0, 2\), got 2"),
        ((cu([0, 8]), 8, 0, 0), "world_size must be a positive int, got 0"),
        ((cu([0, 0]), 0, 1, 0), "total_tokens must be positive"),
    ],
)
def test_partition_bad_inputs(args, match):
    with pytest.raises(ValueError, match=match):
        thd_get_partitioned_indices(*args)


# --- make_cp_batch_for_te -------------------------------------------------------------------


def cp_example_batch():
    """One pack of 16 (cp 2): samples [1 2 3] and [4 .. 8], each padded to a multiple of 4."""
    return packed_sequence_thd_collater(
        [
            {
                "input_ids": [1, 2, 3, 0, 4, 5, 6, 7, 8, 0, 0, 0, 0, 0, 0, 0],
                "labels": [1, 2, 3, -100, 4, 5, 6, 7, 8] + [-100] * 7,
                "position_ids": [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
                "seq_lens": [3, 5],
                "seq_lens_padded": [4, 12],
            }
        ]
    )


def test_make_cp_batch_worked_example():
    # sequence 0 (4 slots) -> chunks of 1: rank 0 [0, 3], rank 1 [1, 2]
    # sequence 1 (12 slots at 4) -> chunks of 3: rank 0 [4 5 6 13 14 15], rank 1 [7 8 9 10 11 12]
    rank0 = make_cp_batch_for_te(None, cp_example_batch(), cp_size=2, cp_rank=0)
    rank1 = make_cp_batch_for_te(None, cp_example_batch(), cp_size=2, cp_rank=1)
    assert rank0["input_ids"].tolist() == [1, 0, 4, 5, 6, 0, 0, 0]
    assert rank0["position_ids"].tolist() == [0, 3, 0, 1, 2, 9, 10, 11]
    assert rank0["padding_mask"].tolist() == [False, True, False, False, False, True, True, True]
    assert rank1["input_ids"].tolist() == [2, 3, 7, 8, 0, 0, 0, 0]
    assert rank1["labels"].tolist() == [2, 3, 7, 8, -100, -100, -100, -100]
    assert rank1["position_ids"].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    for out, rank in ((rank0, 0), (rank1, 1)):  # global layout is kept
        assert out["cu_seqlens"].tolist() == [0, 3, 8] and out["cu_seqlens_padded"].tolist() == [0, 4, 16]
        assert int(out["max_seqlen"]) == 12 and out["cp_size"] == 2 and out["cp_rank"] == rank


def test_make_cp_batch_without_cp_is_process_input_for_thd():
    out = make_cp_batch_for_te(None, nemo_docstring_batch())
    expected = process_input_for_thd(nemo_docstring_batch())
    for key, value in expected.items():
        assert torch.equal(out[key], value) if torch.is_tensor(value) else out[key] == value
    assert (out["cp_size"], out["cp_rank"]) == (1, 0)


@settings(max_examples=40, deadline=None)
@given(layout=cp_layouts(), seed=st.integers(0, 100))
def test_sharded_positions_are_index_in_padded_sequence(layout, seed):
    world, offsets = layout
    total = offsets[-1]
    if total == 0 or any(b == a for a, b in zip(offsets[:-1], offsets[1:])):
        return
    padded = np.diff(offsets)
    real = [int(np.random.default_rng(seed + i).integers(1, p + 1)) for i, p in enumerate(padded)]
    pack = {
        "input_ids": list(range(100, 100 + total)),
        "labels": list(range(total)),
        "position_ids": [i for p in padded for i in range(p)],
        "seq_lens": real,
        "seq_lens_padded": padded.tolist(),
    }
    batch = packed_sequence_thd_collater([pack])
    gathered = []
    for r in range(world):
        out = make_cp_batch_for_te(None, batch, cp_size=world, cp_rank=r)
        index = out["input_ids"] - 100  # each token's global index
        seq = np.searchsorted(offsets, index.numpy(), side="right") - 1
        assert out["position_ids"].tolist() == (index.numpy() - np.array(offsets)[seq]).tolist()
        assert out["padding_mask"].tolist() == (out["position_ids"].numpy() >= np.array(real)[seq]).tolist()
        gathered += index.tolist()
    assert sorted(gathered) == list(range(total))


def test_make_cp_batch_bad_arguments():
    with pytest.raises(ValueError, match="Currently only 'thd' format is supported, got: 'bshd'"):
        make_cp_batch_for_te(None, cp_example_batch(), qkv_format="bshd")
    with pytest.raises(ValueError, match="given without cp_rank"):
        make_cp_batch_for_te(None, cp_example_batch(), cp_size=2)
    with pytest.raises(ValueError, match=r"cp_rank must be an int in \[0, 2\), got 5"):
        make_cp_batch_for_te(None, cp_example_batch(), cp_size=2, cp_rank=5)
    with pytest.raises(ValueError, match="num_chunks=3 must divide the batch's 1 rows"):
        make_cp_batch_for_te(None, cp_example_batch(), num_chunks=3)
    with pytest.raises(
        ValueError, match=r"sequence 0 has padded length 4, which is not a multiple of 2\*cp_size=8"
    ):
        make_cp_batch_for_te(None, cp_example_batch(), cp_size=4, cp_rank=0)
