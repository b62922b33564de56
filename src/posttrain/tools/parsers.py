"""Tool-call parsers by name (``rl_config.tool_parser_format``).

A parser reads the calls of one model turn and names the text after which a sampling row pauses
for its tools (``end_tag``). Register another format with ``TOOL_PARSERS.add(name, ToolParser(...))``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from posttrain.registry import Registry
from posttrain.tools import hermes
from posttrain.tools.hermes import ToolCall


@dataclass(frozen=True)
class ToolParser:
    """``parse(text)`` gives the turn's calls (malformed ones as calls with ``error`` set);
    ``start_tag`` marks a turn that may hold a call; ``end_tag`` is where a row pauses."""

    name: str
    start_tag: str
    end_tag: str
    parse: Callable[[str], list[ToolCall]]

    def calls(self, text: str) -> list[ToolCall]:
        return self.parse(text) if self.start_tag in text else []


TOOL_PARSERS = Registry("tool parser", key="rl_config.tool_parser_format")
TOOL_PARSERS.add("hermes", ToolParser("hermes", hermes.OPEN, hermes.CLOSE, hermes.parse_tool_calls))
