"""SFT tokenization: hand-worked ids/labels/masks, the shift convention, the chat fallback, bad input."""

from __future__ import annotations

import logging
import re

import datasets
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from automodel.data import pack_dataset
from automodel.data.sft import (
    load_tokenizer,
    shift_for_next_token,
    tokenize_sft_dataset,
    tokenizer_disagreements,
)
from automodel.data.sources import load_sft_source

# A word-level tokenizer whose ids can be read off by hand.
VOCAB = ["<pad>", "<s>", "</s>", "SYSTEM:", "USER:", "ASSISTANT:", "what", "is", "two", "plus", "four", "be", "brief", "thanks", "ok", "[UNK]"]  # fmt: skip
ID = {word: i for i, word in enumerate(VOCAB)}
WORD_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %} {{ m['role'] | upper }}: "
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }} {{ eos_token }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %} ASSISTANT:{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "what is two plus two"},
    {"role": "assistant", "content": "four"},
    {"role": "user", "content": "thanks"},
    {"role": "assistant", "content": "ok"},
]
# <s> SYSTEM: be brief USER: what is two plus two ASSISTANT: four </s> USER: thanks ASSISTANT: ok </s>
CONVERSATION_IDS = [1, 3, 11, 12, 4, 6, 7, 8, 9, 8, 5, 10, 2, 4, 13, 5, 14, 2]
CONVERSATION_MASK = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1]  # "four </s>", "ok </s>"


def strip_generation_tags(template: str) -> str:
    return re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", template)


def word_tokenizer(template: str | None = WORD_TEMPLATE) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    wrapped.chat_template = template
    return wrapped


@pytest.fixture(scope="module")
def tiny():
    return load_tokenizer("tiny")


def rows(dataset: datasets.Dataset) -> list[dict]:
    return dataset.to_list()


def in_memory(dataset: datasets.Dataset) -> datasets.Dataset:
    """A copy without cache files, so that ``map`` computes instead of reusing an earlier result."""
    return datasets.Dataset.from_dict(dataset.to_dict())


# -- the shift convention ---------------------------------------------------------------------------


def test_shift_worked_example():
    ids, mask = [1, 6, 7, 10, 2], [0, 0, 0, 1, 1]
    assert shift_for_next_token(ids, mask) == ([1, 6, 7, 10], [6, 7, 10, 2], [0, 0, 1, 1])
    assert shift_for_next_token(ids, mask, max_length=2) == ([1, 6], [6, 7], [0, 0])
    assert shift_for_next_token(ids, mask, max_length=4) == ([1, 6, 7, 10], [6, 7, 10, 2], [0, 0, 1, 1])
    with pytest.raises(ValueError, match="mask has 2"):
        shift_for_next_token([1, 2, 3], [0, 1])


@given(
    ids=st.lists(st.integers(0, 1000), min_size=1, max_size=40),
    data=st.data(),
    max_length=st.none() | st.integers(1, 50),
)
def test_shift_properties(ids, data, max_length):
    mask = data.draw(st.lists(st.integers(0, 1), min_size=len(ids), max_size=len(ids)))
    input_ids, labels, loss_mask = shift_for_next_token(ids, mask, max_length)
    kept = len(ids) if max_length is None else min(len(ids), max_length + 1)
    assert len(input_ids) == len(labels) == len(loss_mask) == kept - 1
    assert input_ids[1:] == labels[:-1]  # labels are the inputs moved one left
    assert labels == ids[1:kept] and loss_mask == mask[1:kept]


# -- prompt/completion ------------------------------------------------------------------------------


