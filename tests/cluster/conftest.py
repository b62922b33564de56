"""Fixtures for the Ray tests: one local Ray cluster per module (2 CPUs, one per actor worker), a
two-node Ray cluster for the multi-node module (a head and a second node as separate processes, 1 CPU each),
a 2-layer random-init Qwen2 with the tiny tokenizer, and a prompt dataset."""

from __future__ import annotations


import pytest

from tests.helpers.data import addition_rows, preprocess_prompts
from tests.helpers.local_ray import local_ray
from tests.helpers.ray_nodes import ROOT, RayNodes, ensure_token



@pytest.fixture(scope="module")
def ray_cluster(request):
    """A local Ray cluster for one test module (shut down after it, so later tests run without it):
    2 CPUs, or the module's ``RAY_CPUS`` (Ray's CPUs are logical: 4 workers share the machine's cores)."""
    with local_ray(getattr(request.module, "RAY_CPUS", 2)) as ray:
        yield ray


@pytest.fixture(scope="module")
def ray_nodes():
    """For one module (its daemons stopped after it, so later tests run without them): a Ray head
    and a second Ray node, each a ``ray start`` of its own with 1 CPU, its own ports and temporary
    directory (tests/helpers/ray_nodes.py), alive; the test process joins only through
    posttrain (``rl_config.ray_address``), so it gets the checkout on ``PYTHONPATH`` (the workers
    import the test verifiers), token auth as the nodes, and 1 torch thread. Every process the
    fixture started is killed by pid afterwards. A test may stop a node and start another
    (``ray_nodes.start(name)``); the alive ones are those not ``stopped``."""
    import os

    import torch

    ensure_token()
    saved = {key: os.environ.get(key) for key in ("PYTHONPATH", "RAY_AUTH_MODE")}
    threads = torch.get_num_threads()
    cluster = RayNodes()
    try:
        cluster.start("head")
        cluster.start("second")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), saved["PYTHONPATH"]) if p)
        os.environ["RAY_AUTH_MODE"] = "token"
        torch.set_num_threads(1)
        yield cluster
    finally:
        cluster.close()
        torch.set_num_threads(threads)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="session")
def work(tmp_path_factory, mini_qwen2_dir):
    """A 2-layer Qwen2 (hidden 64) saved with the tiny tokenizer, and a preprocessed prompt set."""
    import shutil

    root = tmp_path_factory.mktemp("cluster")
    shutil.copytree(mini_qwen2_dir, root / "model")
    preprocess_prompts(addition_rows(128, 0), root / "prompts.jsonl", root / "model", root / "prompts/data",
                       prompt_type="trl", workers=1)
    return root
