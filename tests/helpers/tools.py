"""A tool for the multi-turn tests that needs no sandbox (named by its dotted path in a tools file)."""

from __future__ import annotations

from posttrain.tools.base import Tool

# a hermes tool call of :class:`Answer`, the shortest the parser takes
CALL = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
TOOLS_YAML = """tools:
  - class_name: tests.helpers.tools.Answer
    tool_schema:
      type: function
      function: {name: f, description: answers ok, parameters: {type: object, properties: {}, required: []}}
"""


class Answer(Tool):
    """Answers ``ok`` to every call."""

    def execute(self, arguments: dict) -> str:
        return "ok"
