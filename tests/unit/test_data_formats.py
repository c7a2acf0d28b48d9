"""Every data format from a small file, with exact ids and learned-token masks; malformed rows; mixing."""

from __future__ import annotations

import json
import logging
import re

import datasets
import numpy as np
import pytest

from automodel.data.sft import load_tokenizer, tokenize_sft_dataset
from automodel.data.sft_data import DataSource, SFTData, weight_rows
from automodel.data.sources import load_sft_source

# The tiny tokenizer: special tokens, and the pieces the examples use (checked in test_pieces).
BOS, EOS, SYSTEM, USER, ASSISTANT = 1, 2, 3, 4, 5
HI, RED, BLUE, FIVE, THE_CAT = [77, 78], [87, 74, 73], [71, 81, 330], [305], [89, 77, 74, 288, 291]
PIECES = {"hi": HI, "red": RED, "blue": BLUE, " 5": FIVE, "the cat": THE_CAT}


@pytest.fixture(scope="module")
def tiny():
    return load_tokenizer("tiny")


def write(path, rows) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def tokenize(tiny, source, format, **kwargs) -> list[dict]:
    rows, origin = load_sft_source(source)
    return tokenize_sft_dataset(rows, tiny, format=format, origin=origin, **kwargs).to_list()


def shifted(ids: list[int], mask: list[int]) -> dict:
    """The expected row for a whole sample ``ids`` with learned tokens ``mask``."""
    return {"input_ids": ids[:-1], "labels": ids[1:], "loss_mask": mask[1:]}


def test_pieces(tiny):
    for text, ids in PIECES.items():
        assert tiny(text, add_special_tokens=False).input_ids == ids, text


def test_messages_with_an_extra_key(tiny, tmp_path):
    # One message carries a "name"; the other row has none, so its "name" reads back as None.
    source = write(tmp_path / "chat.jsonl", [
        {"messages": [{"role": "user", "content": "hi", "name": "bob"}, {"role": "assistant", "content": "red"}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "red"}]},
    ])  # fmt: skip
    # <|bos|> <|user|> hi <|eos|> <|assistant|> red <|eos|>
    ids = [BOS, USER, *HI, EOS, ASSISTANT, *RED, EOS]
    mask = [0, 0, 0, 0, 0, 0, 1, 1, 1, 1]
    assert tokenize(tiny, source, "messages") == [shifted(ids, mask)] * 2


def test_sharegpt(tiny, tmp_path):
    turns = [
        {"from": "system", "value": "hi"},
        {"from": "human", "value": "hi"},
        {"from": "gpt", "value": "red"},
    ]
    source = write(tmp_path / "share.json", [{"conversations": turns}])
    ids = [BOS, SYSTEM, *HI, EOS, USER, *HI, EOS, ASSISTANT, *RED, EOS]
    mask = [0] * 10 + [1, 1, 1, 1]
    assert tokenize(tiny, source, "sharegpt") == [shifted(ids, mask)]


def test_alpaca_from_csv(tiny, tmp_path):
    (tmp_path / "alpaca.csv").write_text("instruction,input,output\nhi,red,blue\nhi,,blue\n")
    user = tiny("hi\n\nred", add_special_tokens=False).input_ids  # the instruction, a blank line, the input
    out = tokenize(tiny, tmp_path / "alpaca.csv", "alpaca")
    with_input = [BOS, USER, *user, EOS, ASSISTANT, *BLUE, EOS]
    without = [BOS, USER, *HI, EOS, ASSISTANT, *BLUE, EOS]  # an empty input adds nothing
    assert out == [
        shifted(with_input, [0] * (len(user) + 4) + [1] * 4),
        shifted(without, [0, 0, 0, 0, 0, 0, 1, 1, 1, 1]),
    ]


def test_prompt_completion_with_mapped_columns_from_parquet(tiny, tmp_path):
    datasets.Dataset.from_list([{"q": "hi", "a": " 5"}]).to_parquet(str(tmp_path / "qa.parquet"))
    out = tokenize(
        tiny, tmp_path / "qa.parquet", "prompt_completion", columns={"prompt": "q", "completion": "a"}
    )
    assert out == [shifted([BOS, *HI, *FIVE, EOS], [0, 0, 0, 1, 1])]


