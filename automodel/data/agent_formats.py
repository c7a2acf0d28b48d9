"""Public agent-data shapes -> OpenAI-style messages, which :func:`automodel.data.chat.parse_messages`
then checks like any ``messages`` row.

========= ==================================================== ==========================================
format    a row                                                becomes
========= ==================================================== ==========================================
sharegpt  ``conversations``: ``[{from, value}]``; ``from`` is    ``human`` -> user, ``gpt`` -> assistant,
          system, human, gpt, observation or function_call     ``observation`` -> tool, ``function_call``
          (its value the call as JSON, or a list of calls)     -> an assistant message with tool calls
hermes    ``conversations``: ShareGPT turns (or role/content   each ``<tool_call>{...}</tool_call>`` of an
          messages) whose replies write calls inline as        assistant turn a tool call (JSON, or a
          ``<tool_call>`` text, tool turns wrapping outputs in Python dict literal as Hermes data writes
          ``<tool_response>``                                  it); each ``<tool_response>`` a tool message
xlam      ``query``, ``answers`` (``[{name, arguments}]``),    a user message and an assistant message
          ``tools`` (``[{name, description, parameters}]``),   calling the answers; parameters written as
          each a list or its JSON text                         ``{arg: {type, description}}`` as JSON Schema
========= ==================================================== ==========================================

None of these shapes carries call ids: calls and results are numbered (:func:`number_tool_calls`),
the same ids for the same row, so templates that write ids (Mistral's) render every row.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from automodel.data.chat import MISSING, BadRow, number_tool_calls

SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "observation": "tool",
    "tool": "tool",
    "function_call": "assistant",  # its value: the call as JSON, {"name": ..., "arguments": ...}, or a list
}
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_TOOL_RESPONSE = re.compile(r"<tool_response>\s*(.*?)\s*</tool_response>", re.DOTALL)
# xLAM's parameter types (Python's names) -> JSON Schema's
_XLAM_TYPES = {
    "str": "string",
    "string": "string",
    "int": "integer",
    "integer": "integer",
    "float": "number",
    "number": "number",
    "bool": "boolean",
    "boolean": "boolean",
    "list": "array",
    "array": "array",
    "dict": "object",
    "object": "object",
}


def sharegpt_messages(turns: Any, field: str = "conversations") -> list[dict]:
    """ShareGPT turns as messages, calls and results numbered. Other keys of a turn (``weight``,
    ``train``) stay on its message.

    Example::

        sharegpt_messages([{"from": "human", "value": "2+3?"},
                           {"from": "function_call", "value": '{"name": "add", "arguments": {"a": 2, "b": 3}}'},
                           {"from": "observation", "value": "5"}, {"from": "gpt", "value": "5"}])
        # [{"role": "user", ...}, {"role": "assistant", "tool_calls": [{"type": "function", "id": "call00000",
        #   "function": {"name": "add", ...}}]}, {"role": "tool", "content": "5", "tool_call_id": "call00000"}, ...]
    """
    return number_tool_calls(
        [_sharegpt_message(turn, k, field) for k, turn in enumerate(_turns(turns, field))]
    )


def hermes_messages(turns: Any, field: str = "conversations") -> list[dict]:
    """Hermes-style turns as messages: ShareGPT turns, or messages with ``role`` and ``content``; an
    assistant turn's ``<tool_call>`` blocks become its tool calls (the text around them its content),
    a tool turn's ``<tool_response>`` blocks one tool message each; calls and results numbered.

    Example: ``{"from": "gpt", "value": "<tool_call>\\n{'name': 'add', 'arguments': {'a': 2}}\\n</tool_call>"}``
    -> ``{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "add",
    "arguments": {"a": 2}}, "id": "call00000"}]}``."""
    messages = []
    for k, turn in enumerate(_turns(turns, field)):
        message = dict(turn) if "role" in turn else _sharegpt_message(turn, k, field)
        content = message.get("content")
        if message.get("role") == "assistant" and isinstance(content, str) and _TOOL_CALL.search(content):
            calls = [_literal_call(body, k, field) for body in _TOOL_CALL.findall(content)]
            message["content"] = _TOOL_CALL.sub("", content).strip() or None
            message["tool_calls"] = [*(message.get("tool_calls") or []), *calls]
        if message.get("role") == "tool" and isinstance(content, str) and _TOOL_RESPONSE.search(content):
            messages += [{**message, "content": output} for output in _TOOL_RESPONSE.findall(content)]
            continue
        messages.append(message)
    return number_tool_calls(messages)


def xlam_messages(query: Any, answers: Any) -> list[dict]:
    """An xLAM row's ``query`` and ``answers`` as a user message and an assistant message making the
    calls (numbered)."""
    if query is None:
        raise BadRow("query", MISSING)
    if not isinstance(query, str) or not query.strip():
        raise BadRow("query", f"must be the user's request as text, got {query!r:.60}")
    calls = _json_list(answers, "answers", "the calls that answer the query, [{name, arguments}]")
    if not calls:
        raise BadRow("answers", "is an empty list: the row has no call to learn")
    for j, call in enumerate(calls):
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise BadRow(
                "answers", f"call {j} must be an object with 'name' and 'arguments', got {call!r:.60}"
            )
    assistant = {
        "role": "assistant",
        "tool_calls": [{"type": "function", "function": call} for call in calls],
    }
    return number_tool_calls([{"role": "user", "content": query}, assistant])


def xlam_tools(tools: Any) -> list[dict] | None:
    """An xLAM row's ``tools`` as chat templates read them: ``{"type": "function", "function": ...}``,
    each parameter list ``{arg: {type, description, default?}}`` as a JSON Schema object (types named
    the Python way, ``str``, ``List[int]``, ``str, optional``, as JSON Schema's; an argument is required
    unless ``optional`` or given a default). A schema already written so is kept."""
    if tools is None:
        return None
    schemas = []
    for tool in _json_list(tools, "tools", "tool schemas, [{name, description, parameters}]"):
        if not isinstance(tool, dict):
            raise BadRow(
                "tools", f"each tool must be an object {{name, description, parameters}}, got {tool!r:.60}"
            )
        if "function" in tool:
            schemas.append(tool)
            continue
        parameters = tool.get("parameters")
        if isinstance(parameters, dict) and "properties" not in parameters:
            tool = {**tool, "parameters": _json_schema(parameters)}
        schemas.append({"type": "function", "function": tool})
    return schemas


def _json_schema(parameters: dict) -> dict:
    """xLAM's ``{arg: {type, description, default?}}`` as ``{type: object, properties, required}``."""
    properties, required = {}, []
    for name, spec in parameters.items():
        spec = dict(spec) if isinstance(spec, dict) else {"description": str(spec)}
        written = str(spec.get("type", "")).strip()
        optional = "optional" in written.lower()
        base = written.split(",")[0].split("[")[0].strip().lower()
        if written:
            spec["type"] = _XLAM_TYPES.get(base, written)
        if not optional and "default" not in spec:
            required.append(name)
        properties[name] = spec
    return {"type": "object", "properties": properties, "required": required}