def test_prompt_completion_worked_example():
    dataset = datasets.Dataset.from_dict({"q": ["what is two plus two", "be brief"], "a": ["four", "ok"]})
    out = tokenize_sft_dataset(dataset, word_tokenizer(), columns={"prompt": "q", "completion": "a"})
    # ids = <s> what is two plus two four </s> = [1 6 7 8 9 8 10 2], mask [0 0 0 0 0 0 1 1]
    assert rows(out) == [
        {
            "input_ids": [1, 6, 7, 8, 9, 8, 10],
            "labels": [6, 7, 8, 9, 8, 10, 2],
            "loss_mask": [0, 0, 0, 0, 0, 1, 1],
        },
        {"input_ids": [1, 11, 12, 14], "labels": [11, 12, 14, 2], "loss_mask": [0, 0, 1, 1]},
    ]


def test_prompt_completion_on_tiny_tokenizer(tiny):
    """The example in the docstring of tokenize_sft_dataset."""
    dataset = datasets.Dataset.from_dict({"prompt": ["What is 1 plus 2?\nAnswer:"], "completion": [" 3"]})
    row = rows(tokenize_sft_dataset(dataset, tiny))[0]
    assert tiny("What is 1 plus 2?\nAnswer:", add_special_tokens=False).input_ids == [388, 320, 289, 286, 81, 376, 292, 36, 204, 273, 31]  # fmt: skip
    assert tiny(" 3", add_special_tokens=False).input_ids == [304]
    assert row == {
        "input_ids": [1, 388, 320, 289, 286, 81, 376, 292, 36, 204, 273, 31, 304],
        "labels": [388, 320, 289, 286, 81, 376, 292, 36, 204, 273, 31, 304, 2],
        "loss_mask": [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1],
    }


def test_no_bos_when_the_tokenizer_adds_none():
    tokenizer = word_tokenizer()
    tokenizer.backend_tokenizer.post_processor = None  # like Qwen: encode() adds nothing
    dataset = datasets.Dataset.from_dict({"prompt": ["be brief"], "completion": ["ok"]})
    assert rows(tokenize_sft_dataset(dataset, tokenizer)) == [
        {"input_ids": [11, 12, 14], "labels": [12, 14, 2], "loss_mask": [0, 1, 1]}
    ]


words = st.lists(st.sampled_from(VOCAB[6:15]), min_size=1, max_size=8).map(" ".join)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(samples=st.lists(st.tuples(st.text(" \t\nxyz", max_size=8) | words, words), min_size=1, max_size=5))
def test_prompt_completion_learns_exactly_the_completion(samples):
    tokenizer = word_tokenizer()
    dataset = datasets.Dataset.from_dict(
        {"prompt": [p for p, _ in samples], "completion": [c for _, c in samples]}
    )
    for row, (prompt, completion) in zip(
        rows(tokenize_sft_dataset(dataset, tokenizer)), samples, strict=True
    ):
        learned = [t for t, m in zip(row["labels"], row["loss_mask"], strict=True) if m]
        assert learned == [ID[w] for w in completion.split()] + [ID["</s>"]]
        assert row["input_ids"][0] == ID["<s>"] and row["input_ids"][1:] == row["labels"][:-1]
        assert len(row["input_ids"]) == 1 + len(prompt.split()) + len(completion.split())


# -- messages ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "template", [WORD_TEMPLATE, strip_generation_tags(WORD_TEMPLATE)], ids=["markers", "fallback"]
)
def test_messages_worked_example(template):
    dataset = datasets.Dataset.from_dict({"messages": [CONVERSATION]})
    out = rows(tokenize_sft_dataset(dataset, word_tokenizer(template), format="messages"))
    assert (
        out
        == [
            {
                "input_ids": CONVERSATION_IDS[:-1],  # [1 3 11 12 4 6 7 8 9 8 5 10 2 4 13 5 14]
                "labels": CONVERSATION_IDS[1:],  #    [3 11 12 4 6 7 8 9 8 5 10 2 4 13 5 14 2]
                "loss_mask": CONVERSATION_MASK[1:],  # [0 0 0 0 0 0 0 0 0 0 1 1 0 0 0 1 1]
            }
        ]
    )


