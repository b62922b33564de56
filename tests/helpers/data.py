"""Prompt and pair rows for the loop tests, and their preprocessing with the real pipeline."""

from __future__ import annotations

import json
import random
from pathlib import Path

LETTERS = "abcdefghij"


def addition(a: int, b: int) -> dict:
    """One prompt row: ``What is a + b?`` with the sum as its answer (the label)."""
    return {"problem": f"What is {a} + {b}?", "answer": str(a + b)}


def random_addition(rng: random.Random) -> dict:
    """An :func:`addition` of two digits drawn from ``rng``."""
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return addition(a, b)


def addition_rows(n: int, seed: int = 0) -> list[dict]:
    """``n`` :func:`random_addition` rows from ``random.Random(seed)``."""
    rng = random.Random(seed)
    return [random_addition(rng) for _ in range(n)]


def letter_pair(rng: random.Random) -> dict:
    """A preference pair: ``Repeat the letter x``, chosen ``x``, rejected another letter (from ``rng``)."""
    right, wrong = rng.sample(LETTERS, 2)
    return {"problem": f"Repeat the letter {right}", "chosen": right, "rejected": wrong}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def preprocess_prompts(rows: list[dict], jsonl: Path, tokenizer: str | Path, output_prefix: str | Path, *,
                       prompt_type: str, workers: int | None = None) -> str:
    """Write ``rows`` to ``jsonl`` and preprocess them into an RL prompt dataset (``input_ids`` and the
    answers as ``labels``) with the tokenizer in ``tokenizer``; returns ``output_prefix``."""
    from posttrain.data.preprocess import preprocess

    write_jsonl(jsonl, rows)
    config = {"input": str(jsonl), "handler_name": "R1AlpacaStyleInstructionHandler",
              "tokenizer_name_or_path": str(tokenizer), "prompt_type": prompt_type,
              "output_prefix": str(output_prefix), "map_keys": {"prompt": "problem", "response": "answer"},
              "dataset_additional_keys": ["labels"]}
    if workers is not None:
        config["workers"] = workers
    preprocess(config, progress=False)
    return str(output_prefix)
