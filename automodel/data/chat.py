"""Chat rows -> token ids and a loss mask read from the model's own chat template.

A conversation (``messages`` with every role and field chat templates read: ``tool_calls``,
``reasoning_content``/``thinking``, ``name``, ``tool_call_id``, and the row's ``tools``) is rendered
once with the tokenizer's chat template and tokenized whole, so its ids are exactly
``apply_chat_template``'s. The assistant's tokens come from the template itself:

- a template with ``{% generation %}`` blocks marks them (transformers' ``return_assistant_tokens_mask``):
  exactly the blocks' tokens;
- otherwise assistant turn i starts where the conversation rendered up to it with a generation prompt
  ends (its header; found after that prompt's pieces where the template writes a block of it elsewhere,
  :func:`turn_start`), and ends with its end-of-turn token: the last special token before message
  i + 1's rendering starts, so the separator the template writes after it is not learned. Where the
  template renders the turn differently once the conversation goes on (Qwen3 drops a ``<think>`` block,
  harmony ends it with ``<|end|>`` in place of ``<|return|>``), it ends at the first token that ends a
  turn in the template (:func:`end_of_turn_token_ids`).

Worked example (a Qwen3-shaped template, one exchange; the message carries no reasoning)::

    up to the turn, with a generation prompt  "<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n"
    the whole conversation                    "...<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\nHello<|im_end|>\\n"
    the assistant's span                                                  "<think>\\n\\n</think>\\n\\nHello<|im_end|>"
    learned (no reasoning trace: the answer)                                                   "Hello<|im_end|>"

Which spans are learned (:class:`ChatPolicy`): every assistant turn or the last one, unless the message
says otherwise (``train: true/false``, or ``weight: 0/1`` as Axolotl data writes it). A turn with a
reasoning trace learns its whole span with ``reasoning="learn"``, else only its answer: from where the
template writes the message's content (or its tool calls) to the end of the turn. A turn without a
trace learns its answer, so markup written where reasoning would go (Qwen3's empty ``<think></think>``,
a harmony channel header) is context, as a non-thinking prompt gives it. Tool outputs are never learned.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import render_jinja_template

# Roles every chat template renders; any other role (tool, ipython, function, developer...) is used
# where the tokenizer's template renders it.
CORE_ROLES = ("system", "user", "assistant")
ASSISTANT_TURNS = ("all", "last")
REASONING = ("learn", "mask")
# The names reasoning traces go by (transformers copies each to the others for the template).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
TRAIN_FLAGS = ("train", "weight")
# Keys whose nested objects are free-form (tool arguments, JSON schemas): Arrow gives every row the
# union of the keys other rows have, filled with null, so nulls inside them are dropped.
_FREE_FORM = ("tool_calls",)
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# A private-use character: no template writes or strips it, so where it lands says where a field goes.
_PROBE = "\ue000"
MISSING = "has no value in this row (a missing key, null, or an empty CSV cell)"

# What a token is, for ``automodel data``; one value per token when asked for (``token_kinds``).
CONTEXT, LEARNED, TOOL_CALL, TOOL_OUTPUT, REASONING_MASKED, REASONING_LEARNED = range(6)


class BadRow(ValueError):
    """A row whose ``field`` cannot be used; ``tokenize_sft_dataset`` adds the file and row."""

    def __init__(self, field: str, reason: str):
        super().__init__(reason)
        self.field, self.reason = field, reason


@dataclass(frozen=True)
class ChatPolicy:
    """Which assistant turns carry loss (``data.assistant_turns``) and whether reasoning traces are
    learned (``data.reasoning``); a message's own ``train``/``weight`` flag decides for that turn."""

    assistant_turns: str = "all"
    reasoning: str = "learn"

    def __post_init__(self) -> None:
        if self.assistant_turns not in ASSISTANT_TURNS:
            raise ValueError(
                f"data.assistant_turns must be one of {ASSISTANT_TURNS}, got {self.assistant_turns!r}"
            )
        if self.reasoning not in REASONING:
            raise ValueError(f"data.reasoning must be one of {REASONING}, got {self.reasoning!r}")


@dataclass(frozen=True)
class Chat:
    """One parsed conversation: ``messages`` as the template reads them (nulls and training flags
    removed), each message's own flag (True/False, None where it has none), the row's ``tools``."""

    messages: list[dict]
    flags: list[bool | None]
    tools: list[dict] | None = None