def test_messages_on_tiny_template(tiny):
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Add 1 and 2."},
        {"role": "assistant", "content": "3"},
    ]
    text = tiny.apply_chat_template(conversation, tokenize=False)
    assert text == (
        "<|bos|><|system|>Be brief.<|eos|><|user|>Hi<|eos|><|assistant|>Hello<|eos|>"
        "<|user|>Add 1 and 2.<|eos|><|assistant|>3<|eos|>"
    )
    row = rows(
        tokenize_sft_dataset(
            datasets.Dataset.from_dict({"messages": [conversation]}), tiny, format="messages"
        )
    )[0]
    assert row["input_ids"] == tiny(text, add_special_tokens=False).input_ids[:-1]
    learned = [t for t, m in zip(row["labels"], row["loss_mask"], strict=True) if m]
    assert tiny.decode(learned) == "Hello<|eos|>3<|eos|>"


def test_fallback_equals_generation_markers_on_shipped_data(tiny):
    fallback = load_tokenizer("tiny")
    fallback.chat_template = strip_generation_tags(tiny.chat_template)
    assert fallback.chat_template != tiny.chat_template
    source = in_memory(load_sft_source("tiny_sft")[0].select_columns(["messages"]))
    marked = tokenize_sft_dataset(source, tiny, format="messages")
    assert marked.to_dict() == tokenize_sft_dataset(source, fallback, format="messages").to_dict()


messages_text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=12)


@st.composite
def conversations(draw):
    """system? (user assistant){1..3} user?, with arbitrary text."""
    turns = [{"role": "system", "content": draw(messages_text)}] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(1, 3))):
        turns += [
            {"role": "user", "content": draw(messages_text)},
            {"role": "assistant", "content": draw(messages_text)},
        ]
    if draw(st.booleans()):
        turns.append({"role": "user", "content": draw(messages_text)})
    return turns


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.lists(conversations(), min_size=1, max_size=4))
def test_fallback_equals_generation_markers_property(tiny, batch):
    fallback = load_tokenizer("tiny")
    fallback.chat_template = strip_generation_tags(tiny.chat_template)
    dataset = datasets.Dataset.from_dict({"messages": batch})
    marked = rows(tokenize_sft_dataset(dataset, tiny, format="messages"))
    assert marked == rows(tokenize_sft_dataset(dataset, fallback, format="messages"))
    for row, conversation in zip(marked, batch, strict=True):
        learned = [t for t, m in zip(row["labels"], row["loss_mask"], strict=True) if m]
        expected = "".join(m["content"] + "<|eos|>" for m in conversation if m["role"] == "assistant")
        assert tiny.decode(learned) == expected


def test_fallback_finds_turns_after_a_block_the_prompt_has_elsewhere():
    # The template writes the system prompt with the last user message (as Mistral's does): the
    # prompt of turn 2 holds it where the whole conversation does not, and the turn is still found.
    template = (
        "{{ bos_token }}{% set ns = namespace(last=-1) %}"
        "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
        "{% for m in messages %}{% if m.role != 'system' %} "
        "{% if loop.index0 == ns.last %}SYSTEM: {{ messages[0].content }} {% endif %}"
        "{{ m.role | upper }}: {{ m.content }}{% if m.role == 'assistant' %} {{ eos_token }}{% endif %}"
        "{% endif %}{% endfor %}{% if add_generation_prompt %} ASSISTANT:{% endif %}"
    )
    dataset = datasets.Dataset.from_dict({"messages": [CONVERSATION]})
    (row,) = rows(tokenize_sft_dataset(dataset, word_tokenizer(template), format="messages"))
    # <s> USER: what is two plus two ASSISTANT: four </s> SYSTEM: be brief USER: thanks ASSISTANT: ok </s>
    assert row["labels"] == [4, 6, 7, 8, 9, 8, 5, 10, 2, 3, 11, 12, 4, 13, 5, 14, 2]
    assert row["loss_mask"] == [0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1]