def _turns(turns: Any, field: str) -> list[dict]:
    if turns is None:
        raise BadRow(field, MISSING)
    if not isinstance(turns, list) or not turns or not all(isinstance(t, dict) for t in turns):
        raise BadRow(field, f"must be a non-empty list of {{'from', 'value'}} turns, got {turns!r:.60}")
    return turns


def _sharegpt_message(turn: dict, k: int, field: str) -> dict:
    source = turn.get("from")
    if source not in SHAREGPT_ROLES:
        raise BadRow(field, f"turn {k}: 'from' {source!r} is not one of {tuple(SHAREGPT_ROLES)}")
    message = {key: value for key, value in turn.items() if key not in ("from", "value")}
    message["role"], message["content"] = SHAREGPT_ROLES[source], turn.get("value")
    if source == "function_call":
        message.pop("content")
        message["tool_calls"] = [
            {"type": "function", "function": call} for call in _json_calls(turn.get("value"), k, field)
        ]
    return message


def _json_calls(value: Any, k: int, field: str) -> list[dict]:
    """A ``function_call`` turn's value: one call as JSON, or a list of them (parallel calls)."""
    try:
        calls = json.loads(value) if isinstance(value, str) else None
    except json.JSONDecodeError:
        calls = None
    calls = [calls] if isinstance(calls, dict) else calls
    if not isinstance(calls, list) or not calls or not all(isinstance(call, dict) for call in calls):
        raise BadRow(field, f"turn {k}: a function_call turn's value must be a JSON object "
                     f'{{"name": ..., "arguments": ...}} (or a list of them), got {value!r:.60}')  # fmt: skip
    return calls


def _literal_call(body: str, k: int, field: str) -> dict:
    """One ``<tool_call>`` block: JSON, or the Python dict literal Hermes data often writes
    (``{'name': 'add', 'arguments': {'a': 2}}``; read by ``ast.literal_eval``, which runs no code)."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        try:
            call = ast.literal_eval(body)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            call = None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise BadRow(field, f"turn {k}: a <tool_call> block must hold {{\"name\": ..., \"arguments\": ...}} as JSON (or a "
                     f"Python dict), got {body!r:.60}")  # fmt: skip
    return {"type": "function", "function": call}


def _json_list(value: Any, field: str, what: str) -> list:
    """A list, or its JSON text (xLAM writes its columns as JSON text)."""
    if value is None:
        raise BadRow(field, MISSING)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise BadRow(field, f"is text but not JSON ({error.msg} at character {error.pos})") from None
    if not isinstance(value, list):
        raise BadRow(field, f"must be a list of {what} (or its JSON text), got {value!r:.60}")
    return value