# -- parsing: a row's messages -> Chat, or BadRow --------------------------------------------------------


def parse_messages(messages: Any, field: str = "messages", tools: Any = None) -> Chat:
    """Check one conversation and return it as the template will read it: nulls and training flags
    removed, tool-call arguments given as JSON text parsed to objects (the template decides how to
    print an object: one that applies ``tojson`` to text would quote it), an empty ``tool_calls``
    list removed, a reasoning trace under one name (``reasoning_content``; transformers passes it
    under the others too).

    Bad rows (:class:`BadRow`, naming the message): arguments that are not a JSON object (or null),
    an assistant turn with nothing in it, a tool result no call asked for (no assistant
    ``tool_calls`` before it, or none left to answer, or a ``tool_call_id`` that answers none of
    them), a call to a tool the row's ``tools`` do not offer, reasoning on a turn other than the
    assistant's, two reasoning fields that disagree.

    Example::

        parse_messages([{"role": "user", "content": "Weather in Paris?"},
                        {"role": "assistant", "content": None, "train": False,
                         "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
                        {"role": "tool", "content": "18 C", "tool_call_id": "call_1"},
                        {"role": "assistant", "content": "18 C in Paris."}])
        # Chat(messages=[..., {"role": "assistant", "tool_calls": [{..., "arguments": {"city": "Paris"}}]}, ...],
        #      flags=[None, False, None, None])
    """
    if messages is None:
        raise BadRow(field, MISSING)
    if not isinstance(messages, list) or not messages:
        raise BadRow(
            field, f"must be a non-empty list of {{'role', 'content'}} messages, got {messages!r:.60}"
        )
    schemas = parse_tools(tools)
    offered = None if schemas is None else {_function(tool).get("name") for tool in schemas}
    out, flags, pending = [], [], []  # pending: the calls since the last user message no result answered yet
    for k, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRow(field, f"message {k} must be a dict with 'role' and 'content', got {message!r:.60}")
        # keys other rows have (read as None) do not reach the template
        message = {key: _without_nulls(value) if key in _FREE_FORM else value
                   for key, value in message.items() if value is not None}  # fmt: skip
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise BadRow(field, f"message {k}: 'role' must be text such as 'user', got {role!r:.40}")
        if content is not None and not isinstance(content, str):
            raise BadRow(field, f"message {k} ({role}): 'content' must be text, got {type(content).__name__} "
                         f"{content!r:.40} (write a tool's JSON output as a string)")  # fmt: skip
        for key in ("name", "tool_call_id", *REASONING_FIELDS):
            if key in message and not isinstance(message[key], str):
                raise BadRow(field, f"message {k} ({role}): {key!r} must be text, got {message[key]!r:.40}")
        flag = _training_flag(message, k, field)
        _one_reasoning_field(message, role, k, field)
        if role in ("system", "user"):  # a result answers a call of this exchange
            pending = []
        if "tool_calls" in message:
            calls = _tool_calls(message.pop("tool_calls"), role, k, field, offered)
            if calls:
                message["tool_calls"] = calls
                pending += calls
            elif not (content or has_reasoning(message)):
                raise BadRow(field, f"message {k}: 'tool_calls' is an empty list and the assistant message has no "
                             "content: the turn says nothing; drop the message or give it content")  # fmt: skip
        if role == "assistant" and not (content or message.get("tool_calls") or has_reasoning(message)):
            raise BadRow(
                field, f"message {k}: an assistant message is empty (no content, tool_calls or reasoning)"
            )
        if role != "assistant" and content is None:
            raise BadRow(field, f"message {k} ({role}) has no 'content' (missing or null)")
        if flag and role != "assistant":
            raise BadRow(field, f"message {k} ({role}) is marked to train, but only assistant turns are learned (tool "
                         "outputs and prompts never are); drop its train/weight key")  # fmt: skip
        if role == "tool":
            _answer(pending, message, k, field)
        out.append(message)
        flags.append(flag)
    if out[0]["role"] == "assistant":
        raise BadRow(
            field, "the conversation starts with an assistant message; it needs a system or user prompt"
        )
    return Chat(out, flags, schemas)


def parse_tools(tools: Any) -> list[dict] | None:
    """A row's ``tools``: a list of JSON schemas, or that list as JSON text (a column of strings)."""
    if tools is None:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as error:
            raise BadRow("tools", f"is text but not JSON ({error.msg} at character {error.pos})") from None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise BadRow("tools", f"must be a list of tool schemas ({{'type': 'function', 'function': ...}}), got "
                     f"{tools!r:.60}")  # fmt: skip
    return [_without_nulls(tool) for tool in tools] or None