def test_fallback_finds_turns_after_a_prefix_that_changes_with_every_prompt():
    # A count of the messages first: no prompt is a prefix of the conversation, but each prompt's end
    # (the turns before and the generation prompt) stands in it once, and the turn starts there.
    template = "{{ messages | length }}" + strip_generation_tags(WORD_TEMPLATE)
    dataset = datasets.Dataset.from_dict({"messages": [CONVERSATION[:3], CONVERSATION]})
    tokenizer = word_tokenizer(template)
    learned = [
        tokenizer.decode([label for label, m in zip(row["labels"], row["loss_mask"]) if m])
        for row in rows(tokenize_sft_dataset(dataset, tokenizer, format="messages"))
    ]
    assert learned == ["four </s>", "four </s> ok </s>"]


def test_fallback_names_the_row_whose_turns_cannot_be_located():
    template = strip_generation_tags(WORD_TEMPLATE).replace(
        "in messages", "in messages | reverse"
    )  # last first
    dataset = datasets.Dataset.from_dict({"messages": [CONVERSATION[:3], CONVERSATION]})
    with pytest.raises(
        ValueError, match=r"row [12]: field 'messages' .*message [24]: .* add \{% generation %\}"
    ):
        tokenize_sft_dataset(dataset, word_tokenizer(template), format="messages")


def test_num_proc_gives_the_same_rows(tiny):
    source = in_memory(load_sft_source("tiny_sft")[0].select(range(200)))
    single = tokenize_sft_dataset(source, tiny, format="messages")
    assert single.to_dict() == tokenize_sft_dataset(source, tiny, format="messages", num_proc=2).to_dict()


# -- drops, truncation and their reports ------------------------------------------------------------


def test_conversation_without_assistant_turn_is_dropped_and_reported(caplog):
    dataset = datasets.Dataset.from_dict(
        {"messages": [CONVERSATION, [{"role": "user", "content": "thanks"}], CONVERSATION[:3]]}
    )
    with caplog.at_level(logging.WARNING, logger="automodel.data.sft"):
        out = tokenize_sft_dataset(dataset, word_tokenizer(), format="messages")
    assert len(out) == 2 and out[1]["labels"] == CONVERSATION_IDS[1:13]
    assert "dropped 1 of 3 rows (33.33%)" in caplog.text


def test_max_length_truncates_and_drops_with_a_report(caplog):
    dataset = datasets.Dataset.from_dict(
        {"prompt": ["be brief", "what is two plus two", "ok"], "completion": ["ok", "four", "four"]}
    )
    with caplog.at_level(logging.WARNING, logger="automodel.data.sft"):
        out = tokenize_sft_dataset(dataset, word_tokenizer(), max_length=3)
    # ids: [1 11 12 14 2] -> [1 11 12 14]; [1 6 7 8 ...] -> [1 6 7 8]: prompt only, dropped; [1 14 10 2] kept whole
    assert rows(out) == [
        {"input_ids": [1, 11, 12], "labels": [11, 12, 14], "loss_mask": [0, 0, 1]},
        {"input_ids": [1, 14, 10], "labels": [14, 10, 2], "loss_mask": [0, 1, 1]},
    ]
    # 4 + 7 + 3 positions, 2 + 2 + 2 learned; the first two rows lose 1 and 4 positions, 1 and 2 learned
    assert (
        "truncated 2 of 3 rows (66.67%) to 3 tokens: 5 of 14 tokens lost (35.71%), 3 of 6 learned"
        in caplog.text
    )
    assert "dropped 1 of 3 rows (33.33%)" in caplog.text
    with pytest.raises(ValueError, match="none of the 3 rows"):
        tokenize_sft_dataset(dataset, word_tokenizer(), max_length=1)


