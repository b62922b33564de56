"""Scale-out on Ray: the on-policy roles as Ray actors in a placement group (docs/cluster.md).

Only this package imports ray. :func:`posttrain.cluster.launch.wants_ray` decides (without
importing ray) whether a run goes to Ray; :func:`build_cluster` then returns a
:class:`~posttrain.cluster.group.Cluster` whose ``policy`` has the same role objects as the
in-process session (``actor``, ``reference``, ``rollout``) and whose ``rule_reward`` has
RuleReward's interface, so the one on-policy loop drives both.
"""

from __future__ import annotations


def build_cluster(cfg, layout, *, uses_reference: bool, device: str, train_dtype: str, rollout_dtype: str):
    try:
        import ray  # noqa: F401
    except ImportError as err:
        from posttrain.errors import ConfigError

        raise ConfigError("this run needs Ray (actor_resource.num_npus > 1, rl_config.ray_address or RAY_ADDRESS) "
                          "but ray is not installed: pip install 'posttrain[ray]'") from err
    from posttrain.cluster.group import Cluster

    return Cluster(cfg, layout, uses_reference=uses_reference, device=device, train_dtype=train_dtype,
                   rollout_dtype=rollout_dtype)