def has_reasoning(message: dict) -> bool:
    return any(message.get(key) for key in REASONING_FIELDS)


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _training_flag(message: dict, k: int, field: str) -> bool | None:
    """``train: true/false`` or ``weight: 0/1`` (removed from the message); None when neither is set."""
    found = {}
    if "train" in message:
        value = message.pop("train")
        if not isinstance(value, bool):
            raise BadRow(field, f"message {k}: 'train' must be true or false, got {value!r:.20}")
        found["train"] = value
    if "weight" in message:
        value = message.pop("weight")
        if isinstance(value, bool) or value not in (0, 1):
            raise BadRow(field, f"message {k}: 'weight' must be 0 or 1, got {value!r:.20}")
        found["weight"] = bool(value)
    if len(set(found.values())) > 1:
        raise BadRow(field, f"message {k}: 'train' and 'weight' disagree ({found}); keep one of them")
    return next(iter(found.values()), None)


def _function(entry: dict) -> dict:
    """The function of a tool call or a tool schema, written ``{"function": {...}}`` or flat."""
    function = entry.get("function", entry)
    return function if isinstance(function, dict) else {}


def _tool_calls(calls: Any, role: str, k: int, field: str, offered: set | None) -> list[dict]:
    """Message k's tool calls, each with its arguments as an object (parsed where given as JSON text)."""
    if role != "assistant":
        raise BadRow(field, f"message {k} ({role}) has tool_calls; only an assistant message calls tools")
    if not isinstance(calls, list) or not all(isinstance(call, dict) for call in calls):
        raise BadRow(field, f"message {k}: 'tool_calls' must be a list of {{'function': {{'name', 'arguments'}}}}, "
                     f"got {calls!r:.60}")  # fmt: skip
    parsed = []
    for j, call in enumerate(calls):
        function = call.get("function", call)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise BadRow(field, f"message {k}: a tool call needs function.name (text), got {call!r:.60}")
        where = f"message {k}: tool call {j} ({function['name']!r})"
        if offered is not None and function["name"] not in offered:
            raise BadRow(field, f"{where} calls a tool the row's tools do not offer "
                         f"({', '.join(sorted(map(str, offered)))}); add its schema to tools or fix the name")  # fmt: skip
        function = {**function, "arguments": _arguments(function.get("arguments"), where, field)}
        parsed.append({**call, "function": function} if "function" in call else {**call, **function})
    return parsed


def _arguments(value: Any, where: str, field: str) -> dict:
    """A call's arguments as an object: JSON text parsed, so that every template prints one object."""
    if value is None:
        raise BadRow(
            field, f"{where}: 'arguments' is null or missing; write {{}} for a call without arguments"
        )
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise BadRow(field, f"{where}: 'arguments' is text but not JSON ({error.msg} at character {error.pos} of "
                         f"{value!r:.60}); write the arguments as a JSON object") from None  # fmt: skip
    if not isinstance(value, dict):
        raise BadRow(field, f"{where}: 'arguments' must be a JSON object (or its text), got {value!r:.60}")
    return value


def _answer(pending: list[dict], message: dict, k: int, field: str) -> None:
    """Tool result k answers one of the ``pending`` calls (its ``tool_call_id``'s, else the first)."""
    if not pending:
        raise BadRow(field, f"message {k} (tool): a tool result that no call asked for (no assistant tool_calls "
                     "since the last user message are left to answer); drop it, or give the assistant message "
                     "before it the call it answers")  # fmt: skip
    ids = [call.get("id") for call in pending]
    call_id = message.get("tool_call_id")
    if call_id is not None and any(i is not None for i in ids):
        if call_id not in ids:
            raise BadRow(field, f"message {k} (tool): tool_call_id {call_id!r} answers none of the calls before it "
                         f"(ids {', '.join(map(repr, ids))})")  # fmt: skip
        pending.pop(ids.index(call_id))
    else:
        pending.pop(0)


