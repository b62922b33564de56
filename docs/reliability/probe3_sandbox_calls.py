"""The tool-call and tools-file cases of docs/reliability/probe3_sandbox.md (SB40-SB62, probe 2's
H and T cases); run them through probe3_sandbox_cases.py, which adds them to its cases."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

from posttrain.tools.hermes import parse_tool_calls
from posttrain.tools.runner import ToolRunner

CASES = {}
CI = "code_interpreter"


def case(fn):
    CASES[fn.__name__.split("_")[0]] = fn
    return fn


def interpreter_tool():
    from posttrain.tools.config import load_tools
    return load_tools("configs/tools/retool.yaml")


def turn(text: str, tools=None) -> str:
    """Parse a model turn and run its calls through the runner, as the rollout does."""
    start = time.monotonic()
    calls = parse_tool_calls(text)
    parsed = time.monotonic() - start
    with ToolRunner(tools if tools is not None else interpreter_tool(), call_timeout_s=30) as runner:
        results = runner.submit(calls).results()
    texts = [r.text for r in results]
    summary = [t if len(t) < 300 else t[:150] + f"...({len(t)} chars)" for t in texts[:5]]
    return (f"{len(calls)} calls parsed in {parsed:.2f} s, answered in {time.monotonic() - start:.2f} s; "
            f"{sum(map(len, texts))} chars of answers; first: {json.dumps(summary)}")


# ---------------------------------------------------------------- tool calls the model writes
CALL = '<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(1)"}}</tool_call>'


@case
def SB40_nested_tool_call_tags():
    return turn('<tool_call><tool_call>{"name": "code_interpreter", "arguments": {"code": "print(1)"}}'
                '</tool_call></tool_call>')


@case
def SB41_unknown_tool_with_a_huge_name():
    return turn('<tool_call>{"name": "' + "py" * 500_000 + '", "arguments": {}}</tool_call>')


@case
def SB42_arguments_null_number_list():
    return turn("".join(f'<tool_call>{{"name": "code_interpreter", "arguments": {a}}}</tool_call>'
                        for a in ("null", "3.5", "[1]", '{"code": 5}', '{"code": ["print(1)"]}')))


@case
def SB43_duplicate_keys_in_the_arguments():
    return turn('<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(\'first\')", '
                '"code": "print(\'second\')"}}</tool_call>')


@case
def SB44_ten_thousand_calls_in_one_turn():
    return turn(CALL * 10_000, tools={})


@case
def SB45_surrogate_in_the_tool_name():
    from transformers import AutoTokenizer
    calls = parse_tool_calls('<tool_call>{"name": "\\ud800", "arguments": "nope"}</tool_call>')
    with ToolRunner({}, call_timeout_s=5) as runner:
        [result] = runner.submit(calls).results()
    tok = AutoTokenizer.from_pretrained("/tmp/sandbox/model")
    try:
        return f"{result.text!r} -> {len(tok.encode(result.text, add_special_tokens=False))} tokens"
    except Exception as e:  # noqa: BLE001 - the probe reports it
        return f"{result.text!r} -> the rollout's encode raises {type(e).__name__}: {e}"


@case
def SB46_non_json_python_dict():
    return turn("<tool_call>{'name': 'code_interpreter', 'arguments': {'code': 'print(1)'}}</tool_call>")


@case
def SB47_huge_code_argument():
    code = "x = 1\n" * 5_000_000
    return turn('<tool_call>{"name": "code_interpreter", "arguments": ' + json.dumps({"code": code}) + "}</tool_call>")


@case
def SB48_deep_nesting_inside_a_string_is_fine():
    return turn('<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(len(\'' + "[" * 5000 +
                '\'))"}}</tool_call>')


@case
def SB49_many_unclosed_then_one_good_call():
    return turn("<tool_call>" * 20_000 + CALL)


@case
def SB50_sandbox_timeout_above_the_runner_timeout():
    from posttrain.tools.code_interpreter import CodeInterpreter
    tool = CodeInterpreter(interpreter_tool()[CI].schema, timeout_s=8)
    start = time.monotonic()
    with ToolRunner({CI: tool}, call_timeout_s=2) as runner:
        [result] = runner.submit(parse_tool_calls(CALL.replace("print(1)", "import time; time.sleep(6); print(6)"))
                                 ).results()
    return f"{result.text!r} after {time.monotonic() - start:.1f} s"


# ---------------------------------------------------------------- the tools file
def tools_file(config: str) -> str:
    text = Path("configs/tools/retool.yaml").read_text()
    start = text.index("    config:")
    end = text.index("    tool_schema:")
    path = Path(tempfile.mkdtemp(prefix="probe-tools-")) / "tools.yaml"
    path.write_text(text[:start] + f"    config: {config}\n" + text[end:])
    return str(path)


def load(config: str) -> str:
    from posttrain.tools.config import load_tools
    path = tools_file(config)
    try:
        tools = load_tools(path)
    except Exception as e:  # noqa: BLE001 - the probe reports it
        return f"{type(e).__name__}: {e}"
    finally:
        shutil.rmtree(Path(path).parent)
    return "accepted; a call gives " + repr(tools[CI].execute({"code": "import time; time.sleep(1); print('ok')"})[:200])


@case
def SB60_memory_mb_float():
    return load("{memory_mb: 256.0}")


@case
def SB61_timeout_s_a_day():
    return load("{timeout_s: 86400}")


@case
def SB62_max_output_bytes_zero_and_bool():
    return load("{max_output_bytes: 0}") + "\n" + load("{memory_mb: true}")


for _name, _config in {"T1": "{timeout_s: .nan}", "T2": "{timeout_s: .inf}", "T3": "{cpu_s: .inf}",
                       "T4": "{memory_mb: 1}", "T6": "{max_output_bytes: 1000000000000}"}.items():
    CASES[_name] = (lambda c: lambda: load(c))(_config)


def parse(text: str) -> str:
    start = time.monotonic()
    try:
        calls = parse_tool_calls(text)
    except Exception as e:  # noqa: BLE001 - the probe reports it
        return f"raises {type(e).__name__}: {str(e)[:120]} after {time.monotonic() - start:.2f} s"
    errors = [c.error[:160] for c in calls if c.error][:2]
    return f"{len(calls)} calls in {time.monotonic() - start:.2f} s; errors: {errors}"


_ARGS = '<tool_call>{"name": "code_interpreter", "arguments": %s}</tool_call>'
for _name, _text in {"H4": _ARGS % ('{"code": ' + "[" * 1000 + "]" * 1000 + "}"),
                     "H5": _ARGS % ('{"n": ' + "7" * 5000 + "}"),
                     "H6b": _ARGS % json.dumps("[" * 100_000),
                     "H6c": _ARGS % json.dumps('{"n": ' + "7" * 5000 + "}"),
                     "H17": "<tool_call>" * 16_000}.items():
    CASES[_name] = (lambda t: lambda: parse(t))(_text)
