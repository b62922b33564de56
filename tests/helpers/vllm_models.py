"""Tiny Qwen2 models that vLLM's CPU kernels take (head dim 64), for tests/vllm."""

from __future__ import annotations

from pathlib import Path


def vllm_qwen2(vocab_size: int, *, tied: bool, seed: int = 0, **config):
    """A random 2-layer Qwen2 (hidden 128, 2 heads of 64, 1 KV head); ``config`` overrides its config."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(**{**dict(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                                   tie_word_embeddings=tied), **config})
    return Qwen2ForCausalLM(config).eval()


def write_vllm_world(root: Path, tokenizer, rows: int, data: str) -> Path:
    """``root/model``: :func:`vllm_qwen2` (tied) with ``tokenizer``; ``root/<data>``: ``rows`` random
    additions (seed 0, the ``trl`` prompt) preprocessed. Returns ``root``."""
    from tests.helpers.data import addition_rows, preprocess_prompts

    vllm_qwen2(len(tokenizer), tied=True, pad_token_id=tokenizer.pad_token_id,
               eos_token_id=tokenizer.eos_token_id).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    (root / data).parent.mkdir(parents=True, exist_ok=True)
    preprocess_prompts(addition_rows(rows, 0), root / f"{data}.jsonl", root / "model", root / data,
                       prompt_type="trl", workers=1)
    return root
