"""The ``hermes`` tool-call format (``tool_parser_format: hermes``), as Qwen2.5's chat template and
the seed's ``qwen_retool`` template write it: each call is one JSON object between tags::

    <tool_call>
    {"name": "code_interpreter", "arguments": {"code": "print(2 ** 10)"}}
    </tool_call>

:func:`parse_tool_calls` reads the calls of one model turn. A malformed call never raises: it
becomes an error message for the model (the tool's answer to that call), so a run survives
whatever the model writes. Reading is linear in the turn's length and reads at most
:data:`MAX_CALLS` calls; JSON nested too deeply, integers too long for Python, and duplicate keys
are errors too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_CALLS = 64
"""The most calls read from one turn; the rest get one error message."""
_FORMAT = f'write each call as {OPEN}{{"name": ..., "arguments": {{...}}}}{CLOSE}'


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
    """The calls in ``text``, in order. A ``<tool_call>`` opened again before it was closed, or never
    closed, is one more, failed, call; a ``</tool_call>`` without an opening tag is ignored."""
    calls: list[ToolCall] = []
    pos = 0
    while True:
        start = text.find(OPEN, pos)
        if start < 0:
            return calls
        if len(calls) >= MAX_CALLS:
            more = text.count(OPEN, start)
            calls.append(ToolCall(error=f"this turn holds {more} more tool call{'s' if more > 1 else ''} after the "
                                        f"first {MAX_CALLS}; they were not read (at most {MAX_CALLS} per turn)"))
            return calls
        body = start + len(OPEN)
        end = text.find(CLOSE, body)
        if end < 0:
            calls.append(ToolCall(error=f"a {OPEN} was not closed with {CLOSE}; {_FORMAT}"))
            return calls
        call = _parse_one(text[body:end])
        reopened = text.rfind(OPEN, body, end) if call.error else -1  # (a string may hold the tag)
        if reopened >= 0:  # the call starts at the last opening tag; the ones before it were never closed
            calls.append(ToolCall(error=f"a {OPEN} was opened again before it was closed with {CLOSE}; {_FORMAT}"))
            call = _parse_one(text[reopened + len(OPEN):end])
        calls.append(call)
        pos = end + len(CLOSE)


class _DuplicateKey(ValueError):
    pass


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _DuplicateKey(key)
        obj[key] = value
    return obj


def _loads(text: str) -> tuple[Any, str | None]:
    """``(value, None)``, or ``(None, what the text is instead)`` for text that is not usable JSON."""
    try:
        return json.loads(text, object_pairs_hook=_object), None
    except _DuplicateKey as e:
        return None, f"JSON with the key {shown(e.args[0])} twice in one object (write each key once)"
    except json.JSONDecodeError as e:
        return None, f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
    except RecursionError:
        return None, "JSON nested too deeply (arrays or objects inside each other)"
    except ValueError:  # Python refuses to convert integers of more than 4300 digits
        return None, "JSON with an integer too long to read (more than 4300 digits)"


def _parse_one(body: str) -> ToolCall:
    call, problem = _loads(body.strip())
    if problem is not None:
        return ToolCall(error=f'the tool call is {problem}; write {{"name": ..., "arguments": {{...}}}}')
    if not isinstance(call, dict):
        return ToolCall(error=f'the tool call is {json_kind(call)}, not an object with "name" and "arguments"')
    name, arguments = call.get("name"), call.get("arguments", {})
    if not isinstance(name, str) or not name:
        return ToolCall(error='the tool call has no "name" (a string naming the tool)')
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments, problem = _loads(arguments) if arguments.strip() else ({}, None)
        if problem is not None:
            return ToolCall(name=name, error=f'the "arguments" of {shown(name, quote=False)} are a string that is '
                                             f"{problem}; give them as a JSON object")
    if not isinstance(arguments, dict):
        return ToolCall(name=name, error=f'the "arguments" of {shown(name, quote=False)} must be a JSON object, not '
                                         f"{json_kind(arguments)}")
    return ToolCall(name=name, arguments=arguments)


def json_kind(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words (``null``, ``a number``, ``an array``, ...)."""
    if value is None:
        return "null"
    for kind, types in (("a boolean", bool), ("a number", (int, float)), ("a string", str), ("an array", list),
                        ("an object", dict)):
        if isinstance(value, types):
            return kind
    return type(value).__name__


def shown(name: str, limit: int = 60, quote: bool = True) -> str:
    """A name the model wrote, for a message: cut to ``limit`` characters, quoted (or bare when
    ``quote`` is false and it is plain printable text), control characters and surrogates escaped."""
    cut = name[:limit]
    text = cut if not quote and cut.isprintable() else repr(cut)
    return text + (f" (cut; {len(name):,} characters)" if len(name) > limit else "")
