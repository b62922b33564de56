"""Asynchronous rollout with bounded staleness (``rl_config.async_staleness: k``).

A thread produces the experience of iteration ``j`` (prompts, rollout, rewards) with its own
replica of the weights while the trainer learns from iteration ``j - 1``: a copy in this process
(:class:`LocalReplica`), the trainer's vLLM engine, which holds its own copy (:class:`EngineReplica`),
the Ray actor workers' rollout copies (native or vLLM: :mod:`posttrain.cluster.workers_replica`),
or, with ``separate_rollout_worker: true``, a rollout worker process on Ray, where the sampling does
not share this process's interpreter and cores. The copy holds *version* ``v``: the
weights after ``v`` updates. Iteration ``j`` always samples with version::

    need(j) = max(start, j - 1 - k)

where ``start`` is the version the run started from (0, or the iteration it resumed at). It waits
for that version when it is not there yet and never takes a fresher one, so a run repeats
exactly, and ``k = 0`` samples exactly what synchronous training samples. The trainer hands each
new version over with :meth:`RolloutPipeline.publish`: a copy of the weights that the thread
loads when it starts the iteration that needs it (``timing/resharding_to_infer``).

A multimodal run's replica (in this process) samples each prompt with its images, and the
experience it hands over carries them in its dock (docs/multimodal.md).

Saving pauses the thread once it has produced every iteration that the published versions allow;
those finished experiences are saved with the checkpoint (``in_flight.pt``), so a resume trains
on exactly the samples the uninterrupted run would have (docs/async.md).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from posttrain.errors import PosttrainError
from posttrain.rollout.vllm_weights import WeightSnapshot

log = logging.getLogger(__name__)
THREAD_CHECK_S = 1.0  # how often a trainer's wait checks that the rollout thread is still alive


class LocalReplica:
    """The rollout's copy of the weights in this process, sampled by the rollout thread."""

    shares_trainer_engine = False

    def __init__(self, model, build_engine: Callable[[Any], Any]):
        self.model = copy.deepcopy(model)
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.engine = build_engine(self.model)

    @staticmethod
    def snapshot(model) -> dict[str, torch.Tensor]:
        """A copy of ``model``'s weights now (what :meth:`load` takes)."""
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.model.load_state_dict(state)

    def close(self) -> None:
        pass


class EngineReplica:
    """The trainer's own rollout engine as the replica, when it holds its own copy of the weights
    (vLLM): loading a version is ``engine.sync_weights`` of its :class:`WeightSnapshot` (proven by
    the probe). The engine is used by one thread at a time: the rollout thread, and the trainer only
    while the thread is paused (:meth:`RolloutPipeline.drained`: the evaluation)."""

    shares_trainer_engine = True

    def __init__(self, engine):
        self.engine = engine

    def snapshot(self, model) -> WeightSnapshot:
        return WeightSnapshot(model, self.engine.probe)

    def load(self, snapshot: WeightSnapshot) -> None:
        self.engine.sync_weights(snapshot)

    def close(self) -> None:
        pass


