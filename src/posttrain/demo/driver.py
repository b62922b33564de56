"""Skeleton of the real-model demo: model -> data -> baseline -> train -> held-out comparison.

The training step is passed in (``train_fn(model_dir, train_path, out_dir) -> trained_dir``)
so the driver stays independent of the trainer; the lead's GRPO loop plugs in there.
Both evaluations use :func:`posttrain.demo.evaluate.evaluate` with greedy decoding.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from posttrain.demo.tasks import read_jsonl, write_demo_data

TrainFn = Callable[[Path, Path, Path], Path]


def held_out_accuracy(model_dir: Path, test_path: Path, *, max_new_tokens: int = 16,
                      scorer: str = "demo_lenient", threads: int = 2) -> dict:
    """Greedy accuracy of ``model_dir`` on ``test_path`` (summary dict of EvalResult)."""
    from posttrain.demo.evaluate import evaluate, load_model
    from posttrain.demo.scoring import get_scorer

    model, tokenizer = load_model(model_dir, threads=threads)
    result = evaluate(model, tokenizer, read_jsonl(test_path), max_new_tokens=max_new_tokens,
                      batch_size=10, scorer=get_scorer(scorer))
    return result.summary()


def run_demo(out_dir: str | Path, train_fn: TrainFn, *, model: str = "smollm2-135m-instruct",
             scorer: str = "demo_lenient") -> dict:
    """Run the whole demo; returns and writes ``out_dir/demo_result.json``."""
    from posttrain.models.pretrained import resolve_model

    out = Path(out_dir)
    model_dir = resolve_model(model)
    train_path, test_path = write_demo_data(out / "data")
    before = held_out_accuracy(model_dir, test_path, scorer=scorer)
    trained_dir = train_fn(model_dir, train_path, out / "train")
    after = held_out_accuracy(Path(trained_dir), test_path, scorer=scorer)
    result = {"model": str(model_dir), "trained": str(trained_dir), "before": before,
              "after": after, "gain_points": round(100 * (after["accuracy"] - before["accuracy"]), 1)}
    tmp = out / ".demo_result.json.tmp"
    tmp.write_text(json.dumps(result, indent=2), encoding="utf-8")
    tmp.replace(out / "demo_result.json")
    return result
