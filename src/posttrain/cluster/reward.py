"""Rule-reward scoring on CPU Ray actors, one per node (as the seed's RuleReward actors).

Each :class:`RewardWorker` owns a :class:`~posttrain.reward.rule_reward.RuleReward` (and its
verifier process pool) on its node. :class:`RewardGroup` has RuleReward's ``score_detailed`` /
``score`` / ``close``: a call is split into one contiguous share per worker and the results are
merged back in order.
"""

from __future__ import annotations

import logging

from posttrain.cluster.remote import ClusterError, gather
from posttrain.reward.rule_reward import RewardBatch, RuleReward

log = logging.getLogger(__name__)


class RewardWorker:
    def __init__(self, options):
        self.reward = RuleReward.from_options(options)

    def score_detailed(self, responses, labels, prompts=None, response_lengths=None, **columns):
        return self.reward.score_detailed(responses, labels, prompts, response_lengths=response_lengths, **columns)

    def close(self) -> None:
        self.reward.close()


def merge(parts: list, sizes: list[int]):
    """One RewardBatch from per-worker ones: lists concatenated, ``*/mean`` metrics weighted by
    the number of samples, counts summed."""
    if len(parts) == 1:
        return parts[0]
    total = sum(sizes)
    metrics: dict[str, float] = {}
    for part, size in zip(parts, sizes):
        for key, value in part.metrics.items():
            share = value * size / total if key.endswith("/mean") else value
            metrics[key] = metrics.get(key, 0.0) + share
    return RewardBatch(scores=[s for p in parts for s in p.scores],
                       per_verifier={k: [v for p in parts for v in p.per_verifier[k]] for k in parts[0].per_verifier},
                       status={k: [v for p in parts for v in p.status[k]] for k in parts[0].status},
                       metrics=metrics, errors=sorted({e for p in parts for e in p.errors})[:5])


class RewardGroup:
    """RuleReward's interface over one reward worker per alive node of the Ray cluster."""

    def __init__(self, options, timeout_s: float):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
        remote = ray.remote(RewardWorker)
        # num_cpus=0: the actor itself only waits on its verifier processes; it must not take a
        # CPU the actor workers' placement group needs
        self.workers = [remote.options(num_cpus=0, max_restarts=0,
                                       scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
                                       ).remote(options) for node in nodes]
        self.names = [f"reward worker on node {node[:8]}" for node in nodes]
        self.nodes = nodes
        self.timeout_s = timeout_s
        self.closed = False

    def score_detailed(self, responses, labels, prompts=None, response_lengths=None, **columns):
        count, k = len(responses), len(self.workers)
        bounds = [count * i // k for i in range(k + 1)]
        spans = [(bounds[i], bounds[i + 1]) for i in range(k) if bounds[i + 1] > bounds[i]] or [(0, 0)]

        def cut(values, lo, hi):
            return None if values is None else list(values)[lo:hi]

        refs = [self.workers[i].score_detailed.remote(
            responses[lo:hi], labels[lo:hi], cut(prompts, lo, hi), cut(response_lengths, lo, hi),
            **{name: cut(col, lo, hi) for name, col in columns.items()}) for i, (lo, hi) in enumerate(spans)]
        parts = gather(refs, self.names[:len(refs)], "rule reward", self.timeout_s, nodes=self.nodes[:len(refs)])
        return merge(parts, [hi - lo for lo, hi in spans])

    def score(self, responses, labels, prompts=None, **columns):
        batch = self.score_detailed(responses, labels, prompts, **columns)
        return batch.scores, batch.metrics

    def close(self) -> None:
        import ray

        if self.closed:
            return
        self.closed = True
        for worker in self.workers:
            try:
                ray.get(worker.close.remote(), timeout=10)
            except Exception as err:  # noqa: BLE001 - best effort; the actor is killed next
                log.debug("reward worker close: %s", err)
            ray.kill(worker)


__all__ = ["ClusterError", "RewardGroup", "RewardWorker", "merge"]
