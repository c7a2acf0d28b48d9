"""Inputs and keywords NeMo AutoModel 0.7 accepts in the five data-path functions, and what we make
of them (docs/migrating-from-nemo.md). Expected values are worked out by hand."""

from __future__ import annotations

import datasets
import pytest
import torch
from transformers import LlamaConfig, Qwen2VLTextConfig

from automodel.data import pack_dataset, packed_sequence_thd_collater
from automodel.distributed import make_cp_batch_for_te, process_input_for_thd
from automodel.models.build import batched_position_ids

PAD = -100
S_TOKENS = [1, 2, 3], [4, 5, 6, 7, 8]


def rows(*samples, loss_masks=None):
    out = [{"input_ids": list(s), "labels": list(s)} for s in samples]
    for row, mask in zip(out, loss_masks or []):
        if mask is not None:
            row["loss_mask"] = mask
    return out


def columns(packed):
    return {k: packed[k] for k in packed.column_names}


# --- pack_dataset ---------------------------------------------------------------------------


def test_pack_dataset_takes_a_list_of_dicts():
    packed = pack_dataset(rows(*S_TOKENS), None, 16, cp_size=2, algorithm="sequential")
    assert columns(packed) == {
        "input_ids": [[1, 2, 3, 0, 4, 5, 6, 7, 8, 0, 0, 0, 0, 0, 0, 0]],
        "labels": [[1, 2, 3, PAD, 4, 5, 6, 7, 8] + [PAD] * 7],
        "position_ids": [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]],
        "seq_lens": [[3, 5]],
        "seq_lens_padded": [[4, 12]],
    }
    as_dataset = pack_dataset(
        datasets.Dataset.from_list(rows(*S_TOKENS)), None, 16, cp_size=2, algorithm="sequential"
    )
    assert columns(as_dataset) == columns(packed)


def test_pack_dataset_list_rows_without_loss_mask_mask_nothing():
    packed = pack_dataset(rows([1, 2], [3], loss_masks=[[0, 1], None]), None, 4, algorithm="sequential")
    assert columns(packed) == {
        "input_ids": [[1, 2, 3, 0]],
        "labels": [[PAD, 2, 3, PAD]],
        "position_ids": [[0, 1, 0, 1]],
        "seq_lens": [[2, 1]],
        "seq_lens_padded": [[2, 2]],
    }


def test_pack_dataset_takes_a_map_style_dataset():
    class Samples:  # __len__ and __getitem__ only, like NeMo AutoModel's ChatDataset
        def __len__(self):
            return 2

        def __getitem__(self, i):  # tensors, as torch datasets often give
            return {k: torch.tensor(v) for k, v in rows(*S_TOKENS)[i].items()}

    packed = pack_dataset(Samples(), None, 16, cp_size=2, algorithm="sequential")
    assert columns(packed) == columns(
        pack_dataset(rows(*S_TOKENS), None, 16, cp_size=2, algorithm="sequential")
    )


def test_pack_dataset_list_bad_rows():
    with pytest.raises(ValueError, match="row 1 is a list: rows must be dicts"):
        pack_dataset([{"input_ids": [1], "labels": [1]}, [1, 2]], None, 4)
    with pytest.raises(ValueError, match="dataset is empty"):
        pack_dataset([], None, 4)


def test_pad_to_multiple_of_aligns_every_sample():
    # [1 2 3 4] -> 6 slots, [5 6] -> 3 slots, tail 3 joins the last: padded [6, 6]
    packed = pack_dataset(rows([1, 2, 3, 4], [5, 6]), None, 12, algorithm="sequential", pad_to_multiple_of=3)
    assert columns(packed) == {
        "input_ids": [[1, 2, 3, 4, 0, 0, 5, 6, 0, 0, 0, 0]],
        "labels": [[1, 2, 3, 4, PAD, PAD, 5, 6, PAD, PAD, PAD, PAD]],
        "position_ids": [[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]],
        "seq_lens": [[4, 2]],
        "seq_lens_padded": [[6, 6]],
    }


def test_pad_to_multiple_of_with_cp_uses_both_multiples():
    # lcm(2*cp_size=4, 3) = 12: each sample takes 12 slots
    packed = pack_dataset(
        rows([1, 2, 3], [4]), None, 12, cp_size=2, algorithm="sequential", pad_to_multiple_of=3
    )
    assert packed["seq_lens"] == [[3], [1]] and packed["seq_lens_padded"] == [[12], [12]]
    with pytest.raises(ValueError, match=r"packed_sequence_size=8 must be a multiple of 3"):
        pack_dataset(rows([1]), None, 8, pad_to_multiple_of=3)
    with pytest.raises(ValueError, match=r"packed_sequence_size=18 must be a multiple of 12"):
        pack_dataset(rows([1]), None, 18, cp_size=2, pad_to_multiple_of=3)
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        pack_dataset(rows([1]), None, 8, pad_to_multiple_of=0)


