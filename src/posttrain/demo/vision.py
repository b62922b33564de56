"""``python -m posttrain.demo --task vision``: a tiny vision-language model learns to count shapes.

The stages, for each seed (``--seed S``, or ``--seeds 1 2 3`` for several, each in ``OUT/seed_S``):

1. the task (:mod:`posttrain.demo.vision_task`): seeded, disjoint train / held-out splits of 56x56
   pictures with 1-4 shapes, written as public multimodal rows (``images`` column, ``<image>``);
2. the model: ``posttrain init-model tiny_qwen25_vl`` (random init, local tokenizer, seeded);
3. the warm start (:func:`posttrain.demo.vision_sft.warm_start`): SFT, stopped once half of a
   check set of training pictures is answered right (``VisionSettings.sft_target``);
4. GRPO (``configs/grpo_tiny_vl_vision_demo.yaml``, ``rl_config.is_multimodal``) from the warm
   start, a checkpoint per iteration;
5. greedy held-out accuracy, strict (the seed's ``acc``: the right ``\\boxed{N}``) and lenient (the
   last number) of the warm start and of every checkpoint;
6. ``vision_metrics.jsonl`` (reward and accuracies per iteration), ``reward_accuracy.png`` and
   ``summary.json`` in the seed's directory; with several seeds ``OUT/summary.json`` gathers them
   and ``OUT/reward_accuracy.png`` plots every seed's accuracies.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from posttrain.checkpoint import TRACKER
from posttrain.commands.init_model import init_model
from posttrain.commands.train import plan_named
from posttrain.data.preprocess import preprocess
from posttrain.data.readers import read_jsonl
from posttrain.demo.vision_sft import greedy_accuracy, warm_start
from posttrain.demo.vision_task import IMAGE_SIZE, QUESTION, make_vision_splits, write_split
from posttrain.files import write_text_atomic
from posttrain.loops.build import train
from posttrain.metrics import plot_metrics

CONFIG = "grpo_tiny_vl_vision_demo"


@dataclass(frozen=True)
class VisionSettings:
    """The sizes of one demo run (the defaults are the measured ones, docs/demo.md)."""

    num_train: int = 2000
    num_test: int = 200
    sft_max_steps: int = 300
    sft_target: float = 0.5  # the warm start stops once this share of training pictures is answered right
    sft_lr: float = 5e-4
    sft_batch_size: int = 32
    image_size: int = IMAGE_SIZE


def prepare(out: Path, seed: int, settings: VisionSettings):
    """The splits (layouts), the train rows preprocessed for GRPO; returns (train, test, data prefix)."""
    train_layouts, test_layouts = make_vision_splits(settings.num_train, settings.num_test, seed, settings.image_size)
    raw = write_split(train_layouts, out / "raw" / "train.jsonl", "train", settings.image_size)
    write_split(test_layouts, out / "raw" / "test.jsonl", "test", settings.image_size)
    prefix = out / "data" / "train"
    preprocess({"input": str(raw), "handler_name": "R1AlpacaStyleInstructionHandler",
                "tokenizer_name_or_path": str(out / "model_init"), "prompt_type": "qwen2_vl",
                "map_keys": {"prompt": "prompt", "response": "answer"}, "dataset_additional_keys": ["labels"],
                "output_prefix": str(prefix), "workers": 1}, progress=False)
    return train_layouts, test_layouts, str(prefix)


def checkpoints(save: Path) -> list[tuple[int, Path]]:
    """The ``iter_*`` checkpoint directories under ``save``, by iteration."""
    found = [(int(p.name.split("_")[1]), p) for p in save.glob("iter_*") if p.is_dir()]
    return sorted(found)


def run_grpo(out: Path, model_dir: Path, data: str, seed: int, iters: int | None, overrides: list[str]) -> float:
    """The GRPO stage from ``model_dir``; returns its wall time in seconds."""
    keys = [f"megatron_training.tokenizer_name_or_path={model_dir}", f"megatron_training.data_path={data}",
            f"rl_config.output_dir={out / 'grpo'}", f"actor_config.save={out / 'ckpt'}",
            f"megatron_training.seed={seed}", *overrides]
    if iters:
        keys.append(f"megatron_training.train_iters={iters}")
    plan = plan_named(CONFIG, None, keys)
    start = time.time()
    train(plan)
    return time.time() - start


def clear_previous_run(out: Path) -> None:
    """Remove what an earlier demo run wrote into ``out`` (its models, data, results and checkpoints):
    the demo is not resumed, and ``train`` refuses a directory holding another run's results."""
    import shutil

    for name in ("model_init", "model_sft", "grpo", "data"):
        if (out / name).is_dir():
            shutil.rmtree(out / name)
    save = out / "ckpt"
    for path in [out / "summary.json", out / "vision_metrics.jsonl", out / "reward_accuracy.png",
                 save / TRACKER, *save.glob("iter_*")]:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def evaluate_run(out: Path, sft_dir: Path, test, settings: VisionSettings) -> list[dict]:
    """Greedy held-out accuracy of the warm start (iteration 0) and of every GRPO checkpoint, with the
    iteration's mean GRPO reward; written to ``vision_metrics.jsonl``."""
    rewards = {r["iteration"]: r["grpo/score/mean"] for r in read_jsonl(out / "grpo" / "metrics.jsonl", strict=True)
               if "grpo/score/mean" in r}
    rows = []
    for iteration, model_dir in [(0, sft_dir), *checkpoints(out / "ckpt")]:
        acc = greedy_accuracy(model_dir, test, QUESTION, image_size=settings.image_size)
        rows.append({"iteration": iteration, "eval/accuracy": acc["accuracy"],
                     "eval/lenient_accuracy": acc["lenient_accuracy"], "grpo/score/mean": rewards.get(iteration)})
    write_text_atomic(out / "vision_metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    return rows


def run_seed(out: Path, seed: int, settings: VisionSettings = VisionSettings(), iters: int | None = None,
             overrides: tuple[str, ...] = ()) -> dict:
    """Every stage for one seed in ``out``; returns (and writes) its ``summary.json``."""
    start = time.time()
    out.mkdir(parents=True, exist_ok=True)
    clear_previous_run(out)
    init_model("tiny_qwen25_vl", out / "model_init", seed=seed)
    train_layouts, test, data = prepare(out, seed, settings)
    sft_start = time.time()
    sft_dir, sft = warm_start(out / "model_init", out / "model_sft", train_layouts, QUESTION,
                              max_steps=settings.sft_max_steps, target=settings.sft_target, lr=settings.sft_lr,
                              batch_size=settings.sft_batch_size, seed=seed,
                              image_size=settings.image_size)
    sft_seconds = time.time() - sft_start
    grpo_seconds = run_grpo(out, sft_dir, data, seed, iters, list(overrides))
    rows = evaluate_run(out, sft_dir, test, settings)
    plot_metrics(out / "vision_metrics.jsonl", out / "reward_accuracy.png",
                 ["grpo/score/mean", "eval/accuracy", "eval/lenient_accuracy"],
                 title=f"Vision demo, seed {seed}: GRPO reward, held-out greedy accuracy")
    summary = {"seed": seed, "settings": asdict(settings), "iterations": rows[-1]["iteration"],
               "accuracy_before": rows[0]["eval/accuracy"], "accuracy_after": rows[-1]["eval/accuracy"],
               "lenient_accuracy_before": rows[0]["eval/lenient_accuracy"],
               "lenient_accuracy_after": rows[-1]["eval/lenient_accuracy"], "per_iteration": rows,
               "sft_steps": sft["steps"], "sft_check_accuracy": sft["check_accuracy"],
               "sft_seconds": sft_seconds, "grpo_seconds": grpo_seconds, "total_seconds": time.time() - start,
               "loadavg": _loadavg()}
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=2))
    return summary


