"""A local Ray cluster for a test module (tests/cluster, tests/vllm)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the workers import tests.helpers (verifiers) by name


@contextlib.contextmanager
def local_ray(num_cpus: int, **env: str):
    """Ray with ``num_cpus`` logical CPUs, shut down afterwards; the driver at 1 torch thread, the
    workers with the checkout on ``PYTHONPATH``, offline, and the extra ``env`` variables."""
    import ray  # installed by `make install` (the ray extra); CI runs these tests
    import torch

    path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), path) if p)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level="WARNING",
             runtime_env={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"], "HF_HUB_OFFLINE": "1",
                                       "TOKENIZERS_PARALLELISM": "false", **env}})
    try:
        yield ray
    finally:
        ray.shutdown()
        torch.set_num_threads(before)
        os.environ["PYTHONPATH"] = path
