"""Scale-out on Ray: the on-policy roles as Ray actors in a placement group (docs/cluster.md).

Only this package imports ray. The plan decides (without importing ray) whether a run goes to Ray
(:func:`posttrain.config.check.uses_ray`); :func:`build_cluster` then returns a
:class:`~posttrain.cluster.group.Cluster` whose ``policy`` is a
:class:`~posttrain.roles.policy.Policy` with the same role methods as the in-process one
(``actor``, ``reference``, ``rollout``), whose ``rule_reward`` has RuleReward's interface and whose
``reward_model`` has RewardModelScorer's ``score_sequences``, so the one on-policy loop drives both.
"""

from __future__ import annotations

from posttrain.extras import require


def build_cluster(plan, start: dict):
    require("ray", "this run on Ray (actor_resource.num_npus > 1, rl_config.ray_address or RAY_ADDRESS)")
    from posttrain.cluster.group import Cluster  # lazy: torch; cluster submodules import this __init__

    return Cluster(plan, start)
