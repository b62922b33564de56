"""Where the on-policy loop takes each iteration's experience from, and where it hands the trained
weights back to: an :class:`ExperienceSource`.

* :class:`SyncSource`: the iteration's experience is produced now, by the trainer's own rollout
  engine with the weights of the last update (a vLLM engine holds its own copy: the weights are
  pushed to it after each update, timed as ``timing/resharding_to_infer``);
* :class:`PipelinedSource`: a rollout thread produces it ahead, on a replica of the weights up to
  ``async_staleness`` updates old (a copy in this process, the trainer's own vLLM engine, or a
  rollout worker process with ``separate_rollout_worker: true``; :mod:`posttrain.loops.pipeline`,
  docs/async.md).

Both produce with a :class:`~posttrain.loops.produce.Producer` (plain or partial rollout, with
or without dynamic sampling); :func:`open_source` picks the source from the plan.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from posttrain.cluster.workers_replica import WorkersReplica
from posttrain.cluster.rollout_worker import RemoteReplica
from posttrain.config.plan import Plan
from posttrain.loops.pipeline import EngineReplica, LocalReplica, RolloutPipeline
from posttrain.metrics.timers import Timers
from posttrain.roles.policy import build_rollout
from posttrain.loops.produce import Experience, Producer
from posttrain.loops.resume_files import IN_FLIGHT, check_resumed_source, load_in_flight, plain_experience
from posttrain.loops.session import Session


class ExperienceSource(Protocol):
    def next(self, iteration: int, timers: Timers) -> Experience:
        """The experience iteration ``iteration`` learns from (waits for it when produced ahead)."""
        ...

    def publish(self, iteration: int, model, timers: Timers) -> None:
        """Hand over the weights after update ``iteration`` to whatever samples with them."""
        ...

    def checkpoint_files(self) -> contextlib.AbstractContextManager[dict[str, Any]]:
        """Around a save: what the checkpoint holds of the source beyond the weights, by file name."""
        ...

    def close(self) -> None: ...


class SyncSource:
    """Experience produced when it is asked for, with the trainer's rollout engine."""

    def __init__(self, producer: Producer, engine):
        self.producer, self.engine = producer, engine

    def next(self, iteration: int, timers: Timers) -> Experience:
        exp = self.producer(iteration, self.engine, iteration - 1)
        drop = getattr(self.engine, "drop_sampling_weights", None)  # the native engine's, through wrappers
        if drop is not None:
            drop()  # before the update: it changes the weights they hold, and they would add to its peak
        return exp

    def publish(self, iteration: int, model, timers: Timers) -> None:
        began = timers.clock()
        if self.engine.sync_weights(model) is not None:  # vLLM: its own copy of the weights, loaded
            timers.record("resharding_to_infer", began, timers.clock())

    @contextlib.contextmanager
    def checkpoint_files(self) -> Iterator[dict[str, Any]]:
        yield self.producer.state_files()

    def close(self) -> None:
        pass


class PipelinedSource:
    """Experience produced ahead by a rollout thread (:class:`~posttrain.loops.pipeline.RolloutPipeline`)."""

    def __init__(self, producer: Producer, pipeline, model, trainer_engine=None):
        self.producer, self.pipeline, self.model = producer, pipeline, model
        self.trainer_engine = trainer_engine  # the trainer's own rollout engine, which evaluates

    def next(self, iteration: int, timers: Timers) -> Experience:
        exp, began, ended = self.pipeline.experience(iteration)  # sampled with weights up to k updates old
        timers.record("non_overlap_rollout", began, ended)
        return exp

    def publish(self, iteration: int, model, timers: Timers) -> None:
        with timers("resharding_to_infer"):
            self.pipeline.publish(iteration, model)

    @contextlib.contextmanager
    def checkpoint_files(self) -> Iterator[dict[str, Any]]:
        """The thread pauses once it has produced all it may (so an evaluation has the reward workers
        to itself); the finished experiences not trained on yet are saved with the checkpoint."""
        with self.pipeline.drained() as finished:
            self.pipeline.hold_published(self.model)  # vLLM: the engine evaluates with the trainer's weights
            if not self.pipeline.replica.shares_trainer_engine and getattr(self.trainer_engine, "holds_weights",
                                                                           False):
                self.trainer_engine.sync_weights(self.model)  # a rollout worker's run: the trainer's vLLM evaluates
            yield {IN_FLIGHT: {it: plain_experience(exp) for it, exp in finished.items()},
                   **self.producer.state_files()}

    def close(self) -> None:
        self.pipeline.close()


def open_source(plan: Plan, session: Session, producer: Producer) -> ExperienceSource:
    """The plan's source: pipelined with ``async_staleness`` or a separate rollout worker, else sync.
    A resumed run is checked first to be resumed with the settings its checkpoint was saved with."""
    off = plan.off_policy
    check_resumed_source(session.trainer_state, staleness=off.staleness, pipelined=off.pipelined,
                         partial_max_split=off.partial_max_split if off.partial else None)
    if not plan.off_policy.pipelined:
        return SyncSource(producer, session.policy.rollout)

    p, start = session.policy, session.iteration
    if plan.off_policy.separate_worker:
        replica = RemoteReplica(plan, session.worker_start(), p.model)
    elif session.cluster is not None:  # the workers' rollout copies (megatron: the leaders'; cluster/rollout_copy.py)
        replica = WorkersReplica(session.cluster)
    elif getattr(p.rollout, "holds_weights", False):  # vLLM: its own copy of the weights is the replica
        replica = EngineReplica(p.rollout)
    else:
        replica = LocalReplica(p.model, lambda m: build_rollout(plan.rollout, plan.policy, m, p.tokenizer,
                                                                p.stop_token_ids))
    pipeline = RolloutPipeline(producer, replica, staleness=plan.off_policy.staleness or 0, start=start,
                               last=plan.train_iters, in_flight=in_flight(session, producer))
    return PipelinedSource(producer, pipeline, p.model, p.rollout)


def in_flight(session: Session, producer: Producer) -> dict:
    """The finished experiences a resumed asynchronous run saved (iteration -> experience); its
    settings were checked by :func:`~posttrain.loops.resume_files.check_resumed_source`."""
    path = session.trainer_state.get("checkpoint_dir")
    if not (session.iteration and path and (Path(path) / IN_FLIGHT).is_file()):
        return {}
    return load_in_flight(Path(path) / IN_FLIGHT, lambda it: Experience(producer.new_dock(it)))