def _one_reasoning_field(message: dict, role: str, k: int, field: str) -> None:
    """The message's reasoning trace under ``reasoning_content`` alone (the other names removed); a
    trace on a message other than the assistant's, or two names holding different traces: BadRow."""
    traces = {key: message.pop(key) for key in REASONING_FIELDS if key in message}
    given = {key: trace for key, trace in traces.items() if trace}  # ' ' is a trace a template writes: kept
    if not given:
        return
    if role != "assistant":
        raise BadRow(field, f"message {k} ({role}) carries a reasoning trace ({', '.join(map(repr, given))}), which "
                     "only an assistant turn has (the template would drop it); move it to the assistant message or "
                     "drop it")  # fmt: skip
    if len({trace.strip() for trace in given.values()}) > 1:
        raise BadRow(field, f"message {k}: {' and '.join(map(repr, given))} hold different reasoning traces (a "
                     "template reads one of them); keep one")  # fmt: skip
    message["reasoning_content"] = next(iter(given.values()))


def number_tool_calls(messages: list[dict]) -> list[dict]:
    """Call ids for a conversation written without them (ShareGPT's ``function_call`` turns, xLAM,
    Hermes): each assistant tool call without an ``id`` gets ``call00000``, ``call00001``...
    (numbered in the row; 9 characters, as Mistral's templates want), and each tool result without a
    ``tool_call_id`` the id of the first call since the last user message no result answered yet.
    The same row always gets the same ids; the messages are copied, not changed.

    Example: ``[user, assistant(calls f, g), tool, tool]`` -> calls ``call00000``, ``call00001``;
    the results answer them in order."""
    out, pending, n = [], [], 0
    for message in messages:
        message = dict(message) if isinstance(message, dict) else message
        role = message.get("role") if isinstance(message, dict) else None
        calls = message.get("tool_calls") if role == "assistant" else None
        if role in ("system", "user"):
            pending = []
        elif isinstance(calls, list):
            numbered = []
            for call in calls:
                if isinstance(call, dict) and call.get("id") is None:
                    call = {**call, "id": f"call{n:05d}"}
                numbered.append(call)
                n += 1
            message["tool_calls"] = numbered
            pending += [call["id"] for call in numbered if isinstance(call, dict)]
        elif role == "tool":
            if message.get("tool_call_id") is None and pending:
                message["tool_call_id"] = pending[0]
            if message.get("tool_call_id") in pending:
                pending.remove(message["tool_call_id"])
        out.append(message)
    return out


# -- the template -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TemplateFacts:
    """What tokenizing chats with one tokenizer needs, read once: whether its template has
    ``{% generation %}`` blocks, its special token ids, the ids that end an assistant turn."""

    marked: bool
    special_ids: frozenset[int]
    turn_ends: frozenset[int]


def template_facts(tokenizer: PreTrainedTokenizerBase) -> TemplateFacts:
    special = special_token_ids(tokenizer)
    return TemplateFacts(
        bool(GENERATION_TAG.search(tokenizer.get_chat_template())),
        special,
        frozenset(end_of_turn_token_ids(tokenizer, special)),
    )


def special_token_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """bos, eos, pad... and every added token marked special (``<|im_end|>``; not Qwen's ``<tool_call>``)."""
    added = (i for i, token in tokenizer.added_tokens_decoder.items() if token.special)
    return frozenset(tokenizer.all_special_ids) | frozenset(added)


class _Template:
    """The tokenizer's chat template (the ``tool_use`` one where the row has tools), rendering a row's
    conversation and its prefixes with the variables ``apply_chat_template`` passes."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, tools: list[dict] | None):
        self.source = tokenizer.get_chat_template(None, tools)
        self.tools = tools
        self.variables = dict(tokenizer.special_tokens_map)

    def render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        (text,), _ = render_jinja_template(
            [messages], tools=self.tools, chat_template=self.source,
            add_generation_prompt=generation_prompt, **self.variables,
        )  # fmt: skip
        return text

    def render_blocks(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The text and its ``{% generation %}`` blocks as character spans."""
        (text,), (blocks,) = render_jinja_template(
            [messages], tools=self.tools, chat_template=self.source,
            return_assistant_tokens_mask=True, **self.variables,
        )  # fmt: skip
        return text, [(start, end) for start, end in blocks if end > start]


