"""``rl_config.rollout_engine: auto`` (the default): which engine it stands for on a device, and
whether the ``vllm`` package is there (without importing it). Kept apart from
:mod:`posttrain.config.vllm` (the vLLM checks) because the compatibility table needs the choice
(:func:`posttrain.config.compat.setup_of`) and the vLLM checks need the table."""

from __future__ import annotations

import importlib.util
import sys

from posttrain.config.backend import model_parallel
from posttrain.config.run import RunConfig
from posttrain.config.stages import stage_named
from posttrain.rollout.vllm_support import INSTALL


def vllm_installed() -> bool:
    """Whether ``import vllm`` can work here (a module already imported counts; ``None`` in
    ``sys.modules`` blocks the import)."""
    if sys.modules.get("vllm") is not None:
        return True
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def auto_engine(cfg: RunConfig, device_type: str, *, here: bool = True) -> str:
    """The engine ``rl_config.rollout_engine: auto`` (the default) stands for: vLLM on a GPU where
    the layout runs it (the megatron backend with ``infer_tensor_parallel_size`` at most TP x PP:
    the replica's GPUs; the hf backend at infer TP 1: a worker holds one GPU) and the vllm package
    is there (or the plan is for another machine, ``here`` False), so that rollout is sharded by
    default at scale, as in the seed; else the native engine (on a CPU it samples as fast as vLLM
    in bf16 and faster in fp32, docs/performance.md)."""
    return "vllm" if _vllm_wanted(cfg, device_type) and (not here or vllm_installed()) else "native"


def _vllm_wanted(cfg: RunConfig, device_type: str) -> bool:
    tp, par = cfg.generate.infer_tensor_parallel_size, model_parallel(cfg)
    fits = tp <= par.model_parallel if par.backend == "megatron" else tp == 1
    return device_type == "cuda" and fits and stage_named(cfg.actor.stage or cfg.actor.algorithm).on_policy


def resolve_engine(cfg: RunConfig, device_type: str, *, here: bool = True) -> list[str]:
    """``rl_config.rollout_engine: auto`` made concrete in place (:func:`auto_engine`), before any
    check reads it; returns the start-up warning when a GPU run falls back for want of vllm."""
    rl = cfg.rl
    if rl.rollout_engine != "auto":
        return []
    rl.rollout_engine = auto_engine(cfg, device_type, here=here)
    if rl.rollout_engine == "native" and _vllm_wanted(cfg, device_type):
        tp = cfg.generate.infer_tensor_parallel_size
        return [f"rl_config.rollout_engine: auto chose native: on a GPU it would run vLLM (the seed's rollout, sharded "
                f"over generate_config.infer_tensor_parallel_size={tp}), but the vllm package is not installed here "
                f"({INSTALL}); set rollout_engine: native to silence this"]
    return []
