"""Fixtures for the Ray tests: one local Ray cluster per module (2 CPUs, one per actor worker), a
2-layer random-init Qwen2 with the tiny tokenizer, and a prompt dataset."""

from __future__ import annotations


import pytest

from tests.helpers.data import addition_rows, preprocess_prompts
from tests.helpers.local_ray import local_ray



@pytest.fixture(scope="module")
def ray_cluster(request):
    """A local Ray cluster for one test module (shut down after it, so later tests run without it):
    2 CPUs, or the module's ``RAY_CPUS`` (Ray's CPUs are logical: 4 workers share the machine's cores)."""
    with local_ray(getattr(request.module, "RAY_CPUS", 2)) as ray:
        yield ray


@pytest.fixture(scope="session")
def work(tmp_path_factory, mini_qwen2_dir):
    """A 2-layer Qwen2 (hidden 64) saved with the tiny tokenizer, and a preprocessed prompt set."""
    import shutil

    root = tmp_path_factory.mktemp("cluster")
    shutil.copytree(mini_qwen2_dir, root / "model")
    preprocess_prompts(addition_rows(128, 0), root / "prompts.jsonl", root / "model", root / "prompts/data",
                       prompt_type="trl", workers=1)
    return root
