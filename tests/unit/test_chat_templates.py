"""The assistant masks read from chat templates of nine published formats (``chat_templates/``):
the tokens learned are exactly the assistant's, with or without ``{% generation %}`` blocks in the
template, and the ids are ``apply_chat_template``'s.

The oracle is the templates' own generation blocks, placed by hand around each assistant message's
answer (its content or tool calls and its end-of-turn token) or its whole output (with what the template
writes before the content: a ``<think>`` block, a harmony channel header), and chosen per turn by
template variables: transformers' ``return_assistant_tokens_mask`` then gives the expected mask.
"""

from __future__ import annotations

import json

import datasets
import pytest
from chat_formats import FORMATS, TOOLS, conversation, tokenizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from automodel.data.chat import (
    ASSISTANT_TURNS,
    REASONING,
    ChatPolicy,
    encode_chat,
    parse_messages,
    template_facts,
)
from automodel.data.sft import tokenize_sft_dataset

TOKENIZERS = {(name, marked): tokenizer(name, marked) for name in FORMATS for marked in (False, True)}
FACTS = {key: template_facts(t) for key, t in TOKENIZERS.items()}


def flag(message: dict) -> bool | None:
    """The message's own training flag as the data writes it: train true/false, or weight 0/1."""
    if "train" in message:
        return message["train"]
    return bool(message["weight"]) if "weight" in message else None


def as_objects(message: dict) -> dict:
    """The message as the template should read it: no training flag, tool-call arguments given as
    JSON text as the object they spell (the template decides how to print an object)."""
    message = {k: v for k, v in message.items() if k not in ("train", "weight")}
    if "tool_calls" in message:
        message["tool_calls"] = [
            {**call, "function": {**call["function"], "arguments": json.loads(call["function"]["arguments"])}}
            if isinstance(call["function"]["arguments"], str) else call for call in message["tool_calls"]
        ]  # fmt: skip
    return message


def expected(
    name: str, messages: list[dict], tools: list[dict] | None, policy: ChatPolicy
) -> tuple[list, list]:
    """``(ids, mask)`` from the oracle blocks: the turns the flags or the policy pick, whole where the
    message carries reasoning and reasoning is learned, else from its answer on."""
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    picked = [i if flag(messages[i]) is None else None for i in assistant]
    learn = [n for n, i in enumerate(assistant) if (flag(messages[i]) if picked[n] is None else
             policy.assistant_turns == "all" or i == assistant[-1])]  # fmt: skip
    whole = [
        n
        for n, i in enumerate(assistant)
        if messages[i].get("reasoning_content") and policy.reasoning == "learn"
    ]
    clean = [as_objects(m) for m in messages]
    marked = TOKENIZERS[name, True].apply_chat_template(
        clean,
        tools=tools,
        return_dict=True,
        return_assistant_tokens_mask=True,
        oracle_learn=learn,
        oracle_whole=whole,
    )
    plain = TOKENIZERS[name, False].apply_chat_template(clean, tools=tools, return_dict=True)
    assert marked["input_ids"] == plain["input_ids"]  # the blocks change no text
    return plain["input_ids"], marked["assistant_masks"]


@pytest.mark.parametrize("name", list(FORMATS))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_learned_tokens_are_exactly_the_assistants(name, data):
    messages, tools = data.draw(conversation(name))
    policy = ChatPolicy(data.draw(st.sampled_from(ASSISTANT_TURNS)), data.draw(st.sampled_from(REASONING)))
    ids, mask = expected(name, messages, tools, policy)
    chat = parse_messages(messages, tools=tools)
    for marked in (False, True):  # located from the template's rendering, and read from its blocks
        got_ids, got_mask, _ = encode_chat(
            chat, TOKENIZERS[name, marked], policy, FACTS[name, marked], "messages"
        )
        assert got_ids == ids, (name, marked)
        assert got_mask == mask, (name, marked, TOKENIZERS[name, False].decode(ids))


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_whitespace_reasoning_trace_is_rendered_as_the_template_writes_it(name):
    """A trace of one space was dropped before rendering, while harmony's template writes it as an
    analysis message: the ids were not apply_chat_template's (found by the property test above)."""
    messages = [
        {"role": "user", "content": "0"},
        {"role": "assistant", "content": "0", "reasoning_content": " "},
    ]
    policy = ChatPolicy("all", "learn")
    ids, mask = expected(name, messages, None, policy)
    got_ids, got_mask, _ = encode_chat(
        parse_messages(messages, tools=None), TOKENIZERS[name, False], policy, FACTS[name, False], "messages"
    )
    assert (got_ids, got_mask) == (ids, mask)


def test_mistral_tools_before_every_user_message_equal_to_the_last_do_not_lose_the_turn():
    """Mistral's template writes the tools before each user message equal to the last one: with the
    first and last user messages alike the prompt of the middle turn matched the conversation nowhere
    and the row was refused (found by the property test above)."""
    messages = [{"role": "user", "content": "00"}, {"role": "assistant", "content": "0"},
                {"role": "user", "content": "0"}, {"role": "assistant", "content": "0"},
                {"role": "user", "content": "00"}, {"role": "assistant", "content": "0"}]  # fmt: skip
    policy = ChatPolicy("all", "learn")
    ids, mask = expected("mistral_tool", messages, TOOLS, policy)
    tokenizer = TOKENIZERS["mistral_tool", False]
    got_ids, got_mask, _ = encode_chat(
        parse_messages(messages, tools=TOOLS), tokenizer, policy, FACTS["mistral_tool", False], "messages"
    )
    assert (got_ids, got_mask) == (ids, mask)
    assert sum(mask) > 0 and tokenizer.decode([t for t, m in zip(ids, mask) if m]).count("</s>") == 3


