"""Shared fixtures: a tiny tokenizer and a tiny random-init Qwen2, built locally (no downloads)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random-init tiny Qwen2 (hidden 384, 6 layers) with a local BPE tokenizer and chat template."""
    from posttrain.models.init_model import init_model_dir

    out = tmp_path_factory.mktemp("models") / "tiny_qwen2"
    return init_model_dir("tiny_qwen2", out, seed=1234)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="session")
def mini_qwen2_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """A 2-layer Qwen2 (hidden 64, seed 0) saved with the tiny tokenizer: fast enough for loops
    that must learn within a few iterations in a test (tests/e2e, tests/cluster). Read-only: copy it
    before training into it."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("models") / "mini_qwen2"
    tok = tiny_tokenizer
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    Qwen2ForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
