"""The driver's side of ``async_staleness`` on Ray actor workers and on the megatron backend: the
workers' rollout copies of the weights (:mod:`posttrain.cluster.rollout_copy`: a native engine's copy,
or a vLLM engine's own; megatron: the replicas' leaders' only) as the replica of
:class:`~posttrain.loops.pipeline.RolloutPipeline`; its ``engine`` is a
:class:`~posttrain.cluster.group.RolloutRole` on the copies."""

from __future__ import annotations

from posttrain.cluster.group import RolloutRole


class WorkersReplica:
    """The workers' rollout copies as the pipeline's replica:
    ``snapshot`` asks every worker to keep its weights now, ``load`` to load one snapshot into its copy
    (the design: :mod:`posttrain.cluster.rollout_copy`)."""

    def __init__(self, cluster):
        self.c = cluster
        # vLLM: the workers' engines are their rollout copies and the ones that evaluate too, so the
        # pipeline has them hold the trained weights while it is drained (RolloutPipeline.hold_published)
        self.shares_trainer_engine = cluster.rollout_holds_weights
        self.engine = RolloutRole(cluster, cluster.policy.rollout.max_num_seqs, method="generate_copy",
                                  max_model_len=cluster.policy.rollout.max_model_len)
        self.taken = 0  # snapshots taken: each one's number

    def snapshot(self, model) -> int:
        """Every worker keeps its trained weights now (``model`` is not read: they live in the workers).
        Returns the snapshot's number, which :meth:`load` takes."""
        self.taken += 1
        self.c._check()
        self.c._all("rollout copy: snapshot", "snapshot_copy", self.taken)
        return self.taken

    def load(self, snapshot: int) -> None:
        self.c._check()
        self.c._all("rollout copy: load", "load_copy", snapshot)

    def close(self) -> None:
        pass  # the copies end with the workers
