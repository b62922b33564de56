"""The one config check that ``posttrain plan`` and ``posttrain train`` both run.

In order: the seed's rules with the seed's messages (:mod:`posttrain.config.validate`), the stage's
own rules (:mod:`posttrain.config.stages`), the features posttrain refuses until they work
(:mod:`posttrain.config.features`), and the limits of the layouts that run today. The first broken
rule raises a :class:`~posttrain.errors.ConfigError`; knobs that have no effect on this hardware
come back as one warning.
"""

from __future__ import annotations

from posttrain.config.features import check_features, startup_warnings
from posttrain.config.run import RunConfig
from posttrain.config.stages import stage_named
from posttrain.config.validate import Layout, validate_run_config
from posttrain.errors import ConfigError


def check_run_config(cfg: RunConfig, *, device_type: str = "cpu") -> tuple[Layout, list[str]]:
    """Raise on the first broken rule; return the device layout and the start-up warnings."""
    layout = validate_run_config(cfg, device_type=device_type)
    stage = stage_named(cfg.actor.stage or cfg.actor.algorithm)
    stage.check(cfg)
    check_features(cfg, device_type=device_type)
    _check_workers(cfg, stage.on_policy, stage.uses_critic)
    return layout, startup_warnings(cfg, device_type)


def _check_workers(cfg: RunConfig, on_policy: bool, uses_critic: bool) -> None:
    """What the worker groups can run today (data parallel, one actor group)."""
    from posttrain.config.plan import uses_ray

    rl = cfg.rl
    if rl.ray_sharding not in ("ddp", "fsdp2"):
        raise ConfigError(f"rl_config.ray_sharding={rl.ray_sharding!r}: unknown; use ddp or fsdp2")
    if not uses_ray(cfg):
        return
    workers = rl.actor_resource.num_npus or 1
    if not on_policy:
        raise ConfigError(f"rl_config.actor_resource.num_npus={workers}: stage {cfg.stage} runs in one process; "
                          f"set num_npus to 1 (and no ray_address / RAY_ADDRESS)")
    if uses_critic:
        raise ConfigError(f"rl_config.actor_resource.num_npus={workers}: PPO's critic does not run on Ray workers "
                          f"yet; run ray_ppo in one process (num_npus: 1 and no ray_address / RAY_ADDRESS)")
    rows = rl.mini_batch_size * rl.n_samples_per_prompt
    if rows % workers:
        raise ConfigError(f"rl_config.mini_batch_size x n_samples_per_prompt = {rows} rows cannot be shared "
                          f"equally by {workers} actor workers (rl_config.actor_resource.num_npus); make it a "
                          f"multiple of the worker count")