def test_text_from_a_directory(tiny, tmp_path):
    write(tmp_path / "corpus" / "a.jsonl", [{"text": "the cat"}])
    write(tmp_path / "corpus" / "b.jsonl", [{"text": "hi"}])
    assert tokenize(tiny, tmp_path / "corpus", "text") == [
        shifted([BOS, *THE_CAT, EOS], [1] * 7),  # every token learned, the first one included
        shifted([BOS, *HI, EOS], [1] * 4),
    ]


def test_pretokenized_rows_from_save_to_disk(tiny, tmp_path):
    rows = [
        {"input_ids": [1, 10, 11, 2], "labels": None, "loss_mask": None},  # all learned, shifted
        {"input_ids": [1, 10, 11, 2], "labels": None, "loss_mask": [0, 0, 1, 1]},  # flags per token, shifted
        {"input_ids": [5, 6, 7], "labels": [6, -100, 8], "loss_mask": None},  # aligned labels: as they are
    ]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    assert tokenize(tiny, tmp_path / "saved", "tokens") == [
        {"input_ids": [1, 10, 11], "labels": [10, 11, 2], "loss_mask": [1, 1, 1]},
        {"input_ids": [1, 10, 11], "labels": [10, 11, 2], "loss_mask": [0, 1, 1]},
        {"input_ids": [5, 6, 7], "labels": [6, -100, 8], "loss_mask": [1, 0, 1]},
    ]


GOOD_CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "red"}]}


@pytest.mark.parametrize(
    ("format", "bad_row", "field", "reason"),
    [
        ("messages", {"messages": "hi"}, "messages", "non-empty list"),
        ("messages", {"messages": [{"role": "bot", "content": "hi"}]}, "messages", "role 'bot'"),
        ("messages", {"messages": [{"role": "user", "content": 3}]}, "messages", "'content' must be text, got int"),
        ("messages", {"messages": [{"role": "assistant", "content": "red"}]}, "messages", "starts with an assistant"),
        ("messages", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}, "messages", "empty"),
        ("sharegpt", {"conversations": [{"from": "bot", "value": "hi"}]}, "conversations", "'from' 'bot'"),
        ("alpaca", {"instruction": "hi", "output": None}, "output", "has no value in this row"),
        ("prompt_completion", {"prompt": "hi", "completion": ""}, "completion", "empty"),
        ("text", {"text": 7}, "text", "must be text"),
        ("tokens", {"input_ids": [1, 9999]}, "input_ids", "outside"),
        ("tokens", {"input_ids": [1, 2, 3], "labels": [2, 3]}, "labels", "has 2 entries"),
        ("tokens", {"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, "labels", "next tokens"),
    ],
)  # fmt: skip
def test_malformed_row_names_file_row_and_field(tiny, tmp_path, format, bad_row, field, reason):
    good = {
        "messages": GOOD_CHAT,
        "sharegpt": {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "red"}]},
        "alpaca": {"instruction": "hi", "output": "red"},
        "prompt_completion": {"prompt": "hi", "completion": "red"},
        "text": {"text": "hi"},
        "tokens": {"input_ids": [1, 2, 3]},
    }[format]
    rows, origin = load_sft_source(write(tmp_path / "data.jsonl", [good, good, bad_row]))
    with pytest.raises(ValueError, match=rf"data\.jsonl line 3: field '{field}'.*{reason}"):
        tokenize_sft_dataset(rows, tiny, format=format, origin=origin)


def test_skip_mode_drops_counts_and_reports(tiny, tmp_path, caplog):
    bad = {"messages": [{"role": "bot", "content": "hi"}]}
    rows, origin = load_sft_source(write(tmp_path / "data.jsonl", [GOOD_CHAT, bad, GOOD_CHAT, bad]))
    with caplog.at_level(logging.WARNING, logger="automodel.data.sft"):
        out = tokenize_sft_dataset(rows, tiny, format="messages", origin=origin, on_bad_row="skip")
    assert len(out) == 2
    assert "skipped 2 of 4 rows (50.00%)" in caplog.text and "data.jsonl line 2" in caplog.text


