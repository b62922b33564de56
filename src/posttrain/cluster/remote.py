"""Waiting on Ray calls: every wait has a timeout, and the first failure stops the wait.

A worker that raised is reported with its remote traceback, or with only its message when it raised
a :class:`~posttrain.errors.PosttrainError` (a user error: a full disk, a corrupt file); a worker that died (killed, out of
memory, segfault) with Ray's account of the death. Either way the caller gets a
:class:`ClusterError` as soon as the first call fails, without waiting for the other workers,
which may be blocked in a collective with the dead one. When a worker raises, the others get a
few seconds (``DEATH_GRACE_S``) to show whether one of them died: a death is reported first,
since the raise is then only a collective failing with the dead peer. When the raise is a
collective's failure (gloo / NCCL: a peer gone, a timeout) and another worker raised something else
meanwhile, that worker's error (the cause) comes first, with its traceback; when none did, the
message names the workers that had not answered (the stuck peer).

When the caller says on which Ray node each worker runs (``nodes``), a dead worker's message also
says whether its node is gone (its raylet stopped: a lost machine, a killed raylet), with Ray's
reason. A worker on a lost node first shows as *unavailable* (its connection closed) before Ray
declares the node dead, so that case waits up to ``NODE_DEATH_GRACE_S`` for the verdict.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from posttrain.errors import PosttrainError

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
DEATH_GRACE_S = 10.0  # how long a raise waits to see whether another worker died (the root cause)
NODE_DEATH_GRACE_S = 30.0  # how long an unreachable worker waits for Ray to say whether its node died
# a collective that failed because of a peer (gloo / NCCL: a peer gone, a timeout): a secondary error
COLLECTIVE = re.compile(r"gloo|nccl|ProcessGroup|Connection (reset|closed)|timed out|timeout", re.IGNORECASE)
TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)


class ClusterError(PosttrainError):
    """A Ray worker failed, died or did not answer in time (rl_config.ray_timeout_s)."""


def gather(refs: list, names: list[str], what: str, timeout_s: float, nodes: list[str | None] | None = None) -> list:
    """The results of ``refs`` in order; raises :class:`ClusterError` on the first error or death,
    or when they are not all done after ``timeout_s`` seconds. ``names`` say which worker each is;
    ``nodes`` (optional) the Ray node id each runs on."""
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
                raise _raised(what, err, names[index[ref]], pending, names, index, nodes) from None
            except RayActorError as err:  # the process is gone
                raise ClusterError(f"{what}: {_death(names, nodes, index[ref], err)}") from None
            except GetTimeoutError as err:  # not expected after ray.wait said ready
                raise ClusterError(f"{what}: {names[index[ref]]} did not answer: {err}") from None
    return ray.get(refs)


@dataclass
class Pending:
    """Calls started and not yet awaited (``rl_config.blocking: false``): ``what`` they do, their
    refs, the workers' names and nodes, and ``finish``, which makes the one answer of their results."""

    what: str
    refs: list
    names: list[str]
    nodes: list[str | None]
    finish: Callable[[list], Any]


def wait_all(pendings: list[Pending], timeout_s: float) -> list:
    """The answers of ``pendings``, in order, after one :func:`gather` over all their refs (one
    deadline, the first error or death reported as soon as it happens)."""
    what = " and ".join(dict.fromkeys(p.what for p in pendings))
    results = gather([r for p in pendings for r in p.refs], [n for p in pendings for n in p.names], what, timeout_s,
                     nodes=[n for p in pendings for n in p.nodes])
    answers, start = [], 0
    for p in pendings:
        answers.append(p.finish(results[start:start + len(p.refs)]))
        start += len(p.refs)
    return answers