class RolloutPipeline:
    """The rollout thread and its replica of the weights (see the module docstring).

    Args:
        produce: ``produce(iteration, engine, version) -> experience`` (runs in the thread).
        replica: the weights the thread samples with, and their engine: a :class:`LocalReplica`,
            or a rollout worker process (:class:`posttrain.cluster.rollout_worker.RemoteReplica`).
            It holds the trainer's weights now.
        staleness: ``k >= 0``.
        start: the version of the weights now (the iteration the run starts after).
        last: the last iteration to produce.
        in_flight: finished experiences of a resumed run (iteration -> experience).
    """

    def __init__(self, produce: Callable[[int, Any, int], Any], replica, *, staleness: int, start: int, last: int,
                 in_flight: dict[int, Any] | None = None):
        self.produce, self.k, self.start, self.last = produce, staleness, start, last
        self.replica, self.engine = replica, replica.engine
        self.loaded = start  # the version the replica holds
        self.published = start  # the newest version handed over
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.done: dict[int, Any] = dict(in_flight or {})
        self.next = max(self.done, default=start) + 1
        self.busy = self.paused = self.stopped = False
        self.error: BaseException | None = None
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="posttrain-rollout", daemon=True)
        self.thread.start()

    def need(self, iteration: int) -> int:
        """The policy version iteration ``iteration`` samples with."""
        return max(self.start, iteration - 1 - self.k)

    # ---- the trainer's side ------------------------------------------------------------------
    def experience(self, iteration: int) -> tuple[Any, float, float]:
        """The experience of ``iteration`` (waiting for it), and when the wait began and ended."""
        began = time.time()
        with self.cond:
            while iteration not in self.done and self.error is None:
                self._wait(f"the experience of iteration {iteration}")
            self._raise()
            out = self.done.pop(iteration)
            self.cond.notify_all()
        return out, began, time.time()

    def publish(self, version: int, model) -> None:
        """Hand over the weights of ``version`` (the model after that many updates): a copy, if a
        later iteration samples with them."""
        needed = self.need(self.last) >= version > self.published
        snapshot = self.replica.snapshot(model) if needed else None
        with self.cond:
            if snapshot is not None:
                self.snapshots[version] = snapshot
            self.published = max(self.published, version)
            self.cond.notify_all()

    @contextlib.contextmanager
    def drained(self) -> Iterator[dict[int, Any]]:
        """Pause the thread once it has produced all that the published versions allow; yields the
        finished experiences not yet trained on (what a checkpoint saves)."""
        with self.cond:
            while self.error is None and (self.busy or self._can_start()):
                self._wait("the rollout thread to finish its iteration before the checkpoint")
            self._raise()
            self.paused = True
            finished = dict(self.done)
        try:
            yield finished
        finally:
            with self.cond:
                self.paused = False
                self.cond.notify_all()

    def hold_published(self, model) -> None:
        """While :meth:`drained`: make a replica that is the trainer's own engine hold the trainer's
        weights (version ``published``, ``model``'s now), so that an evaluation samples from them. Every
        later iteration needs a newer version (the thread has produced all that ``published`` allows),
        so the staleness schedule is unchanged."""
        assert self.paused, "hold_published runs while the thread is drained"
        if self.replica.shares_trainer_engine and self.loaded != self.published:
            self.replica.load(self.replica.snapshot(model))
            self.loaded = self.published

    def close(self) -> None:
        """Stop the thread (after the iteration it is producing) and the replica (once)."""
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        self.thread.join()
        replica, self.replica = self.replica, None
        if replica is not None:
            replica.close()

    # ---- the thread --------------------------------------------------------------------------
    def _can_start(self) -> bool:
        return self.next <= self.last and self.need(self.next) <= self.published

    def _wait(self, what: str) -> None:
        """Wait (holding ``cond``) for the thread's next notice, at most :data:`THREAD_CHECK_S`; a thread
        that has ended (it raises nothing then: it stopped after the last iteration) never brings
        ``what``, so that raises instead of waiting forever. The thread's own waits are bounded: Ray
        calls by ``rl_config.ray_timeout_s``, the rewards by ``verifier_timeout``."""
        if not self.thread.is_alive():
            raise PosttrainError(f"the rollout thread ended (after iteration {self.next - 1} of {self.last}) while "
                                 f"the trainer waited for {what}")
        self.cond.wait(timeout=THREAD_CHECK_S)

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.stopped and (self.paused or not self._can_start()):
                        if self.next > self.last:
                            return
                        self.cond.wait()
                    if self.stopped:
                        return
                    iteration, version = self.next, self.need(self.next)
                    snapshot = self.snapshots.pop(version, None) if version != self.loaded else None
                    for old in [v for v in self.snapshots if v < version]:
                        del self.snapshots[old]
                    self.busy = True
                resharding = self._load(snapshot, version)
                experience = self.produce(iteration, self.engine, version)
                if resharding is not None:
                    experience.timers.record("resharding_to_infer", *resharding)
                with self.cond:
                    self.done[iteration] = experience
                    self.next += 1
                    self.busy = False
                    self.cond.notify_all()
        except BaseException as err:  # noqa: BLE001 - handed to the trainer, which raises it
            log.error("the rollout thread failed: %s", err)
            with self.cond:
                self.error, self.busy = err, False
                self.cond.notify_all()

    def _load(self, snapshot: dict[str, torch.Tensor] | None, version: int) -> tuple[float, float] | None:
        if snapshot is None:
            return None
        began = time.time()
        self.replica.load(snapshot)
        self.loaded = version
        return began, time.time()