def test_token_kinds_are_cut_with_the_sample(caplog):
    """``token_kinds`` (what ``automodel data`` shows) is split, truncated and selected with the other
    columns. The conversation's 17 positions at max_length 6: pieces [0:6] (nothing learned: dropped),
    [6:12] and [12:17]."""
    dataset = datasets.Dataset.from_dict({"messages": [CONVERSATION]})
    split = tokenize_sft_dataset(dataset, word_tokenizer(), format="messages", max_length=6, long_samples="split",
                                 token_kinds=True)  # fmt: skip
    assert rows(split) == [
        {"input_ids": CONVERSATION_IDS[6:12], "labels": CONVERSATION_IDS[7:13], "loss_mask": [0, 0, 0, 0, 1, 1],
         "token_kinds": [0, 0, 0, 0, 1, 1]},
        {"input_ids": CONVERSATION_IDS[12:17], "labels": CONVERSATION_IDS[13:18], "loss_mask": [0, 0, 0, 1, 1],
         "token_kinds": [0, 0, 0, 1, 1]},
    ]  # fmt: skip
    truncated = tokenize_sft_dataset(dataset, word_tokenizer(), format="messages", max_length=12,
                                     long_samples="truncate", token_kinds=True)  # fmt: skip
    assert rows(truncated)[0]["token_kinds"] == CONVERSATION_MASK[1:13]


def test_token_kinds_of_tool_chats_follow_their_pieces():
    """The shipped tool chats split at 24 positions: each piece's kinds are its slice of the whole
    row's (tool outputs, calls and reasoning included), and exactly its learned kinds carry loss."""
    from automodel.data.chat import LEARNED, REASONING_LEARNED, TOOL_CALL, TOOL_OUTPUT

    chats, tools = load_sft_source("tiny_tools")[0].select(range(12)), load_tokenizer("tiny_tools")
    whole = rows(tokenize_sft_dataset(chats, tools, format="messages", token_kinds=True))
    pieces = rows(tokenize_sft_dataset(chats, tools, format="messages", max_length=24, long_samples="split",
                                       token_kinds=True))  # fmt: skip
    assert any(TOOL_OUTPUT in row["token_kinds"] for row in whole)
    r = start = 0
    for piece in pieces:
        n = len(piece["input_ids"])
        assert len(piece["token_kinds"]) == n and n <= 24
        assert [int(k in (LEARNED, TOOL_CALL, REASONING_LEARNED)) for k in piece["token_kinds"]] == piece[
            "loss_mask"
        ]
        while whole[r]["input_ids"][start : start + n] != piece["input_ids"]:  # the next piece that learns
            start += 24
            if start >= len(whole[r]["input_ids"]):
                r, start = r + 1, 0
        assert piece["token_kinds"] == whole[r]["token_kinds"][start : start + n]
        start += 24


# -- bad input --------------------------------------------------------------------------------------


def prompt_completion(**columns) -> datasets.Dataset:
    return datasets.Dataset.from_dict(
        {"prompt": ["be brief", "what is"], "completion": ["ok", "four"], **columns}
    )


@pytest.mark.parametrize(
    ("dataset", "kwargs", "match"),
    [
        (
            prompt_completion(),
            {"columns": {"completion": "answer"}},
            r"field 'completion', but column 'answer' is not in the dataset.*prompt",
        ),
        (prompt_completion(completion=["ok", ""]), {}, r"row 2: field 'completion' .*is empty"),
        (
            prompt_completion(prompt=["x", None]),
            {},
            r"row 2: field 'prompt' .*has no value in this row \(a missing key, null, or an empty CSV cell\)",
        ),
        (prompt_completion(completion=[1, 2]), {}, r"row 1: field 'completion' .*must be text, got int 1"),
        (
            prompt_completion(),
            {"format": "chat"},
            r"format must be one of \('messages', 'sharegpt'",
        ),
        (prompt_completion(), {"max_length": 0}, r"max_length must be None or a positive int"),
        (prompt_completion(), {"num_proc": 0}, r"num_proc must be None or a positive int"),
        (
            prompt_completion(),
            {"format": "messages"},
            r"needs field 'messages', but column 'messages' is not in the dataset",
        ),
        (datasets.Dataset.from_dict({"prompt": [], "completion": []}), {}, r"dataset is empty"),
    ],
)
def test_bad_prompt_completion_input(dataset, kwargs, match):
    with pytest.raises(ValueError, match=match):
        tokenize_sft_dataset(dataset, word_tokenizer(), **kwargs)