# --- packed_sequence_thd_collater -----------------------------------------------------------


def test_collater_takes_unpacked_rows_with_mask_and_pad_metadata():
    meta = {"input_ids": 2, "labels": -100, "attention_mask": 0}
    samples = [
        {
            "input_ids": [5, 6, 2],
            "labels": [6, 7, PAD],
            "attention_mask": [1, 1, 0],
            "___PAD_TOKEN_IDS___": meta,
        },
        {"input_ids": [8], "labels": [9], "attention_mask": [1], "___PAD_TOKEN_IDS___": meta},
    ]
    batch = packed_sequence_thd_collater(samples)
    assert batch["input_ids"].tolist() == [[5, 6, 2], [8, 2, 2]]
    assert batch["labels"].tolist() == [[6, 7, PAD], [9, PAD, PAD]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 1, 2]]
    assert batch["seq_lens"].tolist() == [[2], [1]]
    assert batch["seq_lens_padded"].tolist() == [[3], [3]]
    assert batch["qkv_format"] == "thd"
    assert (
        samples[0]["attention_mask"] == [1, 1, 0] and "___PAD_TOKEN_IDS___" in samples[1]
    )  # inputs untouched
    thd = process_input_for_thd(batch)
    assert thd["padding_mask"].tolist() == [False, False, True, False, True, True]


def test_collater_unpacked_rows_without_mask_are_whole_and_pad_with_0():
    batch = packed_sequence_thd_collater(rows([1, 2, 3], [4]))
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0]]
    assert batch["labels"].tolist() == [[1, 2, 3], [4, PAD, PAD]]
    assert batch["seq_lens"].tolist() == [[3], [1]] and batch["seq_lens_padded"].tolist() == [[3], [3]]


def test_collater_unpacked_rows_loss_mask_and_masked_labels():
    # loss_mask 0 turns the label into -100; a label under attention_mask 0 is padding (-100)
    sample = {
        "input_ids": [1, 2, 3],
        "labels": [1, 2, 3],
        "loss_mask": [0, 1, 1],
        "attention_mask": [1, 1, 0],
    }
    batch = packed_sequence_thd_collater([sample])
    assert batch["labels"].tolist() == [[PAD, 2, PAD]] and batch["input_ids"].tolist() == [[1, 2, 0]]


def test_collater_unpacked_row_errors():
    with pytest.raises(
        ValueError, match=r"attention_mask must be 1s followed by 0s \(right padding\), got \[0, 1, 1\]"
    ):
        packed_sequence_thd_collater(
            [{"input_ids": [0, 1, 2], "labels": [0, 1, 2], "attention_mask": [0, 1, 1]}]
        )
    with pytest.raises(ValueError, match="row 1 lacks seq_lens but row 0 has them"):
        packed = {
            "input_ids": [1],
            "labels": [1],
            "position_ids": [0],
            "seq_lens": [1],
            "seq_lens_padded": [1],
        }
        packed_sequence_thd_collater([packed, {"input_ids": [1], "labels": [1]}])
    with pytest.raises(KeyError, match=r"sample 0 lacks \['labels'\]") as caught:
        packed_sequence_thd_collater([{"input_ids": [1, 2]}])
    assert isinstance(caught.value, ValueError)
    with pytest.raises(ValueError, match=r"sample 0: input_ids has 2 entries but \{'labels': 1\}"):
        packed_sequence_thd_collater([{"input_ids": [1, 2], "labels": [1]}])


def test_collater_unequal_rows_raise_what_nemo_callers_catch():
    pack = {
        "input_ids": [1, 2],
        "labels": [1, 2],
        "position_ids": [0, 1],
        "seq_lens": [2],
        "seq_lens_padded": [2],
    }
    with pytest.raises(
        RuntimeError,
        match=r"input_ids: every row .* got \[2, 3\]: stack expects each tensor to be equal size",
    ) as caught:
        packed_sequence_thd_collater([pack, dict(pack, input_ids=[1, 2, 3])])
    assert isinstance(caught.value, ValueError)


# --- process_input_for_thd ------------------------------------------------------------------


