"""The rollout tests' tiny model."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def model():
    """A random-init 2-layer Qwen2 with a 96-token vocabulary (built per module: tests change its mode)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return Qwen2ForCausalLM(cfg).float()
