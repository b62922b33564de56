"""Fixtures for loop tests: tiny prompt datasets preprocessed with the real pipeline."""

from __future__ import annotations

import json
import random

import pytest


def addition_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"problem": f"What is {a} + {b}?", "answer": str(a + b)})
    return rows


@pytest.fixture(scope="session")
def tiny_prompt_data(tmp_path_factory, tiny_model_dir):
    """Prefix of an RL prompt dataset (input_ids + labels) for the tiny tokenizer."""
    from posttrain.data.preprocess import preprocess

    root = tmp_path_factory.mktemp("tiny_data")
    src = root / "rl.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in addition_rows(64, 0)))
    preprocess({"input": str(src), "handler_name": "R1AlpacaStyleInstructionHandler",
                "tokenizer_name_or_path": str(tiny_model_dir), "prompt_type": "default",
                "output_prefix": str(root / "rl" / "data"), "map_keys": {"prompt": "problem", "response": "answer"},
                "dataset_additional_keys": ["labels"]}, progress=False)
    return str(root / "rl" / "data")