def packed_batch(seq_lens, seq_lens_padded, pack_size=6, **extra):
    rows_ = len(seq_lens)
    batch = {
        "input_ids": torch.arange(1, rows_ * pack_size + 1).reshape(rows_, pack_size),
        "labels": torch.zeros(rows_, pack_size, dtype=torch.long),
        "position_ids": torch.arange(pack_size).repeat(rows_, 1),
        "seq_lens": None if seq_lens is None else torch.tensor(seq_lens),
        "seq_lens_padded": None if seq_lens_padded is None else torch.tensor(seq_lens_padded),
    }
    return {**batch, **extra}


def test_mrope_position_ids_keep_their_rotary_axis():
    positions = torch.arange(18).reshape(3, 2, 3)  # [R=3, B=2, S=3]
    out = process_input_for_thd(packed_batch([[3], [3]], [[3], [3]], pack_size=3, position_ids=positions))
    assert out["position_ids"].tolist() == [
        [[0, 1, 2, 3, 4, 5]],
        [[6, 7, 8, 9, 10, 11]],
        [[12, 13, 14, 15, 16, 17]],
    ]
    with pytest.raises(ValueError, match=r"or \[R, B, S\] for mRoPE, got \(3, 2, 4\)"):
        process_input_for_thd(
            packed_batch(
                [[3], [3]], [[3], [3]], pack_size=3, position_ids=torch.zeros(3, 2, 4, dtype=torch.long)
            )
        )


def test_mrope_position_ids_shard_on_their_token_axis():
    # one sequence of 8 slots, cp 2 -> chunks of 2: rank 0 holds slots [0 1 6 7]
    positions = (torch.arange(3)[:, None] * 100 + torch.arange(8))[:, None, :]  # [3, 1, 8]
    batch = packed_batch([[5]], [[8]], pack_size=8, position_ids=positions)
    out = make_cp_batch_for_te(None, batch, cp_size=2, cp_rank=0)
    assert out["position_ids"].tolist() == [[[0, 1, 6, 7]], [[100, 101, 106, 107]], [[200, 201, 206, 207]]]
    assert out["input_ids"].tolist() == [1, 2, 7, 8]


def test_mrope_position_ids_refused_by_a_model_without_mrope():
    positions = torch.zeros(3, 1, 4, dtype=torch.long)
    assert batched_position_ids(LlamaConfig(), torch.arange(4)).tolist() == [[0, 1, 2, 3]]
    with pytest.raises(
        ValueError, match=r"position_ids of shape \(3, 1, 4\) \(mRoPE \[R, 1, T\]\) reach llama"
    ):
        batched_position_ids(LlamaConfig(), positions)
    mrope = Qwen2VLTextConfig(
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 1, 1]}
    )
    assert batched_position_ids(mrope, positions) is positions


def test_row_not_covered_by_seq_lens_padded_ends_in_padding():
    # row 0 covers 3 of 6 slots: its sequence takes the other 3 as tail padding
    out = process_input_for_thd(packed_batch([[2, -1000], [4, 1]], [[3, -1000], [4, 2]]))
    assert out["cu_seqlens"].tolist() == [0, 2, 6, 7]
    assert out["cu_seqlens_padded"].tolist() == [0, 6, 10, 12]
    assert int(out["max_seqlen"]) == 6
    assert out["padding_mask"].tolist() == [False] * 2 + [True] * 4 + [False] * 5 + [True]


def test_seq_lens_padded_none_means_no_padding_between_sequences():
    out = process_input_for_thd(packed_batch([[2, 3]], None))
    assert out["cu_seqlens"].tolist() == [0, 2, 5] and out["cu_seqlens_padded"].tolist() == [0, 2, 6]
    assert out["padding_mask"].tolist() == [False] * 5 + [True]


def test_seq_lens_none_gives_one_sequence_per_row_padded_by_token_value():
    batch = {**packed_batch([[4], [4]], None, pack_size=4), "seq_lens": None}
    batch["input_ids"] = torch.tensor([[7, 8, 0, 0], [9, 9, 9, 9]])
    out = process_input_for_thd(batch, padding_token_id=0)
    assert out["cu_seqlens"].tolist() == [0, 2, 6] and out["cu_seqlens_padded"].tolist() == [0, 4, 8]
    assert int(out["max_seqlen"]) == 4
    assert out["padding_mask"].tolist() == [False, False, True, True, False, False, False, False]
    batch["input_ids"] = torch.tensor([[7, 0, 8, 0], [9, 9, 9, 9]])
    with pytest.raises(ValueError, match="row 0 holds padding_token_id=0 before its trailing padding"):
        process_input_for_thd(batch, padding_token_id=0)
    with pytest.raises(ValueError, match="seq_lens is None but seq_lens_padded is given"):
        process_input_for_thd({**batch, "seq_lens_padded": torch.tensor([[4], [4]])})
    with pytest.raises(ValueError, match=r"seq_lens=None needs token ids \[B, S\]"):
        process_input_for_thd({**batch, "input_ids": torch.zeros(2, 4, 3)})


