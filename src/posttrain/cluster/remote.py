"""Waiting on Ray calls: every wait has a timeout, and the first failure stops the wait.

A worker that raised is reported with its remote traceback, or with only its message when it raised
a :class:`~posttrain.errors.PosttrainError` (a user error: a full disk, a corrupt file); a worker that died (killed, out of
memory, segfault) with Ray's account of the death. Either way the caller gets a
:class:`ClusterError` as soon as the first call fails, without waiting for the other workers,
which may be blocked in a collective with the dead one. When a worker raises, the others get a
few seconds (``DEATH_GRACE_S``) to show whether one of them died: a death is reported first,
since the raise is then only a collective failing with the dead peer.
"""

from __future__ import annotations

import re
import time

from posttrain.errors import PosttrainError

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
DEATH_GRACE_S = 10.0  # how long a raise waits to see whether another worker died (the root cause)


class ClusterError(PosttrainError):
    """A Ray worker failed, died or did not answer in time (rl_config.ray_timeout_s)."""


def gather(refs: list, names: list[str], what: str, timeout_s: float) -> list:
    """The results of ``refs`` in order; raises :class:`ClusterError` on the first error or death,
    or when they are not all done after ``timeout_s`` seconds. ``names`` say which worker each is."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    index = {ref: i for i, ref in enumerate(refs)}
    pending, deadline = list(refs), time.monotonic() + timeout_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            late = ", ".join(names[index[r]] for r in pending)
            raise ClusterError(f"{what}: no answer from {late} within rl_config.ray_timeout_s={timeout_s:.0f} s; "
                               f"the worker is stuck or too slow. Raise ray_timeout_s for long steps.")
        for ref in ready:
            try:
                ray.get(ref, timeout=0)
            except RayTaskError as err:  # the worker raised: its traceback is in the message
                died = _first_death(pending, names, index)
                if died:  # the root cause: the raise was a collective failing with the dead worker
                    raise ClusterError(f"{what}: {died} (and {names[index[ref]]} then failed: "
                                       f"{_first_line(err)})") from None
                if isinstance(getattr(err, "cause", None), PosttrainError):  # a user error (a full disk, a
                    # bad file): its message says what to do; the worker's frames would only hide it
                    raise ClusterError(f"{what} failed on {names[index[ref]]}: {err.cause}") from None
                raise ClusterError(f"{what} failed on {names[index[ref]]}:\n{_plain(err)}") from None
            except RayActorError as err:  # the process is gone
                raise ClusterError(f"{what}: {names[index[ref]]} died: {_plain(err)}") from None
            except GetTimeoutError as err:  # not expected after ray.wait said ready
                raise ClusterError(f"{what}: {names[index[ref]]} did not answer: {err}") from None
    return ray.get(refs)


def _first_death(pending: list, names: list[str], index: dict, grace_s: float = DEATH_GRACE_S) -> str | None:
    """``"<name> died: <Ray's account>"`` for the first of ``pending`` that is found dead within
    ``grace_s`` seconds, else None. A worker blocked in a collective with a killed peer often
    raises (gloo: connection reset) before Ray has reported the peer's death."""
    import ray
    from ray.exceptions import RayActorError

    if not pending:
        return None
    ready, _ = ray.wait(pending, num_returns=len(pending), timeout=grace_s)
    for ref in ready:
        try:
            ray.get(ref, timeout=0)
        except RayActorError as err:
            return f"{names[index[ref]]} died: {_plain(err)}"
        except Exception:  # noqa: BLE001 - another raise; the first one is reported
            continue
    return None


def _first_line(err: Exception) -> str:
    lines = [line for line in _plain(err).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


def _plain(err: Exception) -> str:
    """The error's text without Ray's terminal colours."""
    return _ANSI.sub("", str(err))