def end_of_turn_token_ids(
    tokenizer: PreTrainedTokenizerBase, special: frozenset[int] | None = None
) -> list[int]:
    """The special tokens the chat template closes an assistant reply with: the first special token
    after the reply when it is the last message, and when the conversation goes on (harmony writes
    ``<|return|>``, then ``<|end|>``). Empty without a template or when the probes do not render.

    Example (Llama 3): ``...<|start_header_id|>assistant<|end_header_id|>\\n\\nHello<|eot_id|>`` -> [<|eot_id|>]."""
    if getattr(tokenizer, "chat_template", None) is None:
        return []
    special = special_token_ids(tokenizer) if special is None else special
    template, found = _Template(tokenizer, None), []
    user, reply = {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}
    for messages in ([user, reply], [user, reply, {"role": "user", "content": "Thanks"}]):
        try:
            text = template.render(messages)
            start = turn_start(template.render(messages[:1], generation_prompt=True), text)
        except Exception:  # noqa: BLE001 - a template that refuses the probe (it wants a system prompt...)
            continue
        end = -1 if start is None else text.find("Hello", start)
        if end < 0:
            continue
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        for token, (offset, _) in zip(encoded["input_ids"], encoded["offset_mapping"], strict=True):
            if offset >= end + len("Hello") and token in special:
                if token not in found:
                    found.append(token)
                break
    return found