@pytest.mark.parametrize(
    "bad_field, bad_value, reason",
    [
        ("content", 1652, "message 1 (assistant): 'content' must be text, got int"),
        ("content", ["1652"], "message 1 (assistant): 'content' must be text, got list"),
        ("role", 7, "'role' must be text such as 'user', got 7"),
    ],
)
def test_one_bad_row_among_120_costs_that_row_only(tiny, tmp_path, caplog, bad_field, bad_value, reason):
    """A number where the other rows have text used to retype the column: valid rows such as "1652"
    read back as ints and were dropped with it. Each row keeps its own types now."""
    chats = [[{"role": "user", "content": f"{i} + 1?"}, {"role": "assistant", "content": str(1600 + i)}]
             for i in range(120)]  # fmt: skip
    chats[41][1][bad_field] = bad_value
    rows, origin = load_sft_source(write(tmp_path / "data.jsonl", [{"messages": m} for m in chats]))
    with caplog.at_level(logging.WARNING, logger="automodel.data.sft"):
        out = tokenize_sft_dataset(rows, tiny, format="messages", origin=origin, on_bad_row="skip")
    assert len(out) == 119
    assert "skipped 1 of 120 rows" in caplog.text and "data.jsonl line 42: field 'messages'" in caplog.text
    assert reason in caplog.text
    expected = tokenize_sft_dataset(rows.select([i for i in range(120) if i != 41]), tiny, format="messages")
    assert (
        out.to_list() == expected.to_list()
    )  # the 119 valid rows are tokenized exactly as without the bad one
    with pytest.raises(ValueError, match=rf"data\.jsonl line 42: field 'messages'.*{re.escape(reason)}"):
        tokenize_sft_dataset(rows, tiny, format="messages", origin=origin)


def test_a_float_among_token_ids_costs_its_row_only(tiny, tmp_path):
    rows, origin = load_sft_source(write(tmp_path / "ids.jsonl", [{"input_ids": [1, 2, 3]}, {"input_ids": [1, 2.5, 3]},
                                                                   {"input_ids": [4, 5, 6]}]))  # fmt: skip
    assert rows.features["input_ids"].feature.dtype in (
        "int32",
        "int64",
    )  # not float: the float row did not decide
    with pytest.raises(ValueError, match=r"ids\.jsonl line 2: field 'input_ids'.*list of ints"):
        tokenize_sft_dataset(rows, tiny, format="tokens", origin=origin)
    out = tokenize_sft_dataset(rows, tiny, format="tokens", origin=origin, on_bad_row="skip")
    assert out["input_ids"] == [[1, 2], [4, 5]]


def test_weight_rows_copies_then_samples_with_a_seed():
    rows = datasets.Dataset.from_dict({"x": [0, 1, 2, 3]})
    picked = weight_rows(rows, 1.5, np.random.default_rng(7))["x"]
    assert picked[:4] == [0, 1, 2, 3] and len(picked) == 6 and len(set(picked[4:])) == 2
    assert weight_rows(rows, 1.5, np.random.default_rng(7))["x"] == picked
    half = weight_rows(rows, 0.5, np.random.default_rng(7))["x"]
    assert len(half) == 2 and len(set(half)) == 2


