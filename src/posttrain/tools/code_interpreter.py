"""The ``code_interpreter`` tool: runs the model's Python in the sandbox of
:mod:`posttrain.tools.sandbox` and returns what it printed.

The tool checks at start-up that this host can sandbox (:func:`~posttrain.tools.sandbox.detect_sandbox`)
and refuses with a :class:`ConfigError` saying what is missing otherwise; it never runs code
unsandboxed. Each call is a fresh process: nothing (variables, imports, files) carries over from
one call to the next.
"""

from __future__ import annotations

from typing import Any

from posttrain.tools.base import Tool, ToolError, register_tool
from posttrain.tools.sandbox import detect_sandbox, run_python

NO_OUTPUT = "(no output; use print() to show a value)"
"""What the model reads when its code ran fine but printed nothing."""


@register_tool("code_interpreter")
class CodeInterpreter(Tool):
    """Runs ``arguments["code"]`` (Python, standard library only) in the sandbox.

    Config: ``timeout_s`` (wall clock), ``cpu_s`` (CPU time, rounded up to whole seconds),
    ``memory_mb`` (address space per process), ``max_output_bytes`` (longer output is cut, with a
    note). A timeout, a crash or a limit shows up in the output as ``[error: ...]``.
    """

    def __init__(self, schema: dict, *, timeout_s: float = 5.0, cpu_s: float = 5.0, memory_mb: int = 512,
                 max_output_bytes: int = 16384):
        super().__init__(schema)
        for key, value in (("timeout_s", timeout_s), ("cpu_s", cpu_s), ("memory_mb", memory_mb),
                           ("max_output_bytes", max_output_bytes)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{key} must be a positive number, not {value!r}")
        if not isinstance(memory_mb, int) or not isinstance(max_output_bytes, int):
            raise ValueError("memory_mb and max_output_bytes must be whole numbers")
        self.timeout_s, self.cpu_s = float(timeout_s), float(cpu_s)
        self.memory_mb, self.max_output_bytes = memory_mb, max_output_bytes
        detect_sandbox()  # ConfigError (saying what the host lacks) when it cannot sandbox

    def execute(self, arguments: dict[str, Any]) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ToolError(f'{self.name} needs "code": the Python source to run, as a string')
        if not code.strip():
            raise ToolError("the code is empty; write the Python to run and print() what you need")
        result = run_python(code, timeout_s=self.timeout_s, cpu_s=self.cpu_s, memory_mb=self.memory_mb,
                            max_output_bytes=self.max_output_bytes)
        text = result.text
        return text if text.strip() else NO_OUTPUT