def _loadavg() -> str | None:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return None


def print_summary(s: dict) -> None:
    strict = (s["accuracy_after"] - s["accuracy_before"]) * 100
    lenient = (s["lenient_accuracy_after"] - s["lenient_accuracy_before"]) * 100
    print(f"seed {s['seed']}: held-out greedy accuracy strict {s['accuracy_before']:.1%} -> {s['accuracy_after']:.1%} "
          f"({strict:+.1f} points), lenient {s['lenient_accuracy_before']:.1%} -> {s['lenient_accuracy_after']:.1%} "
          f"({lenient:+.1f} points); {s['total_seconds'] / 60:.1f} min (SFT {s['sft_seconds']:.0f} s, "
          f"GRPO {s['grpo_seconds']:.0f} s), load {s['loadavg']}")


def gather_seeds(out: Path, summaries: list[dict]) -> Path:
    """``out/seeds_metrics.jsonl``: per iteration, each seed's strict and lenient accuracy."""
    rows: dict[int, dict] = {}
    for s in summaries:
        for r in s["per_iteration"]:
            row = rows.setdefault(r["iteration"], {"iteration": r["iteration"]})
            row[f"seed {s['seed']}: strict"] = r["eval/accuracy"]
            row[f"seed {s['seed']}: lenient"] = r["eval/lenient_accuracy"]
    write_text_atomic(out / "seeds_metrics.jsonl", "".join(json.dumps(rows[i]) + "\n" for i in sorted(rows)))
    return out / "seeds_metrics.jsonl"


def plot_seeds(out: Path, summaries: list[dict]) -> Path:
    """:func:`gather_seeds` and its plot ``out/reward_accuracy.png``: one panel per seed and accuracy."""
    gather_seeds(out, summaries)
    keys = [f"seed {s['seed']}: {kind}" for s in summaries for kind in ("strict", "lenient")]
    return plot_metrics(out / "seeds_metrics.jsonl", out / "reward_accuracy.png", keys,
                        title="Vision demo: held-out greedy accuracy (iteration 0: SFT)")


def main_vision(out: Path, seeds: list[int], iters: int | None, overrides: list[str],
                settings: VisionSettings = VisionSettings()) -> int:
    """The demo for each seed (one seed: in ``out``; several: in ``out/seed_S``) and, for several, ``out/summary.json``."""
    summaries = []
    for seed in seeds:
        summary = run_seed(out if len(seeds) == 1 else out / f"seed_{seed}", seed, settings, iters, tuple(overrides))
        print_summary(summary)
        summaries.append(summary)
    if len(seeds) > 1:
        gains = [s["accuracy_after"] - s["accuracy_before"] for s in summaries]
        lenient = [s["lenient_accuracy_after"] - s["lenient_accuracy_before"] for s in summaries]
        joined = {"seeds": seeds, "mean_strict_gain": sum(gains) / len(gains),
                  "mean_lenient_gain": sum(lenient) / len(lenient), "runs": summaries}
        write_text_atomic(out / "summary.json", json.dumps(joined, indent=2))
        plot_seeds(out, summaries)
        print(f"mean gain over {len(seeds)} seeds: strict {joined['mean_strict_gain'] * 100:+.1f} points, "
              f"lenient {joined['mean_lenient_gain'] * 100:+.1f} points")
    return 0
