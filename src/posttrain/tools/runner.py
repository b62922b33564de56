"""Runs the tool calls of one model turn, concurrently, and never fails.

::

    runner = ToolRunner(load_tools("configs/tools/retool.yaml"), max_workers=4, call_timeout_s=30)
    pending = runner.submit(parse_tool_calls(turn_text))   # returns at once
    ...                                                     # e.g. keep generating other samples
    results = pending.results()                             # one ToolResult per call, in call order
    runner.close()

Every problem becomes the text the model reads, ``[error: ...]``, with ``ok=False``: a call the
parser could not read, an unknown tool, arguments that do not fit the schema, a tool that raises,
a tool that does not answer in time.

Threads: each call runs in a daemon thread of its own, and at most ``max_workers`` calls run at
once (the others wait for a slot). A call that passes ``call_timeout_s``, or the tool's own bound
:attr:`~posttrain.tools.base.Tool.call_seconds` when that is longer (counted from when it got its
slot), is *abandoned*: Python cannot stop a thread, so it runs on in the background until the
tool returns (or the process exits; daemon threads do not hold exit up), but it frees its slot and
its result is the timeout message. A tool that can hang should therefore bound its own work (the
code interpreter kills its process at its own ``timeout_s``, below the runner's timeout).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from posttrain.errors import ConfigError
from posttrain.tools.base import Tool, ToolError
from posttrain.tools.hermes import ToolCall, shown


@dataclass(frozen=True)
class ToolResult:
    """The answer to one call: the ``text`` the model reads, how many ``seconds`` the call took (from
    when it started running), and whether it succeeded (``ok``; False for every ``[error: ...]``)."""

    text: str
    seconds: float
    ok: bool


class PendingCalls:
    """The calls of one :meth:`ToolRunner.submit`, running; :meth:`results` waits for them."""

    def __init__(self, n: int):
        self._results: list[ToolResult | None] = [None] * n
        self._left = n
        self._lock = threading.Lock()
        self._all_done = threading.Event()
        if n == 0:
            self._all_done.set()

    def _set(self, i: int, result: ToolResult) -> None:
        with self._lock:
            assert self._results[i] is None
            self._results[i] = result
            self._left -= 1
            if self._left == 0:
                self._all_done.set()

    def done(self) -> bool:
        """Whether every call has its result (so :meth:`results` will not block)."""
        return self._all_done.is_set()

    def results(self) -> list[ToolResult]:
        """One result per call, in call order; blocks until all are in. Never raises.

        It returns at the latest about ``call_timeout_s`` after the last call got a slot.
        """
        self._all_done.wait()
        return list(self._results)  # type: ignore[arg-type]  # all set once _all_done is set


class ToolRunner:
    """Runs tool calls against ``tools`` (by the name the model calls them), ``max_workers`` at a
    time, each for at most ``call_timeout_s`` seconds (see the module docstring on abandoned calls)."""

    def __init__(self, tools: dict[str, Tool], *, max_workers: int = 4, call_timeout_s: float = 60.0):
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
            raise ConfigError(f"ToolRunner: max_workers must be a whole number >= 1, not {max_workers!r}")
        if isinstance(call_timeout_s, bool) or not isinstance(call_timeout_s, (int, float)) or call_timeout_s <= 0:
            raise ConfigError(f"ToolRunner: call_timeout_s must be a positive number, not {call_timeout_s!r}")
        self.tools = dict(tools)
        self.max_workers, self.call_timeout_s = max_workers, float(call_timeout_s)
        self._slots = threading.Semaphore(max_workers)
        self._closed = False

    def submit(self, calls: list[ToolCall]) -> PendingCalls:
        """Starts every call and returns at once; calls that cannot run are answered immediately."""
        if self._closed:
            raise RuntimeError("ToolRunner.submit after close()")
        pending = PendingCalls(len(calls))
        for i, call in enumerate(calls):
            refusal = self._refusal(call)
            if refusal is not None:
                pending._set(i, ToolResult(text=_error(refusal), seconds=0.0, ok=False))
                continue
            threading.Thread(target=self._supervise, args=(pending, i, call), daemon=True,
                             name=f"tool-{call.name}-{i}").start()
        return pending

    def close(self) -> None:
        """Refuses further submits; returns at once (running calls finish, or are abandoned, on their own)."""
        self._closed = True

    def __enter__(self) -> "ToolRunner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _refusal(self, call: ToolCall) -> str | None:
        """Why ``call`` cannot run (the message without ``[error: ]``), or None."""
        if call.error is not None:
            return call.error
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return f"there is no tool {shown(call.name)}; the tools are: {known}"
        try:
            return tool.check_arguments(call.arguments)
        except Exception as e:  # a user's check_arguments may be buggy; the call still gets an answer
            return f"the tool {call.name} raised {type(e).__name__} while checking its arguments: {e}"

    def _supervise(self, pending: PendingCalls, i: int, call: ToolCall) -> None:
        """Runs in a daemon thread: waits for a slot, runs the call in another daemon thread and waits
        for it at most ``call_timeout_s``; always sets result ``i``."""
        start = time.monotonic()
        try:
            limit = max(self.call_timeout_s, self.tools[call.name].call_seconds or 0.0)
            with self._slots:
                start = time.monotonic()
                box: list[ToolResult] = []
                worker = threading.Thread(target=self._execute, args=(call, start, box), daemon=True,
                                          name=f"tool-{call.name}-{i}-run")
                worker.start()
                worker.join(limit)
                if box:
                    result = box[0]
                else:  # abandoned: the worker runs on, but no longer holds the slot
                    result = ToolResult(text=_error(f"the tool {call.name} did not answer within {limit:g} s"),
                                        seconds=time.monotonic() - start, ok=False)
        except BaseException as e:  # noqa: BLE001 - the caller is owed an answer whatever happens
            result = ToolResult(text=_error(f"the tool {call.name} could not run ({type(e).__name__}: {e})"),
                                seconds=time.monotonic() - start, ok=False)
        pending._set(i, result)

    def _execute(self, call: ToolCall, start: float, box: list[ToolResult]) -> None:
        try:
            out = self.tools[call.name].execute(call.arguments)
            if isinstance(out, str):
                result = ToolResult(text=_encodable(out), seconds=time.monotonic() - start, ok=True)
            else:
                result = ToolResult(text=_error(f"the tool {call.name} returned {type(out).__name__}, not text"),
                                    seconds=time.monotonic() - start, ok=False)
        except ToolError as e:
            result = ToolResult(text=_error(str(e)), seconds=time.monotonic() - start, ok=False)
        except BaseException as e:  # noqa: BLE001 - SystemExit from a tool must not go unanswered either
            result = ToolResult(text=_error(f"the tool {call.name} raised {type(e).__name__}: {e}"),
                                seconds=time.monotonic() - start, ok=False)
        box.append(result)


def _error(message: str) -> str:
    """The text the model reads for a failed call."""
    return _encodable(f"[error: {message}]")


def _encodable(text: str) -> str:
    """``text`` with lone surrogates (from a JSON ``"\\ud800"`` the model wrote, or a tool) replaced by
    ``?``: a tokenizer cannot encode them."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", errors="replace").decode("utf-8")