# -- worked examples ----------------------------------------------------------------------------------------

WEATHER = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "reasoning_content": "Need the tool.", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "18 C"},
    {"role": "assistant", "content": "It is 18 C.", "reasoning_content": "Got it."},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "You are welcome.", "reasoning_content": "Polite."},
]  # fmt: skip
QWEN3_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
HARMONY_CALL = (
    ' to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
)


def learned_runs(name: str, messages: list[dict], **options) -> list[str]:
    """Each run of learned labels decoded, the row tokenized as ``automodel`` does (the tools as JSON text)."""
    dataset = datasets.Dataset.from_dict({"messages": [messages], "tools": [json.dumps(TOOLS)]})
    tokenizer = TOKENIZERS[name, False]
    (row,) = tokenize_sft_dataset(dataset, tokenizer, format="messages", **options).to_list()
    runs, current = [], []
    for label, learned in zip(row["labels"], row["loss_mask"], strict=True):
        if learned:
            current.append(label)
        elif current:
            runs, current = [*runs, tokenizer.decode(current)], []
    return runs + ([tokenizer.decode(current)] if current else [])


@pytest.mark.parametrize(
    ("name", "options", "runs"),
    [
        # Qwen3 writes <think> only after the last user query: the last turn's reasoning is learned or
        # masked, the earlier turns' is not rendered at all; "\n" after <|im_end|> is never learned.
        ("qwen3", {}, [QWEN3_CALL, "It is 18 C.<|im_end|>", "<think>\nPolite.\n</think>\n\nYou are welcome.<|im_end|>"]),
        ("qwen3", {"reasoning": "mask"}, [QWEN3_CALL, "It is 18 C.<|im_end|>", "You are welcome.<|im_end|>"]),
        ("qwen3", {"assistant_turns": "last"}, ["<think>\nPolite.\n</think>\n\nYou are welcome.<|im_end|>"]),
        # harmony: a tool call keeps its analysis message; a final answer ends with <|end|>, the last
        # with <|return|>; masked reasoning leaves the answer (and the call from its recipient on).
        ("harmony", {}, ["<|channel|>analysis<|message|>Need the tool.<|end|><|start|>assistant" + HARMONY_CALL,
                         "<|channel|>final<|message|>It is 18 C.<|end|>",
                         "<|channel|>analysis<|message|>Polite.<|end|><|start|>assistant<|channel|>final<|message|>"
                         "You are welcome.<|return|>"]),
        ("harmony", {"reasoning": "mask"}, [HARMONY_CALL, "It is 18 C.<|end|>", "You are welcome.<|return|>"]),
        # Hermes writes no reasoning and closes a tool turn with "\n<|im_end|>" only when a turn follows:
        # a turn with reasoning after a tool result learns its answer, not that <|im_end|> and its header.
        ("hermes", {}, [HERMES_CALL, "It is 18 C.<|im_end|>", "You are welcome.<|im_end|>"]),
    ],
)  # fmt: skip
def test_worked_examples(name, options, runs):
    assert learned_runs(name, WEATHER, **options) == runs


def test_flags_pick_turns_and_an_empty_think_block_is_context():
    """``train: false`` and ``weight: 0`` leave a turn out, ``train: true`` keeps one that
    ``assistant_turns=last`` would drop; the empty ``<think>`` Qwen3 writes on a last turn without
    reasoning is not learned (it is what a non-thinking prompt gives the model)."""
    messages = [dict(m) for m in WEATHER]
    messages[1]["weight"], messages[3]["train"] = 0, True
    del messages[5]["reasoning_content"]
    assert learned_runs("qwen3", messages, assistant_turns="last") == [
        "It is 18 C.<|im_end|>",
        "You are welcome.<|im_end|>",
    ]
    messages[5]["train"] = False
    assert learned_runs("qwen3", messages) == ["It is 18 C.<|im_end|>"]


def test_sharegpt_tool_turns_are_the_same_conversation():
    """ShareGPT's ``function_call`` (the call as JSON) and ``observation`` turns read as a tool call and
    its result, with the row's tools: the same tokens and mask as the messages row."""
    conversations = [
        {"from": "human", "value": "Weather in Paris?"},
        {
            "from": "function_call",
            "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}}),
        },
        {"from": "observation", "value": "18 C"},
        {"from": "gpt", "value": "It is 18 C.", "weight": 1},
    ]
    tokenizer = TOKENIZERS["qwen3", False]
    sharegpt = tokenize_sft_dataset(
        datasets.Dataset.from_dict({"conversations": [conversations], "tools": [json.dumps(TOOLS)]}),
        tokenizer,
        format="sharegpt",
    ).to_list()
    messages = [WEATHER[0], {k: v for k, v in WEATHER[1].items() if k != "reasoning_content"}, WEATHER[2],
                {"role": "assistant", "content": "It is 18 C."}]  # fmt: skip
    assert (
        sharegpt
        == tokenize_sft_dataset(
            datasets.Dataset.from_dict({"messages": [messages], "tools": [json.dumps(TOOLS)]}),
            tokenizer,
            format="messages",
        ).to_list()
    )
    assert learned_runs("qwen3", messages) == [QWEN3_CALL, "It is 18 C.<|im_end|>"]
