"""Tool-call parsers by name (``rl_config.tool_parser_format``).

A parser reads the calls of one model turn and names the text after which a sampling row pauses
for its tools (``end_tag``). :meth:`ToolParser.calls` never raises, whatever the turn holds. Register another format with ``TOOL_PARSERS.add(name, ToolParser(...))``.
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
        """The turn's calls; never raises: a parser that fails on what the model wrote gives one failed call."""
        if self.start_tag not in text:
            return []
        try:
            return self.parse(text)
        except Exception as e:  # noqa: BLE001 - whatever the model wrote, the rollout goes on
            return [ToolCall(error=f"the tool calls of this turn could not be read ({type(e).__name__}); "
                                   f"write each call as {self.start_tag}...{self.end_tag}")]


TOOL_PARSERS = Registry("tool parser", key="rl_config.tool_parser_format")
TOOL_PARSERS.add("hermes", ToolParser("hermes", hermes.OPEN, hermes.CLOSE, hermes.parse_tool_calls))
