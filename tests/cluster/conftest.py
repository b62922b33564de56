"""Fixtures for the Ray tests: one local Ray cluster per module (2 CPUs, one per actor worker), a
2-layer random-init Qwen2 with the tiny tokenizer, and a prompt dataset."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.data import addition_rows, preprocess_prompts

ROOT = Path(__file__).resolve().parents[2]  # the workers import tests.helpers.verifiers (the e2e_lowercase reward)


@pytest.fixture(scope="module")
def ray_cluster(request):
    """A local Ray cluster for one test module (shut down after it, so later tests run without it):
    2 CPUs, or the module's ``RAY_CPUS`` (Ray's CPUs are logical: 4 workers share the machine's cores)."""
    import ray  # installed by `make install` (the ray extra); CI runs these tests
    import torch

    # the workers import tests.helpers.verifiers by name: the driver's PYTHONPATH reaches them
    path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), path) if p)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    ray.init(num_cpus=getattr(request.module, "RAY_CPUS", 2), include_dashboard=False, logging_level="WARNING",
             runtime_env={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"], "HF_HUB_OFFLINE": "1",
                                       "TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    ray.shutdown()
    torch.set_num_threads(before)
    os.environ["PYTHONPATH"] = path


@pytest.fixture(scope="session")
def work(tmp_path_factory, mini_qwen2_dir):
    """A 2-layer Qwen2 (hidden 64) saved with the tiny tokenizer, and a preprocessed prompt set."""
    import shutil

    root = tmp_path_factory.mktemp("cluster")
    shutil.copytree(mini_qwen2_dir, root / "model")
    preprocess_prompts(addition_rows(128, 0), root / "prompts.jsonl", root / "model", root / "prompts/data",
                       prompt_type="trl", workers=1)
    return root
