"""The verifier worker process (see :mod:`posttrain.reward.pool`).

The forkserver preloads :mod:`posttrain.reward._preload`, so forked workers start with
math-verify, sympy and the built-in verifiers already imported; a spawned worker imports them
once in :func:`_init`, never per sample.

Protocol on the duplex pipe, worker side:
  send ("ready",) or ("init_error", text) once at start;
  recv (chunk_id, [(item_id, verifier_index, response, label, kwargs), ...]) or None (exit);
  send ("results", [(item_id, score, status, error_text), ...]) every FLUSH_ITEMS items or
  FLUSH_S seconds, and ("done", chunk_id, [remaining results]) at the end of the chunk.

Before each item the worker writes ``progress = [item_id, time.monotonic()]`` to shared memory
(no system call), so the parent knows which item is running and since when without a message
per item; ``progress[1] = 0`` means idle.

Process group: a worker starts a new session (``os.setsid()``), so it leads a process group that
holds every process its verifiers start (``os.fork()``, ``subprocess`` ...). When the worker
stops (told to, or its parent is gone) it kills that group, itself included; the parent kills
the group of a worker it gives up on (timeout, close). Nothing a verifier starts outlives it,
unless it leaves the group on purpose (its own ``setsid``).
"""

from __future__ import annotations

import math
import os
import resource
import signal
import time
import traceback

from posttrain.reward.verifiers import import_verifier_modules
from posttrain.reward.verifiers.equiv import set_math_verify_timeout

STATUS_OK, STATUS_TIMEOUT, STATUS_ERROR = 0, 1, 2
FLUSH_ITEMS = 64
FLUSH_S = 0.05



def _limit_memory(limit_mb: int) -> None:
    if limit_mb and limit_mb > 0:
        limit = limit_mb * 1024 * 1024
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _init(specs, modules, mv_timeout, memory_limit_mb) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business

    import posttrain.reward._preload  # noqa: F401  (lazy: math-verify; a no-op when the forkserver preloaded it)

    import_verifier_modules(list(modules))
    set_math_verify_timeout(mv_timeout)
    _limit_memory(memory_limit_mb)


def _lead_process_group() -> None:
    """Start a new session: this worker leads a process group that its verifiers' children join."""
    try:
        os.setsid()
    except OSError:  # already a group leader (not the case for a forked or spawned worker)
        pass


def _kill_process_group() -> None:
    """SIGKILL the group this worker leads: the processes its verifiers left behind, and itself."""
    if hasattr(os, "killpg") and os.getpgrp() == os.getpid():  # never the parent's group
        os.killpg(os.getpid(), signal.SIGKILL)


def score_item(spec, response: str, label: str, kwargs: dict) -> tuple[float, int, str]:
    """(score, status, error text) of one verifier call; exceptions and NaN become errors."""
    try:
        score = spec.call(response, label, kwargs)
    except MemoryError:
        return 0.0, STATUS_ERROR, f"{spec.name}: MemoryError (worker memory limit)"
    except Exception as e:  # a verifier bug must not stop the batch
        return 0.0, STATUS_ERROR, f"{spec.name}: {type(e).__name__}: {str(e)[:300]}"
    if not math.isfinite(score):
        return 0.0, STATUS_ERROR, f"{spec.name}: returned {score}"
    return score, STATUS_OK, ""


def worker_main(conn, progress, specs, modules, mv_timeout, memory_limit_mb) -> None:
    """Entry point of one worker process: score chunks until told to stop or the pipe closes;
    then kill the worker's process group (what its verifiers started, and the worker)."""
    _lead_process_group()
    try:
        _init(specs, modules, mv_timeout, memory_limit_mb)
    except BaseException:
        conn.send(("init_error", traceback.format_exc(limit=5)))
        return
    conn.send(("ready",))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            msg = None
        if msg is None:
            _kill_process_group()
            return
        chunk_id, items = msg
        buf, last_flush = [], time.monotonic()
        for item_id, vi, response, label, kwargs in items:
            progress[1] = 0.0  # mark 'changing' so the parent never pairs an id with a stale time
            progress[0], progress[1] = item_id, time.monotonic()
            buf.append((item_id, *score_item(specs[vi], response, label, kwargs)))
            now = time.monotonic()
            if len(buf) >= FLUSH_ITEMS or now - last_flush >= FLUSH_S:
                conn.send(("results", buf))
                buf, last_flush = [], now
        progress[1] = 0.0
        conn.send(("done", chunk_id, buf))
