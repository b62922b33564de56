"""The tool runner (posttrain.tools.runner): calls run concurrently, results come back in call order,
and every failure (parser error, unknown tool, bad arguments, a raising or hanging tool) is an
``[error: ...]`` text with ok=False, never an exception."""

from __future__ import annotations

import threading
import time

import pytest

from posttrain.errors import ConfigError
from posttrain.tools.base import Tool, ToolError
from posttrain.tools.hermes import ToolCall, parse_tool_calls
from posttrain.tools.runner import ToolResult, ToolRunner


def _schema(name: str, **properties: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": name, "parameters": {
        "type": "object", "properties": {k: {"type": t} for k, t in properties.items()},
        "required": list(properties)}}}


class Sleep(Tool):
    """Sleeps ``seconds``, then answers ``text``."""

    def execute(self, arguments: dict) -> str:
        time.sleep(arguments["seconds"])
        return arguments["text"]


class Boom(Tool):
    def execute(self, arguments: dict) -> str:
        if arguments["how"] == "tool-error":
            raise ToolError("the value is out of range")
        if arguments["how"] == "exit":
            raise SystemExit(3)
        raise ZeroDivisionError("division by zero")


class Hang(Tool):
    """Blocks until ``release`` is set (the test sets it at the end, so the thread ends)."""

    release = threading.Event()

    def execute(self, arguments: dict) -> str:
        self.release.wait(30)
        return "late"


class ReturnsInt(Tool):
    def execute(self, arguments: dict) -> str:
        return 42  # type: ignore[return-value]


@pytest.fixture
def runner():
    tools = {"sleep": Sleep(_schema("sleep", seconds="number", text="string")),
             "boom": Boom(_schema("boom", how="string")),
             "hang": Hang(_schema("hang")),
             "int": ReturnsInt(_schema("int"))}
    r = ToolRunner(tools, max_workers=4, call_timeout_s=5.0)
    yield r
    Hang.release.set()
    r.close()


def test_results_come_in_call_order_when_calls_finish_out_of_order(runner):
    calls = [ToolCall("sleep", {"seconds": 0.5, "text": "slow"}),
             ToolCall("sleep", {"seconds": 0.0, "text": "fast"}),
             ToolCall("sleep", {"seconds": 0.25, "text": "middle"})]
    start = time.monotonic()
    pending = runner.submit(calls)
    assert time.monotonic() - start < 0.2 and not pending.done()  # submit returns at once
    results = pending.results()
    elapsed = time.monotonic() - start
    assert pending.done()
    assert [r.text for r in results] == ["slow", "fast", "middle"]
    assert all(r.ok for r in results)
    assert results[0].seconds >= 0.5 and results[1].seconds < 0.2 and results[2].seconds >= 0.25
    assert elapsed < 0.7  # concurrent: about the slowest call, not the sum (0.75)


def test_max_workers_bounds_concurrency():
    tools = {"sleep": Sleep(_schema("sleep", seconds="number", text="string"))}
    with ToolRunner(tools, max_workers=1, call_timeout_s=5.0) as one:
        start = time.monotonic()
        results = one.submit([ToolCall("sleep", {"seconds": 0.15, "text": str(i)}) for i in range(3)]).results()
        assert time.monotonic() - start >= 0.45  # one at a time
        assert [r.text for r in results] == ["0", "1", "2"]
        assert all(r.seconds < 0.3 for r in results)  # counted from the start of each call, not of the wait


def test_a_raising_tool_is_reported(runner):
    results = runner.submit([ToolCall("boom", {"how": "crash"}), ToolCall("boom", {"how": "tool-error"}),
                             ToolCall("boom", {"how": "exit"}), ToolCall("int", {})]).results()
    assert results[0] == ToolResult("[error: the tool boom raised ZeroDivisionError: division by zero]",
                                    results[0].seconds, False)
    assert results[1].text == "[error: the value is out of range]" and not results[1].ok
    assert results[2].text == "[error: the tool boom raised SystemExit: 3]" and not results[2].ok
    assert results[3].text == "[error: the tool int returned int, not text]" and not results[3].ok


