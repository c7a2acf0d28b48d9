"""The shipped tiny dataset and tokenizer: reproducible, correct, and shaped for packing."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from automodel.assets import ASSETS_DIR, TINY_SFT_PATH, TINY_TOKENIZER_DIR
from automodel.assets.build_tiny_assets import NUM_ROWS, VOCAB_SIZE, build_tiny_assets
from automodel.data.sft import load_tokenizer


@pytest.fixture(scope="module")
def tiny():
    return load_tokenizer("tiny")


@pytest.fixture(scope="module")
def shipped_rows():
    return [json.loads(line) for line in TINY_SFT_PATH.read_text().splitlines()]


def test_regeneration_reproduces_the_shipped_files(tmp_path):
    # BPE training in `tokenizers` breaks count ties by the pair itself, so the merges (and the
    # whole tokenizer.json) come out the same in every process; this also checks that claim.
    written = build_tiny_assets(tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in written) == [
        "tiny_corpus/part-0.txt",
        "tiny_corpus/part-1.jsonl",
        "tiny_preference.jsonl",
        "tiny_sft.jsonl",
        "tiny_tokenizer/tokenizer.json",
        "tiny_tokenizer/tokenizer_config.json",
        "tiny_tools.jsonl",
        "tiny_tools_tokenizer/tokenizer.json",
        "tiny_tools_tokenizer/tokenizer_config.json",
    ]
    for path in written:
        shipped = ASSETS_DIR / path.relative_to(tmp_path)
        assert path.read_bytes() == shipped.read_bytes(), (
            f"{shipped} differs: run python -m automodel.assets.build_tiny_assets"
        )
    # SFT 1.06 MB, tool chats 0.57, corpus 0.30, preference 0.20, two tokenizers 0.05: 2.17 MB
    assert sum(p.stat().st_size for p in written) < 2.5 * 2**20


def test_tokenizer_special_tokens(tiny):
    assert len(tiny) == VOCAB_SIZE
    assert (tiny.pad_token_id, tiny.bos_token_id, tiny.eos_token_id) == (0, 1, 2)
    assert tiny.convert_tokens_to_ids(["<|system|>", "<|user|>", "<|assistant|>"]) == [3, 4, 5]
    ids = tiny("Add 1 and 2.").input_ids
    assert ids[0] == 1 and tiny.decode(ids[1:]) == "Add 1 and 2."
    marked = tiny("<|user|>hi<|eos|>", add_special_tokens=False).input_ids  # markers are single tokens
    assert marked[0] == 4 and marked[-1] == 2 and tiny.decode(marked[1:-1]) == "hi"


@settings(max_examples=50, deadline=None)
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40))
def test_any_text_round_trips(tiny, text):
    assert tiny.decode(tiny(text, add_special_tokens=False).input_ids) == text


def test_chat_template_marks_assistant_content_and_eos(tiny):
    conversation = [
        {"role": "user", "content": "What is 12 plus 30?"},
        {"role": "assistant", "content": "42"},
    ]
    assert tiny.apply_chat_template(conversation, tokenize=False) == (
        "<|bos|><|user|>What is 12 plus 30?<|eos|><|assistant|>42<|eos|>"
    )
    assert tiny.apply_chat_template(conversation[:1], tokenize=False, add_generation_prompt=True).endswith(
        "<|eos|><|assistant|>"
    )
    out = tiny.apply_chat_template(conversation, return_dict=True, return_assistant_tokens_mask=True)
    learned = [t for t, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    assert tiny.decode(learned) == "42<|eos|>"
    with pytest.raises(Exception, match="role must be system, user or assistant"):
        tiny.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def _expected_answer(question: str) -> str:
    """Solve a shipped question independently of the generator."""
    rules = [
        (r"Reverse the letters of the word (\w+)\.|Spell (\w+) backwards\.", lambda w1, w2: (w1 or w2)[::-1]),
        (r"Spell the word (\w+) with dashes\.", lambda w: "-".join(w)),
        (r"What is (\d+) plus (\d+)\?|Add (\d+) and (\d+)\.", lambda *n: str(sum(int(x) for x in n if x))),
        (r"Rewrite in capital letters: (.+)", str.upper),
        (r"Sort these numbers from smallest to largest: (.+)", lambda s: ", ".join(sorted(s.split(", "), key=int))),
        (r"Repeat this list exactly: (.+)", lambda s: s),
        (r"Write these words in reverse order: (.+)", lambda s: " ".join(s.split()[::-1])),
        (r"How many words are in this list\? (.+)", lambda s: str(len(s.split()))),
        (r"Here is a table:\n(.+)\nWhat is the value of (\w+)\?", lambda t, k: dict(line.split(" = ") for line in t.split("\n"))[k]),
    ]  # fmt: skip
    for pattern, solve in rules:
        match = re.fullmatch(pattern, question, flags=re.DOTALL)
        if match:
            return solve(*match.groups())
    raise AssertionError(f"no task matches {question!r}")


def test_every_row_is_a_correct_instance_in_both_forms(shipped_rows):
    assert len(shipped_rows) == NUM_ROWS
    for row in shipped_rows:
        assert list(row) == ["prompt", "completion", "messages"]
        (user, assistant) = row["messages"]
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        assert row["prompt"] == user["content"] + "\nAnswer:"
        assert row["completion"] == " " + assistant["content"]
        assert assistant["content"] == _expected_answer(user["content"])


def test_lengths_spread_for_packing(tiny, shipped_rows):
    texts = [row["prompt"] + row["completion"] for row in shipped_rows]
    lengths = np.array(
        [len(ids) + 2 for ids in tiny(texts, add_special_tokens=False).input_ids]
    )  # + bos, eos
    assert 10 <= lengths.min() and lengths.max() <= 320
    assert np.mean(lengths < 32) > 0.3 and np.mean(lengths > 128) > 0.1  # many short, a long tail
    assert 100_000 < lengths.sum() < 300_000
    assert len(TINY_TOKENIZER_DIR.joinpath("tokenizer.json").read_text()) < 100_000
