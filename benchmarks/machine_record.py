"""What a benchmark records about the machine it ran on: the CPU model and its relevant flags, the
load average, the torch version and thread count. A shared machine makes every timing noisy, so
every result carries these (the other processes' CPU use during a run is measured by
``posttrain.commands.bench.CpuMeter``, from ``/proc/stat``)."""

from __future__ import annotations

from pathlib import Path

FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (empty where ``/proc/loadavg`` is missing)."""
    path = Path("/proc/loadavg")
    return [float(x) for x in path.read_text().split()[:3]] if path.exists() else []


def cpu() -> dict:
    """The CPU model, which of ``FLAGS`` it has, and its logical CPU count."""
    path = Path("/proc/cpuinfo")
    lines = path.read_text().splitlines() if path.exists() else []
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    count = sum(1 for line in lines if line.startswith("processor"))
    return {"cpu": model, "flags": [f for f in FLAGS if f in flags], "cpus": count}


def machine(threads: int | None = None) -> dict:
    """:func:`cpu` plus the load average now, the torch version and ``threads``."""
    import torch

    return {**cpu(), "loadavg": load_average(), "torch": torch.__version__,
            "threads": threads if threads is not None else torch.get_num_threads()}


def available_gib() -> float | None:
    """``MemAvailable`` of ``/proc/meminfo`` in GiB (None where it cannot be read)."""
    path = Path("/proc/meminfo")
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return None