def test_a_hanging_tool_times_out_and_frees_its_slot():
    tools = {"hang": Hang(_schema("hang")), "sleep": Sleep(_schema("sleep", seconds="number", text="string"))}
    Hang.release.clear()
    runner = ToolRunner(tools, max_workers=1, call_timeout_s=0.2)
    try:
        start = time.monotonic()
        results = runner.submit([ToolCall("hang", {}), ToolCall("sleep", {"seconds": 0, "text": "after"})]).results()
        assert time.monotonic() - start < 1.0
        assert results[0].text == "[error: the tool hang did not answer within 0.2 s]" and not results[0].ok
        assert 0.2 <= results[0].seconds < 0.5
        assert results[1] == ToolResult("after", results[1].seconds, True)  # the slot was freed
    finally:
        Hang.release.set()
        runner.close()


def test_unknown_tool_lists_the_known_ones(runner):
    [result] = runner.submit([ToolCall("python", {"code": "1"})]).results()
    assert result == ToolResult("[error: there is no tool 'python'; the tools are: boom, hang, int, sleep]", 0.0, False)


def test_bad_arguments_are_not_run(runner):
    results = runner.submit([ToolCall("sleep", {"text": "x"}),
                             ToolCall("sleep", {"seconds": "1", "text": "x"}),
                             ToolCall("boom", {"how": "crash", "extra": 1})]).results()
    assert results[0].text.startswith("[error: sleep needs the argument 'seconds'; its arguments are: ")
    assert results[1].text == "[error: the argument 'seconds' of sleep must be a number, not a string]"
    assert results[2].text.startswith("[error: boom has no argument 'extra'")
    assert not any(r.ok for r in results)


def test_parser_errors_pass_through_next_to_good_calls(runner):
    text = ('<tool_call>{"name": "sleep", "arguments": {"seconds": 0, "text": "ok"}}</tool_call>'
            "<tool_call>{broken</tool_call>")
    calls = parse_tool_calls(text)
    results = runner.submit(calls).results()
    assert results[0] == ToolResult("ok", results[0].seconds, True)
    assert results[1] == ToolResult(f"[error: {calls[1].error}]", 0.0, False)
    assert "not valid JSON" in results[1].text


def test_no_calls_and_closed_runner(runner):
    pending = runner.submit([])
    assert pending.done() and pending.results() == []
    runner.close()
    with pytest.raises(RuntimeError, match="after close"):
        runner.submit([])


@pytest.mark.parametrize("kwargs", [{"max_workers": 0}, {"call_timeout_s": 0}, {"max_workers": True}])
def test_bad_runner_settings(kwargs):
    with pytest.raises(ConfigError):
        ToolRunner({}, **kwargs)


def test_an_unknown_tool_name_a_megabyte_long_is_cut_in_the_answer():
    """Probe SB41: the error repeated the whole 1 MB name to the model."""
    [result] = ToolRunner({}).submit([ToolCall(name="py" * 500_000)]).results()
    assert result.text == ("[error: there is no tool '" + "py" * 30 + "' (cut; 1,000,000 characters); the tools "
                           "are: none]")


def test_answers_are_always_text_a_tokenizer_can_encode():
    """Probe SB45: a lone surrogate the model wrote as JSON ("\\ud800") reached the tool output, and
    the rollout's tokenizer raised on it."""
    calls = parse_tool_calls('<tool_call>{"name": "\\ud800", "arguments": "x"}</tool_call>')
    calls.append(ToolCall("echo", {"text": "a\udc80b", "seconds": 0}))  # a tool answering with one
    with ToolRunner({"echo": Sleep(_schema("echo", text="string", seconds="number"))}) as runner:
        results = runner.submit(calls).results()
    for result in results:
        result.text.encode("utf-8")  # raises UnicodeEncodeError on a lone surrogate
    assert results[1].text == "a?b"


class Bounded(Sleep):
    """A tool that keeps to its own bound, longer than the runner's call_timeout_s."""

    call_seconds = 5.0


def test_a_tool_is_not_abandoned_while_it_keeps_to_its_own_bound():
    """Probe SB50: the runner abandoned a code_interpreter call at its own 60 s while the sandbox
    (timeout_s above that) ran on, outside max_workers, and the model read "did not answer"."""
    with ToolRunner({"slow": Bounded(_schema("slow", seconds="number", text="string"))}, call_timeout_s=0.2) as runner:
        [result] = runner.submit([ToolCall("slow", {"seconds": 0.6, "text": "done"})]).results()
    assert (result.text, result.ok) == ("done", True)