def test_position_ids_none_count_inside_each_padded_sequence():
    out = process_input_for_thd(packed_batch([[3, 2]], [[4, 2]], position_ids=None))
    assert out["position_ids"].tolist() == [0, 1, 2, 3, 0, 1]


def test_missing_seq_lens_is_a_key_error_too():
    batch = {"input_ids": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([[1, 2, 3]]),
             "position_ids": torch.tensor([[0, 1, 2]])}  # fmt: skip
    for call in (process_input_for_thd, lambda b: make_cp_batch_for_te(None, b)):
        with pytest.raises(KeyError, match="seq_lens") as caught:
            call(batch)
        assert isinstance(caught.value, ValueError)
        assert str(caught.value).startswith(
            "process_input_for_thd: batch lacks ['seq_lens', 'seq_lens_padded']"
        )


# --- make_cp_batch_for_te -------------------------------------------------------------------


def cp_batch():
    """S=8, cp 2: row 0 one sequence (5 real of 8), row 1 two sequences (1 of 4, 3 of 4)."""
    return packed_sequence_thd_collater([
        {"input_ids": [1, 2, 3, 4, 5, 0, 0, 0], "labels": [1] * 8, "position_ids": list(range(8)),
         "seq_lens": [5], "seq_lens_padded": [8]},
        {"input_ids": [6, 0, 0, 0, 7, 8, 9, 0], "labels": [1] * 8, "position_ids": [0, 1, 2, 3] * 2,
         "seq_lens": [1, 3], "seq_lens_padded": [4, 4]},
    ])  # fmt: skip


def test_make_cp_batch_names_its_format_and_returns_local_indices():
    out, indices = make_cp_batch_for_te(None, cp_batch(), return_local_indices=True)
    assert out["qkv_format"] == "thd" and indices.dtype == torch.int64 and indices.tolist() == list(range(16))
    out, indices = make_cp_batch_for_te(None, cp_batch(), return_local_indices=True, cp_size=2, cp_rank=1)
    # row 0 (slots 0..7, chunks of 2): rank 1 takes [2 3 4 5]; row 1 (chunks of 1): [9 10] and [13 14]
    assert out["qkv_format"] == "thd" and indices.dtype == torch.int32
    assert indices.tolist() == [2, 3, 4, 5, 9, 10, 13, 14]
    assert out["input_ids"].tolist() == [3, 4, 5, 0, 0, 0, 8, 9]


def test_make_cp_batch_num_chunks_stacks_row_groups():
    out, indices = make_cp_batch_for_te(
        None, cp_batch(), num_chunks=2, return_local_indices=True, cp_size=2, cp_rank=0
    )
    assert indices is None
    assert out["input_ids"].tolist() == [[1, 2, 0, 0], [6, 0, 7, 0]]
    assert out["position_ids"].tolist() == [[0, 1, 6, 7], [0, 3, 0, 3]]
    assert out["padding_mask"].tolist() == [[False, False, True, True], [False, True, False, True]]
    assert out["cu_seqlens"].tolist() == [[0, 5, -1000], [0, 1, 4]]
    assert out["cu_seqlens_padded"].tolist() == [[0, 8, -1000], [0, 4, 8]]
    assert out["max_seqlen"].tolist() == [8, 4] and out["qkv_format"] == "thd" and out["cp_size"] == 2
    whole = make_cp_batch_for_te(None, cp_batch(), num_chunks=2)
    assert whole["input_ids"].tolist() == [[1, 2, 3, 4, 5, 0, 0, 0], [6, 0, 0, 0, 7, 8, 9, 0]]
    with pytest.raises(ValueError, match="num_chunks=3 must divide the batch's 2 rows"):
        make_cp_batch_for_te(None, cp_batch(), num_chunks=3)


def test_make_cp_batch_wrong_format_message_matches_nemo():
    with pytest.raises(ValueError, match="Currently only 'thd' format is supported"):
        make_cp_batch_for_te(None, cp_batch(), qkv_format="bshd")
