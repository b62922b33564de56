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

On the megatron backend only each data-parallel replica's leader holds a copy, made from its HF
rollout model, and a snapshot is a copy of that model right after the update reloaded it: no
collective (:mod:`posttrain.cluster.megatron_worker`).

The driver's side is :class:`posttrain.cluster.workers_replica.WorkersReplica`: the replica that
:class:`~posttrain.loops.pipeline.RolloutPipeline` samples with.
"""

from __future__ import annotations

import copy
import threading

import torch

class RolloutCopy:
    """One worker's frozen copy of the weights and its native rollout engine."""

    def __init__(self, model, build_engine, cpu_threads: int | None):
        self.model = copy.deepcopy(model)
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.engine = build_engine(self.model)
        self.cpu_threads = cpu_threads  # None on CUDA
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.lock = threading.Lock()  # keep (the trainer's thread) and load (the rollout's) may meet

    def keep(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        """Snapshot ``version``: the trained weights after that update (full tensors, copied)."""
        with self.lock:
            self.snapshots[version] = weights

    def load(self, version: int) -> int:
        """The copy holds snapshot ``version`` from now on; the older snapshots are dropped. Returns
        the number of tensors loaded."""
        with self.lock:
            weights = self.snapshots.pop(version)
            for old in [v for v in self.snapshots if v < version]:
                del self.snapshots[old]
        with torch.no_grad():
            self.model.load_state_dict(weights)
        return len(weights)

    def generate(self, *args, **kwargs):
        """The engine's ``generate`` on the copy. A call runs in one of the actor's threads, whose
        OpenMP thread count starts at its default: the worker's count is set first (on a CPU)."""
        if self.cpu_threads is not None and torch.get_num_threads() != self.cpu_threads:
            torch.set_num_threads(self.cpu_threads)
        return self.engine.generate(*args, **kwargs)
