"""``async_staleness`` on Ray actor workers: each worker's rollout copy of the weights.

With ``rl_config.async_staleness: k`` the rollout of iteration ``j`` samples the weights of version
``need(j)`` while the update of ``j - 1`` trains (:mod:`posttrain.loops.pipeline`). On Ray actor
workers (DDP or FSDP2, the native engine) every worker holds, beside its trained model, a
:class:`RolloutCopy`: a full, frozen copy of the weights with a native engine of its own, made
before FSDP2 shards the model. It is only ever refreshed to the version the pipeline asks for:

* after update ``v`` (the trainer's thread, between updates) every worker keeps a copy of its
  weights as snapshot ``v`` (FSDP2: the full tensors, gathered by all ranks: a collective);
* when the rollout thread starts an iteration that needs version ``v``, every worker loads its
  snapshot ``v`` into its copy and drops the older ones.

The workers are threaded actors (two calls at once), so the rollout thread's ``generate`` reaches a
worker while the trainer's update runs there: generating from the copy needs no collective, and
the trained model is never read by it. The samples are keyed as in one process, so the run equals
the one-process asynchronous run with the same ``k`` (docs/async.md).

A rollout engine that holds its own copy of the weights (``rollout_engine: vllm``) is that copy
already: :class:`EngineCopy` keeps, instead of a second model, each snapshot as a
:class:`~posttrain.rollout.vllm_weights.WeightSnapshot` (the full tensors in host memory and the
trained model's log-probs of the engine's probe, both taken after update ``v``), and loading
snapshot ``v`` is the engine's ``sync_weights`` of it, proven by the probe against exactly those
weights (``rollout/sync_probe_diff``). The engine is also the one the evaluation samples with, so
the driver has it hold the trained weights while the pipeline is drained
(:meth:`~posttrain.loops.pipeline.RolloutPipeline.hold_published`).

On the megatron backend only each data-parallel replica's leader holds a copy: native, made from its
HF rollout model, a snapshot being a copy of that model right after the update reloaded it (no
collective); vLLM, its engine as an :class:`EngineCopy`, a snapshot being the layers gathered over
the replica with the probe scored on them (a collective over the replica's ranks;
:mod:`posttrain.cluster.megatron_worker`).

The driver's side is :class:`posttrain.cluster.workers_replica.WorkersReplica`: the replica that
:class:`~posttrain.loops.pipeline.RolloutPipeline` samples with.
"""

from __future__ import annotations

import copy
import threading

import torch

from posttrain.rollout.vllm_weights import WeightSnapshot


class Snapshots:
    """Numbered snapshots of the trained weights, kept by the trainer's thread and taken (once, the older
    ones dropped) by the rollout's."""

    def __init__(self):
        self.kept: dict[int, object] = {}
        self.lock = threading.Lock()  # keep (the trainer's thread) and take (the rollout's) may meet

    def keep(self, version: int, weights) -> None:
        with self.lock:
            self.kept[version] = weights

    def take(self, version: int):
        """Snapshot ``version``; it and the older ones are dropped."""
        with self.lock:
            weights = self.kept.pop(version)
            for old in [v for v in self.kept if v < version]:
                del self.kept[old]
        return weights


class RolloutCopy:
    """One worker's frozen copy of the weights and its native rollout engine."""

    def __init__(self, model, build_engine, cpu_threads: int | None):
        self.model = copy.deepcopy(model)
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.engine = build_engine(self.model)
        self.cpu_threads = cpu_threads  # None on CUDA
        self.snapshots = Snapshots()

    def keep(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        """Snapshot ``version``: the trained weights after that update (full tensors, copied)."""
        self.snapshots.keep(version, weights)

    def load(self, version: int) -> int:
        """The copy holds snapshot ``version`` from now on; the older snapshots are dropped. Returns
        the number of tensors loaded."""
        weights = self.snapshots.take(version)
        with torch.no_grad():
            self.model.load_state_dict(weights)
        return len(weights)

    def generate(self, *args, **kwargs):
        """The engine's ``generate`` on the copy. A call runs in one of the actor's threads, whose
        OpenMP thread count starts at its default: the worker's count is set first (on a CPU)."""
        if self.cpu_threads is not None and torch.get_num_threads() != self.cpu_threads:
            torch.set_num_threads(self.cpu_threads)
        return self.engine.generate(*args, **kwargs)


class EngineCopy:
    """A worker's rollout engine that holds its own copy of the weights (vLLM) as its rollout copy:
    snapshots are :class:`~posttrain.rollout.vllm_weights.WeightSnapshot` objects in host memory, and
    loading one is the engine's ``sync_weights`` (proven by its probe). The engine sets its own
    thread count in every call (``VLLMEngine._same_threads``)."""

    def __init__(self, engine):
        self.engine = engine
        self.snapshots = Snapshots()

    def keep(self, version: int, model) -> None:
        """Snapshot ``version``: ``model`` is the trained model, or FSDP2's gathered view of it (the
        caller holds the gather while the tensors are copied and the probe is scored)."""
        self.snapshots.keep(version, WeightSnapshot(model, self.engine.probe, host=True))

    def load(self, version: int) -> int:
        return self.engine.sync_weights(self.snapshots.take(version))

    def generate(self, *args, **kwargs):
        return self.engine.generate(*args, **kwargs)
