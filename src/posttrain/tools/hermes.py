"""The ``hermes`` tool-call format (``tool_parser_format: hermes``), as Qwen2.5's chat template and
the seed's ``qwen_retool`` template write it: each call is one JSON object between tags::

    <tool_call>
    {"name": "code_interpreter", "arguments": {"code": "print(2 ** 10)"}}
    </tool_call>

:func:`parse_tool_calls` reads the calls of one model turn. A malformed call never raises: it
becomes an error message for the model (the tool's answer to that call), so a run survives
whatever the model writes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's ``name`` and its ``arguments``; ``error`` (then name and arguments may be
    empty) is the message the model gets instead of a tool's output."""

    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def has_tool_call(text: str) -> bool:
    """Whether a turn asks for a tool (it holds an opening tag)."""
    return OPEN in text


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The calls in ``text``, in order; an unclosed ``<tool_call>`` is one more, failed, call."""
    calls = [_parse_one(body) for body in _CALL.findall(text)]
    rest = _CALL.sub("", text)
    if OPEN in rest:
        calls.append(ToolCall(error=f"a {OPEN} was not closed with {CLOSE}; write each call as "
                                    f'{OPEN}{{"name": ..., "arguments": {{...}}}}{CLOSE}'))
    return calls


def _parse_one(body: str) -> ToolCall:
    try:
        call = json.loads(body.strip())
    except json.JSONDecodeError as err:
        return ToolCall(error=f"the tool call is not valid JSON ({err.msg} at line {err.lineno} column {err.colno}); "
                              f'write {{"name": ..., "arguments": {{...}}}}')
    if not isinstance(call, dict):
        return ToolCall(error=f"the tool call is a JSON {type(call).__name__}, not an object with \"name\" and "
                              f"\"arguments\"")
    name, arguments = call.get("name"), call.get("arguments", {})
    if not isinstance(name, str) or not name:
        return ToolCall(error='the tool call has no "name" (a string naming the tool)')
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return ToolCall(name=name, error=f'the "arguments" of {name} are a string that is not a JSON object')
    if not isinstance(arguments, dict):
        return ToolCall(name=name, error=f'the "arguments" of {name} must be a JSON object, not '
                                         f"{type(arguments).__name__}")
    return ToolCall(name=name, arguments=arguments)
