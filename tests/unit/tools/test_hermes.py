"""The hermes tool-call parser (posttrain.tools.hermes): well-formed calls are read in order, and
every malformed one becomes an error message for the model instead of an exception."""

from __future__ import annotations

import json
import time

import pytest

from posttrain.tools import hermes
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


_ARGS = '<tool_call>{"name": "code_interpreter", "arguments": %s}</tool_call>'


@pytest.mark.parametrize("text,error", [
    (_ARGS % ('{"code": ' + "[" * 1000 + "]" * 1000 + "}"), "the tool call is JSON nested too deeply"),
    (_ARGS % ('{"n": ' + "7" * 5000 + "}"), "the tool call is JSON with an integer too long to read"),
    (_ARGS % json.dumps("[" * 100_000), 'are a string that is JSON nested too deeply'),
    (_ARGS % json.dumps('{"n": ' + "7" * 5000 + "}"), "are a string that is JSON with an integer too long"),
], ids=["H4-nesting", "H5-long-integer", "H6b-nesting-in-a-string", "H6c-long-integer-in-a-string"])
def test_json_python_cannot_read_is_an_error_message(text, error):
    """Probes H4, H5, H6b, H6c: RecursionError / ValueError escaped the parser (and the rollout)."""
    [call] = parse_tool_calls(text)
    assert call.error is not None and error in call.error


def test_unclosed_tags_are_read_in_linear_time():
    """Probe H17: N unclosed <tool_call> tags took O(N^2) (57 s for 16,000)."""
    start = time.monotonic()
    calls = parse_tool_calls("<tool_call>" * 200_000)
    assert time.monotonic() - start < 2.0  # quadratic: hours
    assert [c.error.split(";")[0] for c in calls] == ["a <tool_call> was not closed with </tool_call>"]


@pytest.mark.parametrize("text", [
    '<tool_call><tool_call>{"name": "a", "arguments": {}}</tool_call></tool_call>',
    "<tool_call>" * 20_000 + '{"name": "a", "arguments": {}}</tool_call>',
], ids=["SB40-nested", "SB49-unclosed-then-good"])
def test_a_tag_opened_again_is_an_error_and_the_call_inside_still_runs(text):
    """Probes SB40 and SB49: the whole span from the first tag was one call, "not valid JSON", and
    the well-formed call at its end was lost."""
    assert [c.error.split(";")[0] if c.error else c.name for c in parse_tool_calls(text)] == [
        "a <tool_call> was opened again before it was closed with </tool_call>", "a"]


def test_duplicate_keys_are_an_error_not_the_last_one_silently():
    """Probe SB43: {"code": "print('first')", "code": "print('second')"} ran the second."""
    [call] = parse_tool_calls(_ARGS % '{"code": "print(1)", "code": "print(2)"}')
    assert call.error.startswith("the tool call is JSON with the key 'code' twice in one object")


@pytest.mark.parametrize("arguments,kind", [("null", "null"), ("3.5", "a number"), ("true", "a boolean")])
def test_arguments_of_the_wrong_kind_are_named_in_jsons_words(arguments, kind):
    """Probe SB42: the message said "not NoneType" / "not float" (Python's names) to the model."""
    [call] = parse_tool_calls(_ARGS % arguments)
    assert call.error == f'the "arguments" of code_interpreter must be a JSON object, not {kind}'


def test_ten_thousand_calls_in_one_turn_are_capped():
    """Probe SB44: 10,000 calls were parsed and each answered with its own error line."""
    calls, most = parse_tool_calls(_ARGS % '{"code": "print(1)"}' * 10_000), hermes.MAX_CALLS
    assert len(calls) == most + 1 and all(c.error is None for c in calls[:most])
    assert calls[-1].error.startswith(f"this turn holds {10_000 - most} more tool calls after the first "
                                      f"{most}; they were not read")


def test_code_that_mentions_the_opening_tag_in_a_string_still_runs():
    """A guard for SB40's fix: a tag inside a JSON string is not a tag opened again."""
    [call] = parse_tool_calls(_ARGS % json.dumps({"code": "print('<tool_call>')"}))
    assert call == ToolCall("code_interpreter", {"code": "print('<tool_call>')"})
