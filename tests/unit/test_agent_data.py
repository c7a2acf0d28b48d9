"""Tool-calling data as users' files hold it: arguments as JSON text or objects, the public agent-data
shapes (shipped examples in ``agent_data/``), bad tool rows refused or skipped and counted, and
reasoning the chat template does not write reported."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import datasets
import pytest
from chat_formats import TOOLS, tokenizer

from automodel.data.chat import BadRow, parse_messages
from automodel.data.sft import load_tokenizer, tokenize_sft_dataset
from automodel.data.sources import load_sft_source
from automodel.errors import DataError

EXAMPLES = Path(__file__).resolve().parent / "agent_data"
TOKENIZERS = {
    name: tokenizer(name, marked=False)
    for name in ("qwen3", "harmony", "hermes", "llama31_json", "mistral_tool")
}
TOKENIZERS["tiny_tools"] = load_tokenizer("tiny_tools")


def weather_call(arguments, call_id: str = "call12345") -> list[dict]:
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "content": "18 C", "tool_call_id": call_id},
        {"role": "assistant", "content": "It is 18 C."},
    ]  # fmt: skip


def tokenized(rows: list[dict], name: str, format: str = "messages", **options) -> list[dict]:
    dataset = datasets.Dataset.from_list(rows)
    return tokenize_sft_dataset(dataset, TOKENIZERS[name], format=format, **options).to_list()


def text_of(row: dict, name: str) -> str:
    return TOKENIZERS[name].decode(row["input_ids"] + row["labels"][-1:])


# -- arguments: JSON text and objects -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["hermes", "llama31_json", "mistral_tool", "tiny_tools"])
def test_json_text_and_object_arguments_give_identical_samples(name, tmp_path):
    """OpenAI data writes arguments as JSON text; templates that apply ``tojson`` to them (vLLM's Hermes,
    Llama 3.1 JSON and Mistral tool templates, the shipped ``tiny_tools``) would print a quoted string.
    Parsed first, both rows of one file are the same sample, and the call reads as JSON."""
    file = tmp_path / "chat.jsonl"
    file.write_text("".join(json.dumps({"messages": weather_call(arguments), "tools": TOOLS}) + "\n"
                            for arguments in ('{"city": "Paris"}', {"city": "Paris"})))  # fmt: skip
    rows, origin = load_sft_source(file)
    as_text, as_object = tokenize_sft_dataset(
        rows, TOKENIZERS[name], format="messages", origin=origin
    ).to_list()
    assert as_text == as_object
    assert '{"city": "Paris"}' in text_of(as_text, name) and '"{\\"city' not in text_of(as_text, name)


# -- the public shapes, one documented key each -------------------------------------------------------------


def shipped(file: str, format: str, name: str = "qwen3") -> list[dict]:
    rows, origin = load_sft_source(EXAMPLES / file)
    return tokenize_sft_dataset(rows, TOKENIZERS[name], format=format, origin=origin).to_list()


def test_public_agent_shapes_read_as_the_same_conversations():
    """The shipped examples hold the same two conversations (a call, its result and the answer; two
    parallel calls) as OpenAI messages (arguments as text in one, objects in the other), ShareGPT
    with ``function_call``/``observation``, Hermes ``<tool_call>`` text (Python dict literals, as
    Hermes data writes them) and xLAM (the second only: xLAM rows are one request and its calls):
    each read by its ``data.format``, every sample is the OpenAI one."""
    openai = shipped("openai.jsonl", "messages")
    assert len(openai) == 2
    assert shipped("sharegpt.jsonl", "sharegpt") == openai
    assert shipped("hermes.jsonl", "hermes") == openai
    assert shipped("xlam.json", "xlam") == openai[1:]
    learned = [t for t, m in zip(openai[1]["labels"], openai[1]["loss_mask"], strict=True) if m]
    assert TOKENIZERS["qwen3"].decode(learned) == (
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 10, "b": 20}}\n</tool_call><|im_end|>'
    )


def test_sharegpt_calls_get_ids_for_a_template_that_needs_them():
    """ShareGPT has no call ids; Mistral's template refuses a call without one. The calls are numbered
    in each row (``call00000``...) and each observation answers the call before it, the same ids
    every time."""
    first = shipped("sharegpt.jsonl", "sharegpt", "mistral_tool")
    assert shipped("sharegpt.jsonl", "sharegpt", "mistral_tool") == first
    weather, adds = (text_of(row, "mistral_tool") for row in first)
    assert '"id": "call00000"}]' in weather and '"call_id": "call00000"}[/TOOL_RESULTS]' in weather
    assert '"id": "call00000"}, {"name": "add", "arguments": {"a": 10, "b": 20}, "id": "call00001"}]' in adds


def test_xlam_parameters_become_json_schema():
    rows, _ = load_sft_source(EXAMPLES / "xlam.json")
    dataset = tokenize_sft_dataset(rows, TOKENIZERS["qwen3"], format="xlam")
    text = text_of(dataset[0], "qwen3")
    assert (
        '"parameters": {"type": "object", "properties": {"a": {"description": "The first.", "type": "integer"}, '
        '"b": {"description": "The second.", "type": "integer"}}, "required": ["a", "b"]}'
    ) in text


# -- bad tool rows: refused with file, line, message and field, or skipped and counted -----------------------

CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
USER, RESULT, ANSWER = (
    {"role": "user", "content": "1+2?"},
    {"role": "tool", "content": "3"},
    {"role": "assistant", "content": "3"},
)
BAD_ROWS = {
    "arguments text that is not JSON": (
        [USER, {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "add", "arguments": "{a: 1"}}]},
         RESULT, ANSWER],
        r"message 1: tool call 0 \('add'\): 'arguments' is text but not JSON",
    ),
    "arguments null": (
        [USER, {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "add", "arguments": None}}]},
         RESULT, ANSWER],
        r"message 1: tool call 0 \('add'\): 'arguments' is null or missing; write \{\}",
    ),
    "arguments not an object": (
        [USER, {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "add", "arguments": "[1, 2]"}}]},
         RESULT, ANSWER],
        r"message 1: tool call 0 \('add'\): 'arguments' must be a JSON object",
    ),
    "an empty call list and no content": (
        [USER, {"role": "assistant", "content": None, "tool_calls": []}, USER, ANSWER],
        r"message 1: 'tool_calls' is an empty list and the assistant message has no content",
    ),
    "a tool result no call asked for": (
        [USER, ANSWER, RESULT, ANSWER],
        r"message 2 \(tool\): a tool result that no call asked for",
    ),
    "a tool result before the first user message": (
        [RESULT, USER, ANSWER],
        r"message 0 \(tool\): a tool result that no call asked for",
    ),
    "more results than calls": (
        [USER, {"role": "assistant", "tool_calls": [CALL]}, RESULT, RESULT, ANSWER],
        r"message 3 \(tool\): a tool result that no call asked for",
    ),
    "a result whose id answers no call": (
        [USER, {"role": "assistant", "tool_calls": [{**CALL, "id": "call_1"}]}, {**RESULT, "tool_call_id": "call_9"},
         ANSWER],
        r"message 2 \(tool\): tool_call_id 'call_9' answers none of the calls before it \(ids 'call_1'\)",
    ),
    "a call to a tool the row does not offer": (
        [USER, {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "mul", "arguments": {}}}]},
         RESULT, ANSWER],
        r"message 1: tool call 0 \('mul'\) calls a tool the row's tools do not offer \(add, get_weather\)",
    ),
    "two reasoning fields that disagree": (
        [USER, {**ANSWER, "reasoning_content": "Add them.", "thinking": "Multiply them."}],
        r"message 1: 'reasoning_content' and 'thinking' hold different reasoning traces",
    ),
    "reasoning on a user message": (
        [{**USER, "reasoning_content": "I wonder."}, ANSWER],
        r"message 0 \(user\) carries a reasoning trace \('reasoning_content'\)",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_bad_tool_rows_name_the_message_and_what_is_wrong(case):
    messages, reason = BAD_ROWS[case]
    with pytest.raises(BadRow, match=rf"^{reason}") as refused:
        parse_messages(messages, tools=TOOLS)
    assert refused.value.field == "messages"


def test_bad_rows_are_refused_with_file_and_line_or_skipped_and_counted(tmp_path, caplog):
    """One file, a good row then one row of each kind above: the run stops at line 2 naming the field,
    or with on_bad_row=skip keeps the good row and counts the others in rows and tokens, by reason."""
    file = tmp_path / "chat.jsonl"
    conversations = [[USER, ANSWER], *(messages for messages, _ in BAD_ROWS.values())]
    file.write_text("".join(json.dumps({"messages": c, "tools": TOOLS}) + "\n" for c in conversations))
    rows, origin = load_sft_source(file)
    first = next(iter(BAD_ROWS.values()))[1]
    with pytest.raises(
        DataError, match=rf"{re.escape(str(file))} line 2: field 'messages' \(column 'messages'\): {first}"
    ):
        tokenize_sft_dataset(rows, TOKENIZERS["qwen3"], format="messages", origin=origin)
    with caplog.at_level(logging.WARNING, logger="automodel.data.sft"):
        kept = tokenize_sft_dataset(
            rows, TOKENIZERS["qwen3"], format="messages", origin=origin, on_bad_row="skip"
        )
    assert len(kept) == 1
    skipped = len(BAD_ROWS)
    found = re.search(rf"skipped {skipped} of {skipped + 1} rows \({100 * skipped / (skipped + 1):.2f}%\) that are "
                      r"malformed \(on_bad_row=skip\), ([\d,]+) tokens of text", caplog.text)  # fmt: skip
    assert found and int(found.group(1).replace(",", "")) > 0, caplog.text


def test_a_skipped_row_is_counted_in_the_tokens_of_its_text(tmp_path, caplog):
    """The tokens a dropped row held: the texts of its fields, one per line (here its roles and
    contents, in order)."""
    file = tmp_path / "chat.jsonl"
    file.write_text(
        json.dumps({"messages": [USER, ANSWER]}) + "\n" + json.dumps({"messages": [USER, RESULT]}) + "\n"
    )
    rows, origin = load_sft_source(file)
    with caplog.at_level(logging.WARNING, logger="automodel.data.sft"):
        tokenize_sft_dataset(rows, TOKENIZERS["qwen3"], format="messages", origin=origin, on_bad_row="skip")
    text = "\n".join(["user", "1+2?", "tool", "3"])
    tokens = len(TOKENIZERS["qwen3"](text, add_special_tokens=False)["input_ids"])
    assert f"that are malformed (on_bad_row=skip), {tokens} tokens of text" in caplog.text


def test_agreeing_reasoning_fields_are_one_trace():
    """``reasoning_content`` and ``thinking`` holding the same trace (up to surrounding whitespace) are
    one trace, under one name: the harmony template (which reads ``thinking``) writes it as given."""
    one = [USER, {**ANSWER, "reasoning_content": "Add them."}]
    both = [USER, {**ANSWER, "reasoning_content": "Add them.", "thinking": "Add them.\n"}]
    assert tokenized([{"messages": both}], "harmony") == tokenized([{"messages": one}], "harmony")


# -- reasoning the template does not write ------------------------------------------------------------------

WEATHER = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "reasoning_content": "Need the tool.", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "18 C"},
    {"role": "assistant", "content": "It is 18 C.", "reasoning_content": "Got it."},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "You are welcome.", "reasoning_content": "Polite."},
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "dropped"),
    [("hermes", ["Need the tool.", "Got it.", "Polite."]), ("qwen3", ["Need the tool.", "Got it."])],
)
def test_reasoning_the_template_does_not_write_is_reported(name, dropped, caplog):
    """Hermes writes no reasoning; Qwen3 only on the turns after the last user message. One warning
    names the tokenizer and counts the turns, rows and tokens not trained."""
    with caplog.at_level(logging.WARNING, logger="automodel.data.sft"):
        tokenized([{"messages": WEATHER, "tools": json.dumps(TOOLS)}, {"messages": [USER, ANSWER]}], name)
    tokens = sum(len(TOKENIZERS[name](trace, add_special_tokens=False)["input_ids"]) for trace in dropped)
    assert (
        f"does not write the reasoning trace of {len(dropped)} assistant turn(s) in 1 of 2 rows ({tokens} tokens): "
        "they are not trained; first: dataset row 1"
    ) in caplog.text
    assert caplog.text.count("does not write the reasoning trace") == 1


def test_a_shape_read_as_another_format_names_its_own():
    """xLAM rows read as ``messages`` (the default of the chat data group) name ``format='xlam'``."""
    rows, origin = load_sft_source(EXAMPLES / "xlam.json")
    with pytest.raises(
        ValueError, match=r"needs field 'messages'.* or pick format='xlam', whose fields these columns"
    ):
        tokenize_sft_dataset(rows, TOKENIZERS["qwen3"], format="messages", origin=origin)
