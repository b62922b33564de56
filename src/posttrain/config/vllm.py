"""``rl_config.rollout_engine: vllm``: what the vLLM adapter needs, and what it does with the
``generate_config`` keys (:class:`posttrain.rollout.vllm_engine.VLLMEngine`).

The ``generate_config`` keys whose rule has ``vllm=True`` (:mod:`posttrain.config.sections`) are
neither refused nor warned about by :mod:`posttrain.config.features` under this engine: each is
either passed to ``vllm.LLM`` (:data:`PASSED`) or refused by a ``vllm-*`` row of the compatibility
table (:mod:`posttrain.config.compat`), which also holds the run's shape (the adapter runs in the
trainer's own process, which loads the actor's weights into vLLM after every update: one process,
the hf backend). :func:`check_vllm` checks the machine (the ``vllm`` package and a CUDA device), so
that ``posttrain plan`` and ``posttrain train`` stop before any model is built; it is part of the
one config check (:func:`posttrain.config.check.check_run_config`).
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

from posttrain.config.compat import FEATURES, ROWS
from posttrain.config.run import RunConfig
from posttrain.device import device_type as type_of
from posttrain.errors import ConfigError

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

UNVERIFIED = ("rl_config.rollout_engine: vllm: the vLLM adapter has not run on a GPU in posttrain's tests yet (a fake "
              "vllm module checks its calls: tests/unit/rollout/test_vllm_fake.py); compare a few iterations with "
              "rollout_engine: native before relying on it (docs/rollout.md)")


def engine_kwargs(cfg: RunConfig) -> dict[str, Any]:
    """The :data:`PASSED` keys beyond :data:`COMMON`, as ``VLLMEngine`` arguments."""
    gen = cfg.generate
    return {arg: getattr(gen, key) for key, arg in PASSED.items() if key not in COMMON}


def vllm_installed() -> bool:
    """Whether ``import vllm`` can work here (a module already imported counts; ``None`` in
    ``sys.modules`` blocks the import)."""
    if sys.modules.get("vllm") is not None:
        return True
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def on_cuda(device_type: str) -> bool:
    """Whether the run's device (``rl_config.device`` resolved: cpu or cuda) is a CUDA GPU."""
    return device_type == "cuda"


def check_vllm(cfg: RunConfig, *, device_type: str | None = None) -> list[str]:
    """Raise ConfigError when this machine cannot run the vLLM adapter (no ``vllm`` package, no CUDA
    device); return the start-up warnings. Nothing to check for another engine. ``device_type``: the
    run's (default: ``rl_config.device`` resolved)."""
    rl, gen = cfg.rl, cfg.generate
    if rl.rollout_engine != "vllm":
        return []
    if not vllm_installed():
        raise ConfigError("rl_config.rollout_engine: vllm needs the vllm package, which is not installed here (pip "
                          "install 'posttrain[vllm]', on a Linux machine with CUDA GPUs); use "
                          "rl_config.rollout_engine: native (it runs on any device)")
    if device_type is None:
        device_type = type_of(rl.device)
    if not on_cuda(device_type):
        raise ConfigError(f"rl_config.rollout_engine: vllm needs a CUDA GPU, and this run's device is {device_type} "
                          f"(rl_config.device: {rl.device}); use rl_config.rollout_engine: native (it runs on any "
                          f"device)")
    warnings = [UNVERIFIED]
    sampling = gen.sampling_config
    truncated = sampling.top_k > 0 or sampling.top_p < 1.0 or sampling.min_p > 0.0
    if truncated and rl.rollout_correction != "none":
        warnings.append("rl_config.rollout_correction with rollout_engine: vllm and top_k/top_p/min_p on: vLLM "
                        "reports each token's log-prob under the truncated distribution (logprobs_mode "
                        "processed_logprobs) and the trainer under the untruncated one, so the ratio is off by the "
                        "kept probability mass (docs/rollout.md, vLLM adapter); turn the truncation off "
                        "(top_k: -1, top_p: 1, min_p: 0) for an exact ratio")
    return warnings


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
