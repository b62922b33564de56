"""The off-policy keys of ``rl_config``: ``async_staleness``, ``use_integrated_worker``,
``partial_rollout_max_split`` (with ``require_max_age_all_finished``) and ``rollout_correction*``.

``async_staleness: k`` runs the rollout of iteration ``i`` with the policy of iteration
``max(0, i - 1 - k)`` on a second copy of the weights, in a thread, while the trainer updates
(:mod:`posttrain.trainers.pipeline`); ``use_integrated_worker: false`` puts that replica in a Ray
worker process (:mod:`posttrain.cluster.rollout_worker`). ``partial_rollout_max_split: N`` splits long generations
over iterations (:mod:`posttrain.trainers.partial_rollout`). ``rollout_correction`` weights or masks the policy loss by
the ratio between the trainer's old log-probs and the rollout's (:mod:`posttrain.algo.rollout_correction`).
docs/async.md has the modes and their guarantees.
"""

from __future__ import annotations

import math

from posttrain.algo.rollout_correction import LEVELS, MODES
from posttrain.config.run import RunConfig
from posttrain.errors import ConfigError


def check_async(cfg: RunConfig, *, on_policy: bool, backend: str, use_ray: bool) -> list[str]:
    """Raise ConfigError on an off-policy setting that cannot run; return the start-up warnings."""
    rl = cfg.rl
    if rl.rollout_correction not in MODES:
        raise ConfigError(f"rl_config.rollout_correction={rl.rollout_correction!r}: must be one of "
                          f"{', '.join(MODES)}")
    if rl.rollout_correction_level not in LEVELS:
        raise ConfigError(f"rl_config.rollout_correction_level={rl.rollout_correction_level!r}: must be one of "
                          f"{', '.join(LEVELS)}")
    cap = rl.rollout_correction_cap
    if not (math.isfinite(cap) and cap > 1.0):
        raise ConfigError(f"rl_config.rollout_correction_cap={cap}: must be a finite number > 1 (tis caps the "
                          f"ratio at C; mis keeps tokens whose ratio is in [1/C, C])")
    check_partial_rollout(cfg, backend=backend, use_ray=use_ray)
    k = rl.async_staleness
    if k is not None and k < 0:
        raise ConfigError(f"rl_config.async_staleness={k}: must be >= 0 (0: the rollout uses the latest weights; "
                          f"k: weights at most k updates old); remove the key for synchronous training")
    for key, active in (("async_staleness", k is not None), ("use_integrated_worker: false", not rl.use_integrated_worker)):
        if active:
            _check_rollout_replica(cfg, key, on_policy=on_policy, backend=backend, use_ray=use_ray)
    if k is None:
        return []
    warnings = []
    if k == 0:
        warnings.append("rl_config.async_staleness=0: every rollout waits for the latest weights, so rollout and "
                        "update never overlap; this is the asynchronous pipeline run synchronously (a baseline); "
                        "set it to 1 or more to overlap them")
    elif (cfg.actor.train_iters or 0) <= 1:
        warnings.append("rl_config.async_staleness: a run of one iteration has nothing to overlap; it runs "
                        "synchronously")
    return warnings


def _check_rollout_replica(cfg: RunConfig, key: str, *, on_policy: bool, backend: str, use_ray: bool) -> None:
    """The rollout on a replica of the weights (a copy, or a rollout worker process) runs where
    the replica is an HF model that the native engine samples from."""
    import importlib.util

    rl = cfg.rl
    refused = [(not on_policy, "is for the on-policy stages (grpo, dapo, ppo), which roll out; remove it"),
               (use_ray, "with Ray actor workers is not built yet: the trainer runs in this process (no "
                         "actor_resource.num_npus > 1, no ray_address)"),
               (rl.rollout_engine != "native", f"runs on the native rollout engine, not {rl.rollout_engine!r}"),
               (backend != "hf", "runs on the hf training backend (the rollout replica is an HF model)"),
               (bool(cfg.actor.lora_target_modules), f"with LoRA is not supported yet (the rollout replica would merge "
                                                     f"the adapter); remove lora_target_modules or {key}"),
               (not rl.use_integrated_worker and importlib.util.find_spec("ray") is None,
                "puts the rollout in a Ray worker process, but ray is not installed: pip install 'posttrain[ray]'")]
    for bad, why in refused:
        if bad:
            raise ConfigError(f"rl_config.{key} {why}")


def check_partial_rollout(cfg: RunConfig, *, backend: str, use_ray: bool) -> None:
    """``partial_rollout_max_split``: >= 1, and N > 1 only where it runs (rule 20 is in validate.py)."""
    rl, max_tokens = cfg.rl, cfg.generate.sampling_config.max_tokens
    split = rl.partial_rollout_max_split
    if split < 1:
        raise ConfigError(f"rl_config.partial_rollout_max_split={split}: must be >= 1 (1: off)")
    if split == 1:
        return
    if split > max_tokens:
        raise ConfigError(f"rl_config.partial_rollout_max_split={split} is more than sampling_config.max_tokens="
                          f"{max_tokens}: a round must generate at least one token; lower it")
    refused = [(use_ray, "on Ray is not built yet; run it in one process (no actor_resource.num_npus > 1, no "
                         "ray_address)"),
               (rl.rollout_engine != "native", f"runs on the native rollout engine, not {rl.rollout_engine!r}"),
               (backend != "hf", "runs on the hf training backend"),
               (rl.filter_groups_enable, "with DAPO's dynamic sampling (filter_groups_enable) is not supported yet; "
                                         "turn one of them off")]
    for bad, why in refused:
        if bad:
            raise ConfigError(f"rl_config.partial_rollout_max_split > 1 {why}")
