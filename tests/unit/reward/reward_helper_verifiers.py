"""Verifiers used by the reward tests (imported by name, ``tests.unit.reward.reward_helper_verifiers``, in
worker processes; not a test file)."""

import os
import time
from pathlib import Path

from posttrain.reward.verifiers import register_verifier


@register_verifier("t_sleep")
def sleepy(response: str, label: str, **kw) -> float:
    """Sleeps ``float(response)`` seconds, then scores 1.0."""
    time.sleep(float(response))
    return 1.0


@register_verifier("t_crash")
def crashy(response: str, label: str, **kw) -> float:
    """Kills its own process on ``crash``; otherwise 1.0."""
    if response == "crash":
        os._exit(3)
    return 1.0


@register_verifier("t_raise")
def raisy(response: str, label: str, **kw) -> float:
    raise RuntimeError("boom " + response)


@register_verifier("t_pid")
def pid(response: str, label: str, **kw) -> float:
    """The worker's process id (to check processes are reused or replaced)."""
    return float(os.getpid())


@register_verifier("t_prompt")
def prompt_len(response: str, label: str, prompt: str = "", tool_call_num: int = 0) -> float:
    """len(prompt) + tool_call_num: checks which keyword arguments reach a verifier."""
    return float(len(prompt) + tool_call_num)


@register_verifier("t_bigpow")
def bigpow(response: str, label: str, **kw) -> float:
    """A C-level computation no signal can interrupt (what sympy does on 9^(9^9))."""
    return float(pow(9, 9 ** 9 * int(response)) % 7)


@register_verifier("t_alloc")
def alloc(response: str, label: str, **kw) -> float:
    """Asks for ``response`` GiB at once (beyond the worker's address-space limit)."""
    buf = bytearray(int(response) << 30)
    return float(len(buf) > 0)


@register_verifier("t_r11_fork")
def forking_verifier(response: str, label: str, **kw) -> float:
    """Forks a child that sleeps 60 s and writes its pid to the file ``label``; then sleeps
    60 s itself (``response == "hang"``) or returns 1.0."""
    pid = os.fork()
    if pid == 0:
        try:
            time.sleep(60)
        finally:
            os._exit(0)
    Path(label).write_text(str(pid))
    if response == "hang":
        time.sleep(60)
    return 1.0