def _raised(what: str, err: Exception, name: str, pending: list, names: list[str], index: dict,
            nodes: list[str | None] | None) -> ClusterError:
    """The error to report when worker ``name`` raised ``err``: the root cause first. A peer that died
    is the cause (the raise was a collective failing with it); when ``err`` is itself a collective's
    failure (:data:`COLLECTIVE`) and a peer raised something else meanwhile, that peer's error is.
    Otherwise ``err``: its traceback, or only its message for a user error (a
    :class:`~posttrain.errors.PosttrainError`: a full disk, a bad file), whose frames would hide what
    to do; a collective's failure also names the peers that had not answered (stuck or slow)."""
    died, raises, waiting = _peers(pending, names, index, nodes)
    then = f"(and {name} then failed: {_first_line(err)})"
    if died:
        return ClusterError(f"{what}: {died} {then}")
    collective = bool(COLLECTIVE.search(_plain(err)))
    root = next((i for i, e in raises if not COLLECTIVE.search(_plain(e))), None) if collective else None
    if root is not None:
        cause = dict(raises)[root]
        return ClusterError(f"{what} failed on {names[root]}:\n{_plain(cause)}\n{then}")
    if isinstance(getattr(err, "cause", None), PosttrainError):
        return ClusterError(f"{what} failed on {name}: {err.cause}")
    stuck = f"\n(no answer yet from {', '.join(names[i] for i in waiting)})" if collective and waiting else ""
    if collective and TIMED_OUT.search(_plain(err)):
        stuck += ("\n(the workers' torch.distributed collectives wait rl_config.ray_timeout_s; raise it for long "
                  "steps, or look for the stuck worker)")
    return ClusterError(f"{what} failed on {name}:\n{_plain(err)}{stuck}")


def _peers(pending: list, names: list[str], index: dict, nodes: list[str | None] | None = None,
           grace_s: float | None = None) -> tuple[str | None, list[tuple[int, Exception]], list[int]]:
    """What the other workers (``pending``) do within ``grace_s`` seconds (``DEATH_GRACE_S``): ``"<name> died: <Ray's
    account>"`` for the first found dead (else None), the errors the others raised (by worker index),
    and the workers that had not answered. A worker blocked in a collective with a killed peer
    often raises (gloo: connection reset) before Ray has reported the peer's death."""
    import ray
    from ray.exceptions import RayActorError

    if not pending:
        return None, [], []
    grace_s = DEATH_GRACE_S if grace_s is None else grace_s
    ready, waiting = ray.wait(pending, num_returns=len(pending), timeout=grace_s)
    raises = []
    for ref in ready:
        try:
            ray.get(ref, timeout=0)
        except RayActorError as err:
            return _death(names, nodes, index[ref], err), raises, [index[r] for r in waiting]
        except Exception as err:  # noqa: BLE001 - another raise: reported if it is the root cause
            raises.append((index[ref], err))
    return None, raises, [index[r] for r in waiting]


def _death(names: list[str], nodes: list[str | None] | None, i: int, err: Exception) -> str:
    """``"<name> died: <Ray's account>"``, led by the node's fate when the worker's node is dead."""
    from ray.exceptions import ActorUnavailableError

    node = nodes[i] if nodes else None
    lost = _node_death(node, NODE_DEATH_GRACE_S if isinstance(err, ActorUnavailableError) else 0.0) if node else None
    if lost:
        return f"{names[i]} died: {lost}. Ray: {_plain(err)}"
    return f"{names[i]} died: {_plain(err)}"


def _node_death(node_id: str, grace_s: float) -> str | None:
    """``"its node is dead: <Ray's reason> (...)"`` once Ray reports node ``node_id``
    dead (checked for up to ``grace_s`` seconds), else None: the node is alive, only the worker died."""
    import ray

    deadline = time.monotonic() + grace_s
    while True:
        node = next((n for n in ray.nodes() if n["NodeID"] == node_id), None)
        if node is not None and not node.get("Alive", True):
            reason = node.get("DeathReasonMessage") or "Ray lost its raylet"
            return (f"its node is dead: {reason} (a lost machine or a stopped raylet; restart the node and "
                    f"resume from the last checkpoint)")
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.5)


def _first_line(err: Exception) -> str:
    lines = [line for line in _plain(err).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


def _plain(err: Exception) -> str:
    """The error's text without Ray's terminal colours."""
    return _ANSI.sub("", str(err))
