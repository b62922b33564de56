"""The code_interpreter tool (posttrain.tools.code_interpreter.CodeInterpreter): calls go through the
sandbox and come back as the text the model reads. Skipped where this host cannot sandbox (the
tool itself refuses there, which is tested too)."""

from __future__ import annotations

import time

import pytest

from posttrain.errors import ConfigError
from posttrain.tools import code_interpreter
from posttrain.tools.base import TOOLS, ToolError
from posttrain.tools.code_interpreter import NO_OUTPUT, CodeInterpreter
from posttrain.tools.hermes import ToolCall
from posttrain.tools.runner import ToolRunner
from posttrain.tools.sandbox import detect_sandbox

SCHEMA = {"type": "function", "function": {
    "name": "code_interpreter", "description": "A tool for executing code.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "The code to execute."}},
                   "required": ["code"]}}}


@pytest.fixture(scope="module")
def tool() -> CodeInterpreter:
    try:
        detect_sandbox()
    except ConfigError as e:
        pytest.skip(f"this host cannot sandbox: {e}")
    return CodeInterpreter(SCHEMA, timeout_s=1.0, cpu_s=1.0, memory_mb=256)


def test_it_prints(tool):
    assert tool.execute({"code": "print(123*456)"}) == "56088\n"


def test_no_output_gets_a_note(tool):
    assert tool.execute({"code": "x = 1 + 1"}) == NO_OUTPUT


def test_an_exception_shows_its_traceback_and_status(tool):
    out = tool.execute({"code": "print('before')\n1/0"})
    assert out.startswith("before\n") and "ZeroDivisionError: division by zero" in out
    assert out.rstrip().endswith("[error: exited with status 1]")


def test_an_endless_loop_is_stopped(tool):
    start = time.monotonic()
    out = tool.execute({"code": "while True: pass"})
    assert time.monotonic() - start < 5
    assert "[error:" in out and ("timed out" in out or "CPU-time limit" in out), out


def test_empty_code_is_a_tool_error(tool):
    with pytest.raises(ToolError, match="the code is empty"):
        tool.execute({"code": "  \n"})


def test_calls_through_the_runner(tool):
    with ToolRunner({"code_interpreter": tool}, call_timeout_s=10) as runner:
        results = runner.submit([ToolCall("code_interpreter", {"code": "print(sum(range(10)))"}),
                                 ToolCall("code_interpreter", {"code": "import math; print(math.factorial(5))"})]
                                ).results()
    assert [(r.text, r.ok) for r in results] == [("45\n", True), ("120\n", True)]


def test_it_is_registered():
    assert TOOLS.get("code_interpreter") is CodeInterpreter


def test_a_host_that_cannot_sandbox_refuses_at_start(monkeypatch):
    def refuse():
        raise ConfigError("The code interpreter must be started as root")

    monkeypatch.setattr(code_interpreter, "detect_sandbox", refuse)
    with pytest.raises(ConfigError, match="must be started as root"):
        CodeInterpreter(SCHEMA)


@pytest.mark.parametrize("kwargs", [{"timeout_s": 0}, {"memory_mb": -1}, {"cpu_s": "5"}, {"memory_mb": 1.5}])
def test_bad_config_values(kwargs):
    with pytest.raises(ValueError):
        CodeInterpreter(SCHEMA, **kwargs)
