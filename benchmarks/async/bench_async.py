"""Asynchronous training (``async_staleness``) against synchronous, on a long-tailed task.

The task: "say <letter> <N> times". Three prompts in four are short (N of 2 to 4: a few response
tokens), one in four is long (N of 26 to 32: about 60 tokens), so each batch waits on a few long
samples. A tiny Qwen2 is warm-started by SFT, then GRPO trains it with a dense reward: 1 for
exactly N copies, less the further the count is off (``repeat_count``).

Modes, each over the same seeds (median of 3 runs by default):

* ``sync``: the default, one process with torch using every core;
* ``sep_k0``: the separate rollout worker (``separate_rollout_worker: true``): the rollout in a
  Ray worker process with one core, the trainer in this process with one core, synchronous;
* ``sep_k1``: the same two processes with ``async_staleness: 1``;
* ``local_k1``: ``async_staleness: 1`` in one process (the rollout thread on a copy of the
  weights), one torch thread per thread.

Wall time is the sum of ``timing/all`` over the iterations (model loading and Ray's start-up are
not in it, and are reported apart). Run::

    python benchmarks/async/bench_async.py --out runs/bench_async --seeds 1 2 3 --iters 15
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from posttrain.reward.verifiers import register_verifier

TEMPLATE = "tiny_tool"
LR = 3e-4
MODES = {
    "sync": {},
    "sep_k0": {"rl_config.separate_rollout_worker": "true"},
    "sep_k1": {"rl_config.separate_rollout_worker": "true", "rl_config.async_staleness": "1"},
    "local_k1": {"rl_config.async_staleness": "1"},
}


@register_verifier("repeat_count", overwrite=True)
def repeat_count(response: str, label: str, **_) -> float:
    """``label`` is "<letter> <N>": 1.0 for exactly N copies of the letter, less the further the
    count is from N, halved when the response holds anything else."""
    letter, count = label.split()
    words = response.split()
    got = sum(w == letter for w in words)
    score = max(0.0, 1.0 - abs(got - int(count)) / int(count))
    return score if got == len(words) else score / 2


def problems(count: int, seed: int) -> list[tuple[str, int]]:
    """(letter, N): three in four with N of 2 to 4, one in four with N of 26 to 32."""
    rng = random.Random(seed)
    return [(rng.choice("abcdefgh"), rng.randint(26, 32) if rng.random() < 0.25 else rng.randint(2, 4))
            for _ in range(count)]


def question(letter: str, count: int) -> str:
    return f"say {letter} {count} times"


def answer(letter: str, count: int) -> str:
    return " ".join([letter] * count)


def prepare(out: Path, seed: int, sft_steps: int) -> tuple[Path, Path, Path]:
    """(tokenizer/model dir, SFT warm-start checkpoint, RL prompt data prefix); reused when ``out``
    already holds them."""
    from transformers import AutoTokenizer

    from posttrain.config.run import load_run_config
    from posttrain.data.preprocess import write_token_rows
    from posttrain.data.templates import get_template
    from posttrain.commands.init_model import init_model
    from posttrain.paths import configs_dir
    from posttrain.commands.train import train_config as train

    train_pairs = problems(2000, seed)
    model = out / "model"
    if not (model / "config.json").is_file():
        corpus = out / "corpus.txt"
        out.mkdir(parents=True, exist_ok=True)
        corpus.write_text("".join(f"{question(a, b)}\n{answer(a, b)}\n" for a, b in train_pairs[:500]))
        model = init_model("tiny_qwen2", model, corpus=corpus, vocab_size=400, seed=seed, force=True)
    tok = AutoTokenizer.from_pretrained(str(model))
    template = get_template(TEMPLATE, configs_dir() / "tiny_templates.json")
    prompts = [tok.encode(template.render_prompt(question(a, b), tokenizer=tok), add_special_tokens=False)
               for a, b in train_pairs]
    answers = [tok.encode(answer(a, b), add_special_tokens=False) for a, b in train_pairs]
    write_token_rows(out / "sft" / "data", {
        "input_ids": [p + r + [tok.eos_token_id] for p, r in zip(prompts, answers)],
        "labels": [[-100] * len(p) + r + [tok.eos_token_id] for p, r in zip(prompts, answers)],
        "attention_mask": [[1] * (len(p) + len(r) + 1) for p, r in zip(prompts, answers)]})
    write_token_rows(out / "rl" / "data", {"input_ids": prompts, "attention_mask": [[1] * len(p) for p in prompts],
                                           "labels": [tok.encode(f"{a} {b}", add_special_tokens=False)
                                                      for a, b in train_pairs]})
    lengths = sorted(len(r) + 1 for r in answers)
    print(f"answer tokens: median {lengths[len(lengths) // 2]}, p90 {lengths[int(0.9 * len(lengths))]}, "
          f"max {lengths[-1]}", flush=True)
    if (out / "sft_ckpt" / "latest_checkpointed_iteration.txt").is_file():
        return model, out / "sft_ckpt", out / "rl" / "data"
    sft = load_run_config("sft_tiny_qwen2", None, [
        f"megatron_training.tokenizer_name_or_path={model}", f"megatron_training.data_path={out / 'sft' / 'data'}",
        f"megatron_training.save={out / 'sft_ckpt'}", f"rl_config.output_dir={out / 'sft'}",
        f"megatron_training.train_iters={sft_steps}", "megatron_training.seq_length=96",
        f"megatron_training.prompt_type={TEMPLATE}", f"megatron_training.seed={seed}",
        f"megatron_training.prompt_type_path={configs_dir() / 'tiny_templates.json'}",
        "megatron_training.lr=2e-3", "megatron_training.min_lr=0.0", "megatron_training.lr_decay_style=constant",
        "megatron_training.no_save_optim=true", "megatron_training.no_save_rng=true",
        "rl_config.use_tensorboard=false"])
    train(sft)
    return model, out / "sft_ckpt", out / "rl" / "data"


def run_mode(name: str, out: Path, model: Path, warm: Path, data: Path, seed: int, iters: int, gbs: int,
             n: int) -> dict:
    from posttrain.config.run import load_run_config
    from posttrain.paths import configs_dir
    from posttrain.commands.train import train_config as train

    torch.set_num_threads((os.cpu_count() or 1) if name == "sync" else 1)
    run_dir = out / f"{name}_seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a rerun replaces the earlier one's metrics
    overrides = [
        f"megatron_training.tokenizer_name_or_path={model}", f"megatron_training.data_path={data}",
        f"megatron_training.prompt_type={TEMPLATE}", f"megatron_training.prompt_type_path={configs_dir() / 'tiny_templates.json'}",
        "megatron_training.dataset_additional_keys=[labels]", f"megatron_training.seed={seed}",
        f"megatron_training.train_iters={iters}", "megatron_training.seq_length=128", "megatron_training.save_interval=0",
        f"megatron_training.global_batch_size={gbs}", f"rl_config.n_samples_per_prompt={n}",
        f"rl_config.mini_batch_size={gbs}", f"actor_config.micro_batch_size={gbs * n}",
        f"actor_config.load={warm}", "actor_config.finetune=true", "actor_config.save=null", f"actor_config.lr={LR}",
        f"rl_config.output_dir={run_dir}", "rl_config.eval_data_path=null", "rl_config.use_tensorboard=false",
        "rl_config.verifier_function=[repeat_count]", "rl_config.verifier_weight=[1.0]", "rl_config.verifier_parallel=0",
        "rl_config.max_prompt_length=32", "rl_config.ray_num_cpus_per_worker=1",
        "generate_config.max_model_len=128", "generate_config.sampling_config.max_tokens=80",
        *[f"{k}={v}" for k, v in MODES[name].items()]]
    cfg = load_run_config("grpo_tiny_qwen2", None, overrides)
    began = time.time()
    train(cfg)
    total = time.time() - began
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "timing/all" in r]
    return {"mode": name, "seed": seed, "train_seconds": sum(r["timing/all"] for r in rows), "total_seconds": total,
            "rewards": [r["grpo/score/mean"] for r in rows], "response_length": [r["response_length/mean"] for r in rows],
            "rollout_seconds": sum(r["timing/rollout"] for r in rows), "update_seconds": sum(r["timing/update"] for r in rows),
            "waited_for_rollout": sum(r.get("timing/non_overlap_rollout", 0.0) for r in rows),
            "staleness_max": max(r.get("rollout/staleness_max", 0.0) for r in rows),
            "logprob_diff_max": max(r.get("rollout/logprob_diff_max", 0.0) for r in rows)}


def summarize(runs: list[dict], modes: list[str]) -> dict:
    """Medians over seeds: train seconds, each mode's speed-up over ``sep_k0`` (the same two
    processes, synchronous) and over ``sync`` (the one-process default) as the median of the
    per-seed ratios, and the mean reward of the first and last three iterations."""
    seeds = sorted({r["seed"] for r in runs})
    by = {(r["mode"], r["seed"]): r for r in runs}

    def ratios(base: str) -> dict[str, float]:
        return {m: statistics.median(by[base, s]["train_seconds"] / by[m, s]["train_seconds"] for s in seeds)
                for m in modes} if base in modes else {}

    def reward(m: str, part: slice) -> float:
        return statistics.median(statistics.mean(by[m, s]["rewards"][part]) for s in seeds)

    return {"median_train_seconds": {m: statistics.median(by[m, s]["train_seconds"] for s in seeds) for m in modes},
            "median_speedup_vs_sep_k0": ratios("sep_k0"), "median_speedup_vs_sync": ratios("sync"),
            "median_reward_first3": {m: reward(m, slice(0, 3)) for m in modes},
            "median_reward_last3": {m: reward(m, slice(-3, None)) for m in modes}, "runs": runs}


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench_async"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--sft-steps", type=int, default=150)
    parser.add_argument("--gbs", type=int, default=4, help="prompts per iteration")
    parser.add_argument("-n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "results_cpu.json")
    args = parser.parse_args(argv)
    model, warm, data = prepare(args.out / "setup", seed=0, sft_steps=args.sft_steps)
    runs, loads = [], {"before": load_average()}
    for seed in args.seeds:  # modes alternate within each seed, so drifting load hits them alike
        for mode in args.modes:
            result = run_mode(mode, args.out, model, warm, data, seed, args.iters, args.gbs, args.n)
            result["load_after"] = load_average()
            print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}), flush=True)
            runs.append(result)
    loads["after"] = load_average()
    summary = summarize(runs, args.modes)
    summary = {"machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "load_average": loads},
               "iters": args.iters, "seeds": args.seeds, "global_batch_size": args.gbs, "n": args.n, **summary}
    args.results.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k not in ("runs", "machine")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
