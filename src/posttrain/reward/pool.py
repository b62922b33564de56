"""A process pool for verifiers with a real per-item timeout and automatic recovery.

Design
------
* ``num_workers`` long-lived processes, created once (forkserver on Linux, so a worker starts by
  forking a server that has already imported math-verify/sympy: milliseconds, not seconds) and
  reused across training iterations.
* The parent sends each idle worker a *chunk* of items (one item = one verifier on one sample).
  The worker returns results in batches (every 64 items or 50 ms) and, before each item, writes
  the item's id and start time into a small shared-memory array: the parent always knows which
  item a worker is on and since when, at no per-item messaging cost.
* Timeout: if a worker has been on one item longer than ``timeout`` seconds, the parent kills it
  (SIGKILL: this also stops C-level work such as a huge sympy power, which no signal-based guard
  can interrupt), scores the item 0.0 with status *timeout*, starts a replacement and puts the
  rest of the chunk back at the front of the queue.
* A worker that dies (segfault, out-of-memory kill, ``os._exit``) is handled the same way with
  status *error*.
* Child processes: each worker leads its own process group (``os.setsid()`` at start), and a
  worker is always stopped with its whole group (``os.killpg``): on a timeout, on a death, and
  on :meth:`VerifierPool.close`, which also runs at interpreter exit. A verifier that forks or
  runs subprocesses leaves nothing behind.
* ``num_workers = 0`` scores inline in the calling process (no timeout; for debugging).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import signal
import time
import weakref
from collections import deque
from multiprocessing.connection import wait as wait_conns

from posttrain.errors import ConfigError, PosttrainError
from posttrain.reward._worker import STATUS_ERROR, STATUS_OK, STATUS_TIMEOUT, score_item, worker_main


_STARTUP_TIMEOUT_S = 180.0
_POLL_S = 1.0


def check_verifier_settings(parallel: int, timeout: float) -> None:
    """The pool's arguments: ``num_workers`` (``rl_config.verifier_parallel``, 0: inline) and
    ``timeout`` (``rl_config.verifier_timeout``, seconds, finite, > 0). A config declares the same
    ranges on those fields (:mod:`posttrain.config.sections`)."""
    if parallel < 0:
        raise ConfigError(f"rl_config.verifier_parallel must be >= 0 (0 scores inline), got {parallel}")
    if not (isinstance(timeout, (int, float)) and math.isfinite(timeout)) or timeout <= 0:
        raise ConfigError(f"rl_config.verifier_timeout must be a finite number of seconds > 0, got {timeout}")


def _default_context() -> mp.context.BaseContext:
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["posttrain.reward._preload", "posttrain.reward._worker"])
        return ctx
    return mp.get_context("spawn")


class _Worker:
    """Parent-side handle of one worker process."""

    def __init__(self, ctx, args: tuple):
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.progress = ctx.RawArray("d", 2)  # [current item id, its start time (0 = idle)]
        self.proc = ctx.Process(target=worker_main, args=(child_conn, self.progress, *args), daemon=True,
                                name="posttrain-verifier")
        self.proc.start()
        child_conn.close()
        self.started = time.monotonic()
        self.ready = False
        self.chunk: list | None = None
        self.pos = 0           # number of results of the chunk received so far

    def current(self) -> tuple[int, float] | None:
        """(item id, start time) of the item being scored, or None when idle."""
        for _ in range(3):
            t1 = self.progress[1]
            item = int(self.progress[0])
            if t1 > 0 and self.progress[1] == t1:
                return item, t1
        return None

    def kill(self) -> None:
        """SIGKILL the worker with its process group (what its verifiers started); wait for it."""
        _kill_group(self.proc)
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)
        self.conn.close()


def _kill_group(proc) -> None:
    """SIGKILL the process group led by worker ``proc`` (the worker makes one at start).

    Safe against process-id reuse: while the worker lives, a group with its id can only be its
    own; once it is gone, the group is killed only when no process has that id, i.e. when the
    id is held by the worker's surviving group (a group keeps its id reserved) or by nothing.
    """
    pid = proc.pid
    if pid is None or not hasattr(os, "killpg"):
        return
    if not proc.is_alive():
        try:
            os.kill(pid, 0)
            return  # the id belongs to a process: the worker's zombie, or another process by now
        except ProcessLookupError:
            pass
        except OSError:
            return
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:  # no such group: the worker had no children left (or never made its group)
        pass


def _shutdown(workers: list) -> None:
    for w in workers:
        if w is None:
            continue
        try:
            w.conn.send(None)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 2.0
    for w in workers:
        if w is not None:
            w.proc.join(timeout=max(0.0, deadline - time.monotonic()))
            w.kill()


class VerifierPool:
    """Score ``(verifier, sample)`` items in worker processes with a per-item timeout.

    Args:
        specs: the :class:`~posttrain.reward.verifiers.VerifierSpec` list items index into.
        num_workers: worker processes (0 = inline, no timeout).
        timeout: seconds one item may take before its worker is killed (score 0.0, *timeout*).
        modules: user verifier modules every worker imports at start.
        memory_limit_mb: address-space limit per worker (0 = none); a blow-up raises MemoryError
            in the worker (score 0.0, *error*) instead of exhausting the machine.
    """

    def __init__(self, specs, num_workers: int = 1, timeout: float = 30.0, modules=(),
                 memory_limit_mb: int = 8192, ctx=None):
        check_verifier_settings(num_workers, timeout)
        self.specs = list(specs)
        self.timeout = float(timeout)
        self.num_workers = num_workers
        self.restarts = 0
        mv_timeout = max(1, min(5, int(self.timeout / 2)))
        self._args = (self.specs, tuple(modules), mv_timeout, memory_limit_mb)
        self._ctx = ctx or (_default_context() if num_workers else None)
        self._workers: list[_Worker | None] = [self._spawn() for _ in range(num_workers)]
        self._finalizer = weakref.finalize(self, _shutdown, self._workers)
        self._chunk_counter = 0

    def _spawn(self) -> _Worker:
        return _Worker(self._ctx, self._args)

    def close(self) -> None:
        """Stop every worker and everything its verifiers started (idempotent; also runs at
        interpreter exit and when the pool is garbage-collected)."""
        self._finalizer()

    def __enter__(self) -> "VerifierPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, items: list[tuple]) -> tuple[list[float], list[int], list[str]]:
        """Score ``items`` = ``[(verifier_index, response, label, kwargs), ...]``.

        Returns (scores, statuses, errors) aligned with ``items``; status is 0 ok, 1 timeout,
        2 error, and a non-ok item scores 0.0.
        """
        if not self._finalizer.alive:
            raise PosttrainError("the verifier pool is closed")
        if self.num_workers == 0:
            out = [score_item(self.specs[vi], r, lab, kw) for vi, r, lab, kw in items]
            return [o[0] for o in out], [o[1] for o in out], [o[2] for o in out]
        return _Run(self, items).execute()


class _Run:
    """One call of :meth:`VerifierPool.run`: the dispatch loop and its bookkeeping."""

    def __init__(self, pool: VerifierPool, items: list[tuple]):
        self.pool = pool
        n = len(items)
        size = max(1, min(256, -(-n // (4 * pool.num_workers))))
        tagged = [(i, *item) for i, item in enumerate(items)]
        self.queue = deque(tagged[i:i + size] for i in range(0, n, size))
        self.scores = [0.0] * n
        self.status = [STATUS_OK] * n
        self.errors = [""] * n
        self.remaining = n
        self.startup_failures = 0
        self.blameless_deaths = 0

    def execute(self):
        while self.remaining:
            self._dispatch()
            self._receive()
            self._enforce_deadlines()
        return self.scores, self.status, self.errors

    def _dispatch(self) -> None:
        for idx, w in enumerate(self.pool._workers):
            if w.ready and w.chunk is None and self.queue:
                chunk = self.queue.popleft()
                self.pool._chunk_counter += 1
                w.chunk, w.pos = chunk, 0
                try:
                    w.conn.send((self.pool._chunk_counter, chunk))
                except (OSError, ValueError):
                    self._fail_current(idx, STATUS_ERROR, "verifier worker died")

    def _next_deadline(self) -> float:
        now, nearest = time.monotonic(), time.monotonic() + _POLL_S
        for w in self.pool._workers:
            cur = w.current() if w.chunk is not None else None
            if cur is not None:
                nearest = min(nearest, cur[1] + self.pool.timeout)
            elif w.chunk is None and not w.ready:
                nearest = min(nearest, w.started + _STARTUP_TIMEOUT_S)
        return max(0.0, nearest - now)

    def _receive(self) -> None:
        by_conn = {w.conn: i for i, w in enumerate(self.pool._workers)}
        for conn in wait_conns(list(by_conn), timeout=self._next_deadline()):
            idx = by_conn[conn]
            try:
                while conn.poll():
                    self._handle(idx, conn.recv())
            except (EOFError, OSError):
                self._fail_current(idx, STATUS_ERROR, "verifier worker died")

    def _handle(self, idx: int, msg: tuple) -> None:
        w = self.pool._workers[idx]
        kind = msg[0]
        if kind == "ready":
            w.ready = True
        elif kind == "init_error":
            raise ConfigError(f"a verifier worker could not start:\n{msg[1]}")
        else:
            results = msg[1] if kind == "results" else msg[2]
            for item_id, score, status, err in results:
                self._record(item_id, score, status, err)
            w.pos += len(results)
            if kind == "done":
                w.chunk = None

    def _record(self, item_id: int, score: float, status: int, err: str) -> None:
        self.scores[item_id], self.status[item_id], self.errors[item_id] = score, status, err
        self.remaining -= 1

    def _enforce_deadlines(self) -> None:
        now = time.monotonic()
        for idx, w in enumerate(self.pool._workers):
            cur = w.current() if w.chunk is not None else None
            if cur is not None and now - cur[1] > self.pool.timeout:
                self._fail_current(idx, STATUS_TIMEOUT, f"timed out after {self.pool.timeout:g} s", cur[0])
            elif w.chunk is None and not w.ready and now - w.started > _STARTUP_TIMEOUT_S:
                raise PosttrainError(
                    f"a verifier worker did not start within {_STARTUP_TIMEOUT_S:g} s; check that "
                    f"the verifier modules import quickly")
            elif w.chunk is None and w.ready and not w.proc.is_alive():
                self._replace(idx)

    def _fail_current(self, idx: int, status: int, why: str, item_id: int | None = None) -> None:
        """Kill worker ``idx``, score its current item 0.0 (``status``), requeue the rest
        (including items it finished but had not reported yet)."""
        w = self.pool._workers[idx]
        if item_id is None:
            cur = w.current()
            item_id = cur[0] if cur is not None else None
        if not w.ready:
            self.startup_failures += 1
            if self.startup_failures > 3:
                raise PosttrainError("verifier workers keep dying while starting; run with "
                                     "verifier_parallel=0 to see the error in this process")
        if w.chunk is not None and w.pos < len(w.chunk):
            unreported = w.chunk[w.pos:]
            if item_id is None and self.blameless_deaths < 3:
                # died between items (e.g. killed from outside): nothing to blame, retry all
                self.blameless_deaths += 1
                self.queue.appendleft(unreported)
                self._replace(idx)
                return
            culprit = next((it for it in unreported if it[0] == item_id), unreported[0])
            name = self.pool.specs[culprit[1]].name
            self._record(culprit[0], 0.0, status, f"{name}: {why}")
            rest = [it for it in unreported if it is not culprit]
            if rest:
                self.queue.appendleft(rest)
        self._replace(idx)

    def _replace(self, idx: int) -> None:
        self.pool._workers[idx].kill()
        self.pool._workers[idx] = self.pool._spawn()
        self.pool.restarts += 1
