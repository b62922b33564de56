"""The torch device and the precision a run uses on it.

``auto`` means CUDA when available, else CPU. Precision is chosen from the hardware: on a CPU,
bf16 only where the config asks for it explicitly and the CPU has bf16 matmul units (AMX or
AVX512-BF16; elsewhere emulated bf16 is far slower than fp32); on a GPU, the config's ``bf16``
and ``generate_config.dtype``.
"""

from __future__ import annotations

from pathlib import Path

from posttrain.errors import ConfigError


def resolve_device(name: str = "auto") -> str:
    """``auto`` -> ``cuda`` if a GPU is visible, else ``cpu``; other names pass through."""
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def device_type(name: str = "auto") -> str:
    return resolve_device(name).split(":")[0]


def cpu_supports_bf16() -> bool:
    """AMX or AVX512-BF16 on this CPU (where a bf16 matmul beats fp32)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def cuda_supports_bf16(device: str) -> bool:
    """Whether the GPU ``device`` computes in bf16 natively (compute capability 8.0 or newer)."""
    import torch

    if not torch.cuda.is_available():
        return True  # nothing to check on this machine (the plan may be for another one)
    return bool(torch.cuda.is_bf16_supported(including_emulation=False))


def precision(device: str, *, bf16: bool, bf16_asked: bool, rollout_dtype: str,
              rollout_dtype_asked: bool) -> tuple[str, str]:
    """(training dtype, rollout dtype). ``bf16`` / ``rollout_dtype`` are the config's values and
    ``*_asked`` whether the config sets them explicitly (rather than leaving the seed's defaults)."""
    if device.startswith("cpu"):
        bf16 = bf16 and bf16_asked and cpu_supports_bf16()
        if not rollout_dtype_asked or not cpu_supports_bf16():
            rollout_dtype = "float32"
    elif (bf16 or rollout_dtype == "bfloat16") and not cuda_supports_bf16(device):
        key = "megatron_training.bf16: true" if bf16 else "generate_config.dtype: bfloat16"
        raise ConfigError(f"{key}: this GPU ({device}) has no bf16 support (it needs compute capability 8.0, "
                          "Ampere, or newer); set megatron_training.bf16: false and generate_config.dtype: "
                          "float32 (fp16 training is not available)")
    return ("bfloat16" if bf16 else "float32"), ("bfloat16" if rollout_dtype == "bfloat16" else "float32")