def chat(*messages) -> list[dict]:
    return [{"role": role, "content": content} for role, content in messages]


@pytest.mark.parametrize(
    ("conversations", "match"),
    [
        ([chat(("assistant", "four"), ("user", "ok"))], r"row 1: field 'messages'.*starts with an assistant"),
        ([chat(("user", "what"), ("assistant", "four")), chat(("user", "is"), ("assistant", ""))], r"row 2: field 'messages'.*assistant message is empty \(no content, tool_calls or reasoning\)"),
        ([chat(("user", "what"), ("assistant", "four")), []], r"row 2: field 'messages'.*must be a non-empty list"),
        ([chat(("user", "what"), ("assistant", "four")), chat(("user", None), ("assistant", "ok"))], r"row 2: field 'messages'.*message 0 \(user\) has no 'content' \(missing or null\)"),
        (["what is two plus two"], r"row 1: field 'messages'.*must be a non-empty list"),
    ],
)  # fmt: skip
def test_bad_messages_input(conversations, match):
    dataset = datasets.Dataset.from_dict({"messages": conversations})
    with pytest.raises(ValueError, match=match):
        tokenize_sft_dataset(dataset, word_tokenizer(), format="messages")


def test_a_role_is_used_where_the_template_renders_it():
    """A role other than system/user/assistant is taken when the template renders it (the word template
    writes any role), and named with its row where the template fails on it (the tiny one raises) or
    drops it; a tool's output (Llama's ``ipython`` role) is never learned."""
    conversation = [*chat(("user", "what is two plus two"), ("ipython", "four"), ("assistant", "four"))]
    dataset = datasets.Dataset.from_dict({"messages": [conversation]})
    (row,) = rows(tokenize_sft_dataset(dataset, word_tokenizer(), format="messages"))
    # <s> USER: what is two plus two IPYTHON: four ASSISTANT: four </s>  ("IPYTHON:" is unknown: 15)
    assert row["input_ids"] == [1, 4, 6, 7, 8, 9, 8, 15, 10, 5, 10]
    assert row["loss_mask"] == [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1]  # the tool's "four" is not learned
    bad = datasets.Dataset.from_dict({"messages": [chat(("user", "hi"), ("assistant", "ok")), conversation]})
    with pytest.raises(ValueError, match=r"row 2: field 'messages' .*message 1: role 'ipython': the chat template "
                       r"fails on it \(TemplateError: role must be system, user or assistant, got ipython\)"):  # fmt: skip
        tokenize_sft_dataset(bad, load_tokenizer("tiny"), format="messages")
    dropping = WORD_TEMPLATE.replace(
        "{% for m in messages %}", "{% for m in messages if m.role != 'ipython' %}"
    )
    with pytest.raises(
        ValueError, match=r"row 2: .*message 1: role 'ipython' is not rendered by the chat template"
    ):
        tokenize_sft_dataset(bad, word_tokenizer(dropping), format="messages")


def test_prompt_completion_needs_an_eos_token():
    tokenizer = word_tokenizer()
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match="no eos token"):
        tokenize_sft_dataset(prompt_completion(), tokenizer)


def test_messages_need_a_chat_template():
    dataset = datasets.Dataset.from_dict({"messages": [CONVERSATION]})
    with pytest.raises(ValueError, match="no chat_template"):
        tokenize_sft_dataset(dataset, word_tokenizer(template=None), format="messages")


