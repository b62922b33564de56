"""The off-policy keys of ``rl_config``: ``async_staleness``, ``separate_rollout_worker``,
``partial_rollout_max_split`` (with ``require_max_age_all_finished``) and ``rollout_correction*``.

``async_staleness: k`` runs the rollout of iteration ``i`` with the policy of iteration
``max(0, i - 1 - k)`` on a second copy of the weights, in a thread, while the trainer updates
(:mod:`posttrain.loops.pipeline`); ``separate_rollout_worker: true`` puts that replica in a Ray
worker process (:mod:`posttrain.cluster.rollout_worker`). ``partial_rollout_max_split: N`` splits long generations
over iterations (:mod:`posttrain.loops.partial_rollout`). ``rollout_correction`` weights or masks the policy loss by
the ratio between the trainer's old log-probs and the rollout's (:mod:`posttrain.algo.rollout_correction`).
docs/async.md has the modes and their guarantees.

The values each key takes are declared on its field (:mod:`posttrain.config.sections`); where the
modes run (the stage, Ray, the rollout engine, the backend, LoRA, dynamic sampling) is in the
compatibility table (:mod:`posttrain.config.compat`). This module keeps what reads the machine or
two values: the ``ray`` package of a rollout worker, a split longer than a response, the warnings.
"""

from __future__ import annotations

import importlib.util

from posttrain.config.run import RunConfig
from posttrain.config.separated import rollout_worker
from posttrain.errors import ConfigError


def check_async(cfg: RunConfig) -> list[str]:
    """Raise ConfigError on an off-policy setting that cannot run here; return the start-up warnings."""
    rl = cfg.rl
    check_partial_rollout(cfg)
    if rollout_worker(cfg) and importlib.util.find_spec("ray") is None:
        raise ConfigError("rl_config.separate_rollout_worker: true puts the rollout in a Ray worker process, but ray "
                          "is not installed: pip install 'posttrain[ray]'")
    k = rl.async_staleness
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


def check_partial_rollout(cfg: RunConfig) -> None:
    """``partial_rollout_max_split`` N > 1: a round generates at least one token (rule 20 is in
    validate.py; where it runs, in the compatibility table)."""
    split, max_tokens = cfg.rl.partial_rollout_max_split, cfg.generate.sampling_config.max_tokens
    if split > 1 and split > max_tokens:
        raise ConfigError(f"rl_config.partial_rollout_max_split={split} is more than sampling_config.max_tokens="
                          f"{max_tokens}: a round must generate at least one token; lower it")
