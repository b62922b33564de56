"""The hermes tool-call parser (posttrain.tools.hermes): well-formed calls are read in order, and
every malformed one becomes an error message for the model instead of an exception."""

from __future__ import annotations

import pytest

from posttrain.tools.hermes import ToolCall, has_tool_call, parse_tool_calls


def test_calls_are_read_in_order_with_their_arguments():
    text = ('Let me compute.\n<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(6*7)"}}\n'
            '</tool_call>\nand search <tool_call>{"name": "search", "arguments": "{\\"query\\": \\"bm25\\"}"}'
            '</tool_call>')
    assert has_tool_call(text)
    assert parse_tool_calls(text) == [ToolCall("code_interpreter", {"code": "print(6*7)"}),
                                      ToolCall("search", {"query": "bm25"})]  # stringified arguments too
    assert parse_tool_calls("The answer is \\boxed{42}.") == [] and not has_tool_call("no call")


@pytest.mark.parametrize("text,error", [
    ('<tool_call>{"name": "code_interpreter", "arguments": {"code": </tool_call>', "not valid JSON"),
    ("<tool_call>[1, 2]</tool_call>", "is an array, not an object"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'has no "name"'),
    ('<tool_call>{"name": "search", "arguments": [1]}</tool_call>', 'the "arguments" of search must be a JSON object'),
    ('<tool_call>{"name": "search", "arguments": "not json"}</tool_call>', "a string that is not valid JSON"),
    ('<tool_call>{"name": "search", "arguments": {}}', "was not closed"),
], ids=["json", "not-object", "no-name", "arguments-list", "arguments-string", "unclosed"])
def test_a_malformed_call_is_an_error_message_not_an_exception(text, error):
    [call] = parse_tool_calls(text)
    assert call.error is not None and error in call.error


def test_a_good_call_next_to_a_broken_one_still_runs():
    calls = parse_tool_calls('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{oops}</tool_call>')
    assert [c.error is None for c in calls] == [True, False] and calls[0].name == "a"
