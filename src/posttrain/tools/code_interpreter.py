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
from posttrain.tools.sandbox import check_limits, detect_sandbox, run_python

NO_OUTPUT = "(no output; use print() to show a value)"
"""What the model reads when its code ran fine but printed nothing."""


@register_tool("code_interpreter")
class CodeInterpreter(Tool):
    """Runs ``arguments["code"]`` (Python, standard library only) in the sandbox.

    Config (ranges: :data:`posttrain.tools.sandbox.RANGES`): ``timeout_s`` (wall clock),
    ``cpu_s`` (CPU time per process, rounded up to whole seconds), ``memory_mb`` (per call where the
    host has cgroups, and address space per process), ``max_output_bytes`` (longer output is cut,
    with a note). A value out of range is a :class:`~posttrain.tools.base.ToolConfigError`. A
    timeout, a crash or a limit shows up in the output as ``[error: ...]``.
    """

    SETUP_SECONDS = 10.0
    """What a call may take beyond ``timeout_s`` (start-up, killing, removing its cgroup)."""

    def __init__(self, schema: dict, *, timeout_s: float = 5.0, cpu_s: float = 5.0, memory_mb: int = 512,
                 max_output_bytes: int = 16384):
        super().__init__(schema)
        check_limits(timeout_s=timeout_s, cpu_s=cpu_s, memory_mb=memory_mb, max_output_bytes=max_output_bytes)
        self.timeout_s, self.cpu_s = float(timeout_s), float(cpu_s)
        self.memory_mb, self.max_output_bytes = memory_mb, max_output_bytes
        detect_sandbox()  # ConfigError (saying what the host lacks) when it cannot sandbox

    @property
    def call_seconds(self) -> float:
        """The wall clock plus :attr:`SETUP_SECONDS`: the runner does not abandon a call before."""
        return self.timeout_s + self.SETUP_SECONDS

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