def test_wrong_argument_types():
    with pytest.raises(TypeError, match="one split of the DatasetDict"):
        tokenize_sft_dataset(datasets.DatasetDict({"train": prompt_completion()}), word_tokenizer())
    with pytest.raises(TypeError, match="transformers tokenizer"):
        tokenize_sft_dataset(prompt_completion(), "tiny")


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer at 'no/such-tokenizer'"):
        load_tokenizer("no/such-tokenizer")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="is a file"):
        load_tokenizer(tmp_path / "tokenizer.json")


# -- end to end -------------------------------------------------------------------------------------


@pytest.mark.parametrize("format", ["prompt_completion", "messages"])
def test_tiny_sft_to_packs_learns_only_completions(tiny, tmp_path, format):
    size = 512
    source, _ = load_sft_source("tiny_sft", cache_dir=tmp_path)
    tokenized = tokenize_sft_dataset(source, tiny, format=format)
    packs = pack_dataset(tokenized, "train", size, algorithm="sequential").with_format("numpy")[
        :
    ]  # keeps order
    labels, inputs = packs["labels"].ravel(), packs["input_ids"].ravel()  # [P * S]
    seq_lens = list(packs["seq_lens"])
    starts = np.concatenate([p * size + np.r_[0, np.cumsum(lens)[:-1]] for p, lens in enumerate(seq_lens)])
    lengths = np.concatenate(seq_lens)
    assert len(lengths) == len(source) == len(tokenized)

    in_sample = np.zeros(len(labels), dtype=bool)
    for row, start, length in zip(source, starts, lengths, strict=True):
        sample_labels, next_inputs = labels[start : start + length], inputs[start + 1 : start + length]
        in_sample[start : start + length] = True
        if format == "prompt_completion":
            expected = row["completion"] + "<|eos|>"
        else:
            expected = "".join(m["content"] + "<|eos|>" for m in row["messages"] if m["role"] == "assistant")
        assert tiny.decode(sample_labels[sample_labels != -100].tolist()) == expected
        learned = sample_labels[:-1] != -100  # a learned label is the next input token: the shift survived
        assert (sample_labels[:-1][learned] == next_inputs[learned]).all()
    assert (labels[~in_sample] == -100).all()  # padding is never learned


def test_tokenizer_disagreements_name_what_a_model_would_read_otherwise(tiny):
    assert tokenizer_disagreements(tiny, load_tokenizer("tiny")) == []
    assert tokenizer_disagreements(tiny, load_tokenizer("tiny_tools")) == [
        "bos_token '<|bos|>' vs None",
        "eos_token '<|eos|>' vs '<|im_end|>'",
        "another chat template",
    ]
    smaller = load_tokenizer("tiny")
    smaller.add_tokens(["<extra>"])
    assert tokenizer_disagreements(tiny, smaller) == ["512 vs 513 tokens"]


def test_a_checkpoint_without_its_tokenizer_is_told_to_bring_its_own(tmp_path):
    """``data.tokenizer: null`` beside a checkpoint saved with weights only (or a tokenizer_config.json
    without the vocabulary): the fix is the tokenizer of the model it came from, named under the key
    the user set. It used to offer the built-in tiny tokenizers, another vocabulary for a real model,
    and to name data.tokenizer, which the user had left null."""
    from automodel.data.sft import load_data_tokenizer

    checkpoint = tmp_path / "ck"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    for files in ((), ("tokenizer_config.json",)):
        for name in files:
            (checkpoint / name).write_text("{}")
        with pytest.raises(ValueError) as refused:
            load_data_tokenizer(None, str(checkpoint))
        message = str(refused.value)
        assert message.startswith(f"data.tokenizer is null (the checkpoint's own), but model.pretrained_path='{checkpoint}'"
                                  " holds no tokenizer file (tokenizer.json, *.model")  # fmt: skip
        assert f"save the tokenizer of the model it was trained from into it (AutoTokenizer.from_pretrained(<that model>).save_pretrained('{checkpoint}'))" in message  # fmt: skip
        assert "tiny" not in message