def test_mix_and_validation(tiny, tmp_path):
    chats = write(tmp_path / "chat.jsonl", [GOOD_CHAT] * 10)
    texts = write(tmp_path / "text.jsonl", [{"text": f"hi {i}"} for i in range(20)])
    mix = SFTData(source=None, sources=[{"source": chats, "format": "messages", "weight": 2.0},
                                        DataSource(texts, format="text", weight=0.5)], val_fraction=0.2, seed=3)  # fmt: skip
    train, validation = mix.build(tiny)
    assert (len(train), len(validation)) == (2 * 8 + 8, 2 + 4)  # 20% of each source held out, then weighted
    texts_of = lambda rows: {tuple(r["input_ids"]) for r in rows.to_list() if r["loss_mask"][0] == 1}  # noqa: E731
    assert len(texts_of(validation)) == 4 and not texts_of(validation) & texts_of(
        train
    )  # the texts are distinct
    assert mix.build(tiny)[1].to_list() == validation.to_list()  # fixed by the seed

    split = SFTData(source=texts, format="text", validation={"split": "train[:5]"})
    train, validation = split.build(tiny)
    assert (len(train), len(validation)) == (20, 5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"source": "tiny_sft", "sources": [{"source": "tiny_sft"}]}, "data.source .* or data.sources"),
        ({"source": "tiny_sft", "format": "chat"}, "format='chat'"),
        ({"source": None, "sources": [{"source": "tiny_sft", "weight": 0}]}, "weight=0"),
        (
            {"source": None, "sources": [{"source": "tiny_sft", "wieght": 1}]},
            r"unknown key\(s\) \['wieght'\]",
        ),
        ({"source": "tiny_sft", "val_fraction": 1.5}, "val_fraction"),
        ({"source": "tiny_sft", "on_bad_row": "ignore"}, "on_bad_row"),
        ({"source": "no/such/file.jsonl"}, "does not exist"),
    ],
)
def test_bad_data_section(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SFTData(**kwargs)


def test_end_of_turn_token(tiny, llama3_like_tokenizer):
    from automodel.data.chat import end_of_turn_token_id

    assert end_of_turn_token_id(tiny) == EOS  # the tiny template ends turns with its eos
    assert end_of_turn_token_id(llama3_like_tokenizer) == 3  # "<|eot|>"
    llama3_like_tokenizer.chat_template = None
    assert end_of_turn_token_id(llama3_like_tokenizer) is None


def test_a_skipped_row_and_a_long_row_together_are_reported_in_the_kept_rows_terms(tiny, tmp_path, caplog):
    """The long-sample report used the table's row indices on the kept rows' lengths: with row 2 of 4
    skipped and row 3 longer than max_length, an IndexError (index 3 out of bounds for size 3)."""
    long_chat = {
        "messages": [{"role": "user", "content": "hi " * 40}, {"role": "assistant", "content": "red"}]
    }
    bad = {"messages": [{"role": "bot", "content": "hi"}]}
    rows, origin = load_sft_source(write(tmp_path / "data.jsonl", [GOOD_CHAT, bad, GOOD_CHAT, long_chat]))
    with caplog.at_level(logging.INFO, logger="automodel.data"):
        out = tokenize_sft_dataset(rows, tiny, format="messages", origin=origin, on_bad_row="skip",
                                   max_length=16, long_samples="split")  # fmt: skip
    assert (
        "skipped 1 of 4 rows" in caplog.text
        and "split 1 of 3 rows (33.33%) longer than 16 tokens into 6 pieces: 88 of 106" in caplog.text
    )
    assert all(len(r["input_ids"]) <= 16 for r in out.to_list())


def test_rows_with_nothing_to_learn_name_the_file_row_and_the_setting(tiny, tmp_path):
    """Was "none of the 4 rows has a token to learn (malformed, or nothing to learn)": no file, no field."""
    silent = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "red", "train": False},
        ]
    }
    rows, origin = load_sft_source(write(tmp_path / "chat.jsonl", [silent] * 4))
    with pytest.raises(ValueError, match=rf"none of the 4 rows has a token to learn: 4 mark no token to learn, "
                       rf"first {re.escape(str(tmp_path / 'chat.jsonl'))} line 1 \(every assistant turn with train: "
                       r"false"):  # fmt: skip
        tokenize_sft_dataset(rows, tiny, format="messages", origin=origin)
    rows, origin = load_sft_source(write(tmp_path / "pc.jsonl", [{"prompt": "hi", "completion": " red"}] * 3))
    with pytest.raises(ValueError, match=r"3 learn only tokens past data.max_length=1, first .*pc.jsonl line 1: "
                       r"raise data.max_length"):  # fmt: skip
        tokenize_sft_dataset(rows, tiny, format="prompt_completion", origin=origin, max_length=1)


def test_a_lone_surrogate_in_a_json_row_costs_that_row_named_by_its_line(tiny, tmp_path):
    """Was a UnicodeEncodeError from Arrow, naming neither file nor line."""
    file = tmp_path / "data.jsonl"
    file.write_text('{"prompt": "a", "completion": " b"}\n{"prompt": "\\ud800x", "completion": " c"}\n')
    rows, origin = load_sft_source(str(file))
    with pytest.raises(ValueError, match=r"data\.jsonl line 2: field 'prompt' \(column 'prompt'\): holds a lone "
                       r"surrogate '\\ud800', which is not Unicode text"):  # fmt: skip
        tokenize_sft_dataset(rows, tiny, format="prompt_completion", origin=origin)
    out = tokenize_sft_dataset(rows, tiny, format="prompt_completion", origin=origin, on_bad_row="skip")
    assert len(out) == 1
