"""Tokenizers for the chat templates in ``chat_templates/`` (published formats, written for the tests)
and hypothesis strategies for conversations each format can render.

``tokenizer(name)`` is a byte-level BPE trained on a little text, with the format's special tokens
(``special=True``) and the added tokens its models do not mark special (Qwen3's ``<think>``,
``<tool_call>``), around the template with its ``{% generation %}`` oracle blocks (``marked=True``)
or without them, as the format publishes it.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path

from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

TEMPLATES = Path(__file__).resolve().parent / "chat_templates"
GENERATION_TAGS = re.compile(r"\{%-?\s*(end)?generation\s*-?%\}")


@dataclass(frozen=True)
class Format:
    special: tuple[str, ...]  # bos, eos and pad first where the format has them (None: none)
    bos: str | None
    eos: str
    pad: str
    plain: tuple[str, ...] = ()  # added tokens the format's tokenizer does not mark special
    tools: bool = True
    calls_per_turn: int = 3
    alternate: bool = False  # user and assistant strictly alternate (no tool turns)
    call_ids: bool = False  # tool calls carry 9-character ids, tool results their call's id
    content_with_calls: bool = True  # the template renders content beside tool calls (else it drops it)


FORMATS = {
    "llama3": Format(
        ("<|begin_of_text|>", "<|eot_id|>", "<|finetune_right_pad_id|>", "<|start_header_id|>",
         "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"),
        "<|begin_of_text|>", "<|eot_id|>", "<|finetune_right_pad_id|>", calls_per_turn=1, content_with_calls=False,
    ),
    "qwen3": Format(
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None, "<|im_end|>", "<|endoftext|>",
        plain=("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
    ),
    "mistral": Format(
        ("<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
         "[TOOL_RESULTS]", "[/TOOL_RESULTS]"),
        "<s>", "</s>", "<pad>", call_ids=True, content_with_calls=False,
    ),
    "harmony": Format(
        ("<|startoftext|>", "<|return|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
         "<|constrain|>", "<|call|>"),
        None, "<|return|>", "<|endoftext|>", calls_per_turn=1,
    ),
    "gemma3": Format(
        ("<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"), "<bos>", "<eos>", "<pad>",
        tools=False, alternate=True,
    ),
    "hermes": Format(
        ("<s>", "<|im_end|>", "<pad>", "<|im_start|>"), "<s>", "<|im_end|>", "<pad>",
        plain=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<tools>", "</tools>"),
        content_with_calls=False,
    ),
    "llama31_json": Format(
        ("<|begin_of_text|>", "<|eot_id|>", "<|finetune_right_pad_id|>", "<|start_header_id|>",
         "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"),
        "<|begin_of_text|>", "<|eot_id|>", "<|finetune_right_pad_id|>", calls_per_turn=1, content_with_calls=False,
    ),
    "mistral_tool": Format(
        ("<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
         "[TOOL_RESULTS]", "[/TOOL_RESULTS]"),
        "<s>", "</s>", "<pad>", call_ids=True, content_with_calls=False,
    ),
    "deepseek_v3": Format(
        ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜tool▁calls▁begin｜>",
         "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
         "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"),
        "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", plain=("<｜User｜>", "<｜Assistant｜>"),
    ),
}  # fmt: skip

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city now.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city's name."},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "The sum of two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}},
]  # fmt: skip
# Text of the corpus the tokenizers learn merges from: a few sentences and JSON, so that words and
# brackets merge across what the templates join.
CORPUS = [
    'The weather in Paris is 18 degrees. {"city": "Paris", "unit": "celsius"} {"a": 2, "b": 3}',
    "What is the weather like today? Let me check the weather for you. The sum of two and three is five.",
    "I need to call the tool first, then answer the question with the result it gives.",
]


def template(name: str, marked: bool = True) -> str:
    text = (TEMPLATES / f"{name}.jinja").read_text()
    return text if marked else GENERATION_TAGS.sub("", text)


@functools.cache
def _tokenizer_json(name: str) -> str:
    spec = FORMATS[name]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator([*CORPUS, template(name, marked=False)], trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec.special])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.plain])
    return tokenizer.to_str()


def tokenizer(name: str, marked: bool = True) -> PreTrainedTokenizerFast:
    """The format's tokenizer with its template, with (``marked``) or without the oracle blocks."""
    spec = FORMATS[name]
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(name)),
        bos_token=spec.bos,
        eos_token=spec.eos,
        pad_token=spec.pad,
    )
    wrapped.chat_template = template(name, marked)
    return wrapped


# -- conversations ----------------------------------------------------------------------------------------

# Text without the characters templates use as markup (<|...|>, [INST]...), so no content spells a token.
text = st.text(
    st.sampled_from("abcdefghij klmnopqrstuvwxyzABCXYZ0123456789.,!?'\"\n{}:-_"), min_size=1, max_size=16
)
words = (
    st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz "), min_size=1, max_size=10)
    .map(str.strip)
    .filter(bool)
)
call_ids = st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz0123456789"), min_size=9, max_size=9)


@st.composite
def tool_call(draw, spec: Format) -> dict:
    if draw(st.booleans()):
        function = {"name": "get_weather", "arguments": {"city": draw(words)}}
        if draw(st.booleans()):
            function["arguments"]["unit"] = draw(st.sampled_from(["celsius", "fahrenheit"]))
    else:
        function = {
            "name": "add",
            "arguments": {"a": draw(st.integers(-99, 99)), "b": draw(st.integers(0, 99))},
        }
    if draw(st.booleans()):  # arguments as JSON text, as OpenAI's API gives them
        function["arguments"] = json.dumps(function["arguments"])
    call = {"type": "function", "function": function}
    if spec.call_ids:
        call["id"] = draw(call_ids)
    return call


@st.composite
def assistant(draw, spec: Format, calls: list[dict] | None = None) -> dict:
    message = {"role": "assistant"}
    if calls:
        message["tool_calls"] = calls
        if spec.content_with_calls and draw(st.booleans()):  # content beside the calls
            message["content"] = draw(text)
    else:
        message["content"] = draw(text)
    if draw(st.booleans()):
        message["reasoning_content"] = draw(text)
    flag = draw(st.sampled_from([None, ("train", True), ("train", False), ("weight", 1), ("weight", 0)]))
    if flag:
        message[flag[0]] = flag[1]
    return message


@st.composite
def conversation(draw, name: str) -> tuple[list[dict], list[dict] | None]:
    """``(messages, tools)``: a system prompt maybe, then rounds of a user message and a reply, where
    a reply may call tools, get their results and answer."""
    spec = FORMATS[name]
    messages = [{"role": "system", "content": draw(text)}] if draw(st.booleans()) else []
    tools = TOOLS if spec.tools and draw(st.booleans()) else None
    for _ in range(draw(st.integers(1, 3))):
        messages.append({"role": "user", "content": draw(text)})
        if tools and draw(st.booleans()):
            calls = draw(st.lists(tool_call(spec), min_size=1, max_size=spec.calls_per_turn))
            messages.append(draw(assistant(spec, calls)))
            for call in calls:
                result = {"role": "tool", "content": draw(text)}
                if spec.call_ids:
                    result["tool_call_id"] = call["id"]
                messages.append(result)
        messages.append(draw(assistant(spec)))
    return messages, tools
