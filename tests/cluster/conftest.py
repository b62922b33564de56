"""Fixtures for the Ray tests: one local Ray cluster per module (2 CPUs, one per actor worker), a
2-layer random-init Qwen2 with the tiny tokenizer, and a prompt dataset."""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest

E2E = Path(__file__).resolve().parents[1] / "e2e"  # e2e_algo_verifiers: the graded e2e_lowercase reward


@pytest.fixture(scope="module")
def ray_cluster(request):
    """A local Ray cluster for one test module (shut down after it, so later tests run without it):
    2 CPUs, or the module's ``RAY_CPUS`` (Ray's CPUs are logical: 4 workers share the machine's cores)."""
    import ray  # installed by `make install` (the ray extra); CI runs these tests
    import torch

    # the workers import e2e_algo_verifiers by name: the driver's PYTHONPATH reaches them
    path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(E2E), path) if p)
    if str(E2E) not in sys.path:
        sys.path.insert(0, str(E2E))
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

    from posttrain.data.preprocess import preprocess

    root = tmp_path_factory.mktemp("cluster")
    shutil.copytree(mini_qwen2_dir, root / "model")
    rng = random.Random(0)
    rows = []
    for _ in range(128):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"problem": f"What is {a} + {b}?", "answer": str(a + b)})
    (root / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    preprocess({"input": str(root / "prompts.jsonl"), "handler_name": "R1AlpacaStyleInstructionHandler",
                "output_prefix": str(root / "prompts/data"), "map_keys": {"prompt": "problem", "response": "answer"},
                "dataset_additional_keys": ["labels"], "tokenizer_name_or_path": str(root / "model"),
                "prompt_type": "trl", "workers": 1}, progress=False)
    return root