def end_of_turn_token_id(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The special token the chat template closes a final assistant reply with, or None.

    ``generate`` stops at ``generation_config.eos_token_id``; when this token differs from the
    model's eos (Llama 3 ``<|eot_id|>``, Qwen ``<|im_end|>``) the export should list both."""
    found = end_of_turn_token_ids(tokenizer)
    return found[0] if found else None


def turn_start(prompt: str, text: str, header: str = "", after: int = 0) -> int | None:
    """Where, in the whole conversation ``text``, the assistant turn after ``prompt`` (the messages
    before it rendered with a generation prompt, which adds ``header``) starts; None when it cannot
    be found.

    Most templates render the prompt as the start of ``text``. Some write blocks into it that the
    whole conversation has elsewhere (Mistral puts ``[AVAILABLE_TOOLS]`` and the system prompt with
    the last user message): after the point where the two part, the rest of the prompt is read as
    pieces of ``text``, in order, with those blocks between them, each piece the longest that comes
    next in ``text``; the turn starts where the last piece ends. Others write less in the prompt than
    in the conversation (Hermes closes a tool turn with ``\\n<|im_end|>`` when a turn follows it, with
    ``<|im_end|>`` when it is last): where the pieces do not end with the turn's ``header``, the turn
    starts after the first ``header`` past the point where the two part. Where neither finds it (Mistral
    writes the tools before every user message equal to the last one, so they stand in ``text`` where
    the prompt has none), the turn starts after the first occurrence past ``after`` (the end of the
    turn before) of the longest end of the prompt that ``text`` holds there, longer than ``header``.

    Example: prompt ``"A[T][I] s Q[/I]"``, text ``"A[I] Q[/I] x</s>[T][I] s R[/I] y</s>"``: pieces
    ``"[I] "`` and ``"Q[/I]"`` -> 10 (after ``Q[/I]``). Prompt ``"r</t>E<s>a\\n"``, text
    ``"r</t>\\nE<s>a\\nx"``, header ``"<s>a\\n"``: the one piece ``"\\n"`` ends at 6, not after a header
    -> 12 (after the header).
    """
    if text.startswith(prompt):
        return len(prompt)
    at = len(os.path.commonprefix([prompt, text]))
    start = _pieces_end(prompt, text, at)
    if header and (start is None or not text.startswith(header, start - len(header))):
        found = text.find(header, max(0, at - len(header) + 1))
        start = None if found < 0 else found + len(header)
    return start if start is not None else _suffix_end(prompt, text, after, len(header) + 1)


def _suffix_end(prompt: str, text: str, after: int, shortest: int) -> int | None:
    """Where the first occurrence in ``text[after:]`` of the longest end of ``prompt`` found there (at
    least ``shortest`` characters) ends; None when not even that one occurs."""
    low, high, found = shortest, len(prompt), None  # an end that occurs makes its every end occur
    while low <= high:
        middle = (low + high) // 2
        where = text.find(prompt[-middle:], after)
        if where >= 0:
            low, found = middle + 1, where + middle
        else:
            high = middle - 1
    return found


def _pieces_end(prompt: str, text: str, at: int) -> int | None:
    """:func:`turn_start`'s reading of ``prompt[at:]`` as pieces of ``text`` from ``at`` on."""
    rest, read = prompt[at:], 0
    while read < len(rest):
        low, high, found = 1, len(text) - at, None  # a piece that occurs makes its every prefix occur
        while low <= high:
            middle = (low + high) // 2
            where = rest.find(text[at : at + middle], read)
            if where >= 0:
                low, found = middle + 1, (middle, where)
            else:
                high = middle - 1
        if found is None:
            return None
        length, where = found
        at, read = at + length, where + length
    return at


# -- encoding: one conversation -> ids, mask (and token kinds) ---------------------------------------------


@dataclass(frozen=True)
class RenderedChat:
    """A conversation rendered by its template (``blocks``: the ``{% generation %}`` spans, if any),
    waiting for its tokens (``tokenize_sft_dataset`` tokenizes a batch of them at once)."""

    chat: Chat
    template: _Template
    text: str
    blocks: list[tuple[int, int]]


def render_chat(
    chat: Chat, tokenizer: PreTrainedTokenizerBase, facts: TemplateFacts, field: str
) -> RenderedChat:
    """Check the roles against the template and render the conversation; BadRow naming ``field`` when
    the template fails on the row."""
    template = _Template(tokenizer, chat.tools)
    _check_roles(chat, template, field)
    try:
        text, blocks = (
            template.render_blocks(chat.messages) if facts.marked else (template.render(chat.messages), [])
        )
    except Exception as error:  # noqa: BLE001 - the template's own code on this row's data
        raise BadRow(field, f"the chat template fails on this conversation ({_reason(error)})") from None
    return RenderedChat(chat, template, text, blocks)


def mask_chat(
    rendered: RenderedChat,
    ids: list[int],
    offsets: list[tuple[int, int]],
    policy: ChatPolicy,
    facts: TemplateFacts,
    field: str,
    token_kinds: bool = False,
) -> tuple[list[int], list[int] | None, list[str]]:
    """``(mask, kinds, unrendered)`` of a rendered conversation whose tokens are ``ids`` (their
    character ``offsets``): ``mask`` is 1 on the tokens to learn (module docstring), ``kinds`` (when
    asked for) says what each token is (:data:`LEARNED`, :data:`TOOL_OUTPUT`...), ``unrendered`` the
    reasoning traces the template does not write (:func:`unrendered_reasoning`). BadRow naming
    ``field`` when the assistant turns cannot be located."""
    chat, template, text = rendered.chat, rendered.template, rendered.text
    offsets_N2 = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    if facts.marked:
        turns = _marked_turns(chat, template, text, rendered.blocks, field)
    else:
        specials = [
            (int(s), int(e), t) for t, (s, e) in zip(ids, offsets_N2, strict=True) if t in facts.special_ids
        ]
        turns = _located_turns(chat, template, text, specials, facts.turn_ends, field)
    learned, reasoning = _learned_regions(chat, template, text, turns, policy, token_kinds)
    mask = _covered(offsets_N2, learned)
    kinds = _kinds(chat, template, text, offsets_N2, mask, turns, reasoning) if token_kinds else None
    return mask.astype(np.int8).tolist(), kinds, unrendered_reasoning(chat, text, turns)


def unrendered_reasoning(chat: Chat, text: str, turns: dict[int, list[tuple[int, int]]]) -> list[str]:
    """The reasoning traces of assistant turns that ``text`` (the rendered conversation) does not hold
    between the end of the assistant turn before and the end of the turn: templates without
    reasoning drop every trace, Qwen3's the traces of turns before the last user query."""
    missing, after = [], 0
    for i in sorted(turns):
        end = turns[i][-1][1] if turns[i] else after
        trace = chat.messages[i].get("reasoning_content", "").strip()
        if trace and trace not in text[after:end]:
            missing.append(trace)
        after = max(after, end)
    return missing


def encode_chat(
    chat: Chat,
    tokenizer: PreTrainedTokenizerBase,
    policy: ChatPolicy,
    facts: TemplateFacts,
    field: str,
    token_kinds: bool = False,
) -> tuple[list[int], list[int], list[int] | None]:
    """``(ids, mask, kinds)`` of one conversation: :func:`render_chat`, tokenize, :func:`mask_chat`."""
    rendered = render_chat(chat, tokenizer, facts, field)
    encoded = tokenizer(rendered.text, add_special_tokens=False, return_offsets_mapping=True)
    mask, kinds, _ = mask_chat(
        rendered, encoded["input_ids"], encoded["offset_mapping"], policy, facts, field, token_kinds
    )
    return encoded["input_ids"], mask, kinds


def _reason(error: Exception) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"


# Roles a template was seen to render (per template), so each is probed once per process.
_RENDERED_ROLES: dict[str, set[str]] = {}


def _check_roles(chat: Chat, template: _Template, field: str) -> None:
    """BadRow for a message whose role the template fails on or drops (its content never shows)."""
    for k, message in enumerate(chat.messages):
        role = message["role"]
        if role in CORE_ROLES or role in _RENDERED_ROLES.get(template.source, ()):
            continue
        try:
            text = template.render([*chat.messages[:k], {**message, "content": _PROBE}])
        except Exception as error:  # noqa: BLE001 - the template's own code (raise_exception...)
            raise BadRow(field, f"message {k}: role {role!r}: the chat template fails on it ({_reason(error)}); use "
                         "a role it renders") from None  # fmt: skip
        if _PROBE not in text:
            raise BadRow(field, f"message {k}: role {role!r} is not rendered by the chat template (the message would "
                         "be dropped); use a role it renders, such as system, user, assistant or tool")  # fmt: skip
        _RENDERED_ROLES.setdefault(template.source, set()).add(role)


def _located_turns(
    chat: Chat,
    template: _Template,
    text: str,
    specials: list[tuple[int, int, int]],
    turn_ends: frozenset[int],
    field: str,
) -> dict[int, list[tuple[int, int]]]:
    """Assistant message index -> its character span in ``text``, for a template without markers."""
    messages, n = chat.messages, len(chat.messages)
    boundaries: dict[int, int | None] = {n: len(text)}  # j -> where message j starts, when the template says

    def boundary(j: int) -> int | None:
        if j not in boundaries:
            try:
                before = template.render(messages[:j])
            except Exception:  # noqa: BLE001 - a template that refuses an unfinished conversation
                before = None
            boundaries[j] = len(before) if before is not None and text.startswith(before) else None
        return boundaries[j]

    turns, previous_end = {}, 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        try:
            prompt = template.render(messages[:i], generation_prompt=True)
        except Exception as error:  # noqa: BLE001 - the template's own code
            raise BadRow(field, f"message {i}: the chat template fails on the conversation before this assistant "
                         f"turn ({_reason(error)})") from None  # fmt: skip
        start = turn_start(
            prompt,
            text,
            "" if text.startswith(prompt) else _header(template, messages[:i], prompt),
            previous_end,
        )
        if start is None:
            raise BadRow(field, f"message {i}: the chat template renders the conversation before this assistant turn "
                         "differently from the whole conversation, so the turn cannot be located; add "
                         "{% generation %}...{% endgeneration %} around assistant output in the template")  # fmt: skip
        after = next(j for j in range(i + 1, n + 1) if boundary(j) is not None)
        inside = [(s, e, token) for s, e, token in specials if start <= s and e <= boundaries[after]]
        if after == i + 1:  # the turn alone: it ends with its last special token
            end = inside[-1][1] if inside else boundaries[after]
        else:  # the template renders it otherwise once the conversation goes on: its first end-of-turn token
            end = next((e for _, e, token in inside if token in turn_ends), None)
        content = message.get("content", "").strip()
        if end is None or (content and "tool_calls" not in message and content not in text[start:end]):
            raise BadRow(field, f"message {i}: the end of this assistant turn cannot be found in the rendered "
                         "conversation; add {% generation %}...{% endgeneration %} around assistant output in the "
                         "template")  # fmt: skip
        turns[i], previous_end = [(start, end)], end
    return turns


def _header(template: _Template, messages: list[dict], prompt: str) -> str:
    """What the generation prompt adds to ``messages`` (``<|im_start|>assistant\\n``): the end of
    ``prompt``; empty where the template adds none or renders the two otherwise."""
    try:
        before = template.render(messages)
    except Exception:  # noqa: BLE001 - a template that refuses a conversation without a reply
        return ""
    return prompt[len(before) :] if prompt.startswith(before) else ""


def _marked_turns(
    chat: Chat, template: _Template, text: str, blocks: list[tuple[int, int]], field: str
) -> dict[int, list[tuple[int, int]]]:
    """Assistant message index -> its ``{% generation %}`` blocks: in order when there is one block per
    assistant message, else each block to the assistant turn it follows."""
    assistant = [i for i, message in enumerate(chat.messages) if message["role"] == "assistant"]
    if len(blocks) == len(assistant):
        return {i: [block] for i, block in zip(assistant, blocks, strict=True)}
    starts = {
        i: turn_start(template.render(chat.messages[:i], generation_prompt=True), text) for i in assistant
    }
    turns: dict[int, list[tuple[int, int]]] = {i: [] for i in assistant}
    for start, end in blocks:
        owner = max((i for i in assistant if starts[i] is not None and starts[i] <= start), default=None)
        if owner is None:
            raise BadRow(field, f"the chat template's {len(blocks)} generation blocks cannot be matched with the "
                         f"{len(assistant)} assistant messages of this conversation")  # fmt: skip
        turns[owner].append((start, end))
    return turns


def _learned_regions(
    chat: Chat,
    template: _Template,
    text: str,
    turns: dict[int, list[tuple[int, int]]],
    policy: ChatPolicy,
    with_reasoning: bool,
) -> tuple[list[tuple[int, int]], dict[int, tuple[int, int]]]:
    """The character spans to learn, and (``with_reasoning``) each learned turn's reasoning span."""
    last = max(turns, default=None)
    learned, reasoning = [], {}
    for i, spans in turns.items():
        flag = chat.flags[i]
        if not (flag if flag is not None else policy.assistant_turns == "all" or i == last):
            continue
        whole = has_reasoning(chat.messages[i]) and policy.reasoning == "learn"
        if whole and not with_reasoning:
            learned += spans
            continue
        answer = _answer_start(chat.messages, template, text, i, spans[0][0], spans[-1][1])
        if has_reasoning(chat.messages[i]):
            reasoning[i] = (spans[0][0], answer)
        learned += spans if whole else [(max(start, answer), end) for start, end in spans if end > answer]
    return learned, reasoning


def _answer_start(messages: list[dict], template: _Template, text: str, i: int, start: int, end: int) -> int:
    """Where assistant turn i's answer (its content, else its tool calls) starts in ``text``: where a
    probe put in front of its content lands. ``start`` when the turn opens with it."""
    content = messages[i].get("content", "")
    if content and not content[0].isspace() and text.startswith(content, start):
        return start  # the turn opens with its content as given (whitespace may be the template's own)
    probed = [*messages[:i], {**messages[i], "content": _PROBE + content}, *messages[i + 1 :]]
    try:
        other = template.render(probed)
    except Exception:  # noqa: BLE001 - a template that refuses content beside tool calls: nothing to mask
        return start
    point = len(os.path.commonprefix([text, other]))
    return point if other != text and start <= point < end else start


def _covered(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """True for each token whose characters overlap one of ``spans`` (offsets ``[N, 2]``)."""
    covered = np.zeros(len(offsets), dtype=bool)
    for start, end in spans:
        covered |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
    return covered


def _kinds(
    chat: Chat,
    template: _Template,
    text: str,
    offsets: np.ndarray,
    mask: np.ndarray,
    turns: dict[int, list[tuple[int, int]]],
    reasoning: dict[int, tuple[int, int]],
) -> list[int]:
    """Each token's kind: context, learned, a learned tool call, a tool output, reasoning (learned or not)."""
    kinds = np.where(mask, LEARNED, CONTEXT)
    for i in turns:
        if "tool_calls" in chat.messages[i]:
            without = {key: value for key, value in chat.messages[i].items() if key != "tool_calls"}
            calls = _changed(template, text, chat.messages, i, without)
            if calls is not None:
                kinds[_covered(offsets, [calls]) & mask] = TOOL_CALL
    for start, end in reasoning.values():
        span = _covered(offsets, [(start, end)])
        kinds[span] = np.where(mask[span], REASONING_LEARNED, REASONING_MASKED)
    for k, message in enumerate(chat.messages):
        if message["role"] not in CORE_ROLES:
            around = {**message, "content": _PROBE + message.get("content", "") + _PROBE}
            output = _changed(template, text, chat.messages, k, around)
            if output is not None:
                kinds[_covered(offsets, [output])] = TOOL_OUTPUT
    return kinds.tolist()


def _changed(
    template: _Template, text: str, messages: list[dict], k: int, replacement: dict
) -> tuple[int, int] | None:
    """The span of ``text`` that differs when message k is ``replacement`` (None if none or unrenderable)."""
    try:
        other = template.render([*messages[:k], replacement, *messages[k + 1 :]])
    except Exception:  # noqa: BLE001 - for display only: the span is left unmarked
        return None
    start = len(os.path.commonprefix([text, other]))
    tail = len(os.path.commonprefix([text[start:][::-1], other[start:][::-1]]))
    return (start, len(text) - tail) if len(text) - tail > start else None
