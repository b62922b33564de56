"""The torch device, the precision a run uses on it, and its CPU threads.

``auto`` means CUDA when available, else CPU. Precision is chosen from the hardware: the config's
``bf16`` and ``generate_config.dtype`` (the seed's defaults: bf16 for both) where the device
computes bf16 natively: a GPU of compute capability 8.0 or newer, a CPU with AMX or AVX512-BF16
(whose bf16 matmul peak is several times fp32's). A CPU without them runs in fp32 (emulated bf16
is far slower than fp32 there); a GPU without them refuses bf16. Threads (:func:`cpu_threads`):
the cores other processes leave free when the run starts, since two OpenMP threads on a 2-core
machine where another process holds a core run 3-5x slower than one. :func:`best_seconds` times a
kernel the way the matmul peak and the CPU linear kernel's choice measure it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from posttrain.errors import ConfigError


def best_seconds(fn, seconds: float, sync=None) -> float:
    """The fastest of repeated calls of ``fn`` over about ``seconds`` (at least 3 calls); ``sync``
    (e.g. ``torch.cuda.synchronize``) runs around each call. On a shared machine the best repeat is
    the one that got the cores."""
    sync = sync or (lambda: None)
    best, deadline, count = float("inf"), time.perf_counter() + seconds, 0
    while count < 3 or time.perf_counter() < deadline:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
        count += 1
    return best


def resolve_device(name: str = "auto") -> str:
    """``auto`` -> ``cuda`` if a GPU is visible, else ``cpu``; other names pass through."""
    if name != "auto":
        return name
    import torch  # lazy: config/ imports device.py without torch

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


def cuda_supports_bf16() -> bool:
    """Whether this process's GPU computes in bf16 natively (compute capability 8.0 or newer)."""
    import torch  # lazy: as in resolve_device

    if not torch.cuda.is_available():
        return True  # nothing to check on this machine (the plan may be for another one)
    return bool(torch.cuda.is_bf16_supported(including_emulation=False))


def precision(device: str, *, bf16: bool, rollout_dtype: str, native_bf16: bool | None = None) -> tuple[str, str]:
    """(training dtype, rollout dtype) from the config's ``bf16`` and ``generate_config.dtype``:
    kept where ``device`` computes bf16 natively; fp32 on a CPU without bf16 matmul units; refused
    on a GPU without them. ``native_bf16``: whether it does, for a device that is not this machine's
    (``posttrain plan --target``); None asks this machine."""
    native = native_bf16 if native_bf16 is not None else (
        cpu_supports_bf16() if device.startswith("cpu") else cuda_supports_bf16())
    if device.startswith("cpu"):
        if not native:
            bf16, rollout_dtype = False, "float32"
    elif (bf16 or rollout_dtype == "bfloat16") and not native:
        key = "megatron_training.bf16: true" if bf16 else "generate_config.dtype: bfloat16"
        raise ConfigError(f"{key}: this GPU ({device}) has no bf16 support (it needs compute capability 8.0, "
                          "Ampere, or newer); set megatron_training.bf16: false and generate_config.dtype: "
                          "float32 (fp16 training is not available)")
    return ("bfloat16" if bf16 else "float32"), ("bfloat16" if rollout_dtype == "bfloat16" else "float32")


def machine_busy_seconds() -> float:
    """Busy CPU seconds of the whole machine since boot (the ``cpu`` line of ``/proc/stat`` but
    idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # user nice system idle iowait irq softirq steal


def free_cores(seconds: float = 0.3) -> int:
    """The cores of this process's CPU set that other processes left idle over ``seconds`` (at
    least 1); all of them where ``/proc/stat`` cannot be read."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        busy0, own0, t0 = machine_busy_seconds(), time.process_time(), time.perf_counter()
        time.sleep(seconds)
        busy, own, wall = machine_busy_seconds() - busy0, time.process_time() - own0, time.perf_counter() - t0
    except (OSError, ValueError, IndexError):
        return cores
    others = max(busy - own, 0.0) / wall
    return max(1, min(cores, round(cores - others)))


def cpu_threads(configured: int | None, stored: int | None, current: int) -> tuple[int, str]:
    """The torch threads of a CPU run, and why: ``rl_config.num_threads`` when set; the ``current``
    count when ``OMP_NUM_THREADS`` pins it; the count a resumed run stored in its checkpoint (so a
    resume reduces in the same order as the run it continues); else the ``current`` count (torch's
    default, or what the caller set) lowered to the cores other processes leave free
    (:func:`free_cores`), chosen once at the start."""
    if configured:
        return int(configured), "rl_config.num_threads"
    if os.environ.get("OMP_NUM_THREADS", "").strip():
        return current, "OMP_NUM_THREADS"
    if stored:
        return int(stored), "the checkpoint"
    free = free_cores()
    return min(current, free), f"{free} core(s) free at the start"
