"""posttrain and TRL learning side by side: the README demo's task, equal settings, 2 seeds each.

    python benchmarks/vs_trl/learning.py --steps 20 --seeds 1234 1235 --threads 2

Both sides train SmolLM2-135M-Instruct with GRPO on the demo task (products, ``common.py`` size
``products``: 8 prompts x 8 samples x up to 32 tokens, temperature 0.7, lr 2e-5, no KL, one optimizer
step per batch, fp32; ``--precision bf16``: TRL with ``bf16=True`` and posttrain with its hardware
default, as ``run.py``). Each run is a fresh process; the side that goes first alternates by seed.
Afterwards one yardstick scores the base model and every final model: ``posttrain eval``, greedy,
on the 55 held-out problems (strict: ``answer_is``; lenient: the last number). Writes
``learning.json`` and ``learning.png`` (reward per step, held-out lenient accuracy and time per step,
per side and seed) under ``--out``, and prints the table of ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = {"posttrain": HERE / "run_posttrain.py", "trl": HERE / "run_trl.py"}
SIZE = "products"


def train_one(side: str, seed: int, args, paths: dict) -> dict:
    run = Path(args.out) / f"{side}_{seed}"
    cmd = [sys.executable, str(SCRIPTS[side]), "--work", args.work, "--size", SIZE, "--steps", str(args.steps),
           "--threads", str(args.threads), "--out", str(run / "records.json"), "--save", str(run / "model"),
           "--precision", args.precision]
    if side == "posttrain":
        cmd += ["--set", f"megatron_training.seed={seed}"]
    else:
        cmd += ["--seed", str(seed)]
    run.mkdir(parents=True, exist_ok=True)
    start = time.time()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    result = json.loads((run / "records.json").read_text())
    model = run / "model"
    if side == "posttrain":  # the save directory holds iter_XXXXXXX; eval resolves the latest
        model = sorted(model.glob("iter_*"))[-1]
    result["eval"] = evaluate(str(model), paths, args, f"{side}_{seed}")
    if side == "trl":
        result["records"] = [{"step": r["step"], "reward": r["reward"], "step_s": r["cpu/wall_s"]}
                             for r in result["records"] if "reward" in r]
    print(f"  {side:<9} seed {seed}: reward {result['records'][0]['reward']:.2f} -> "
          f"{result['records'][-1]['reward']:.2f}, median step {median_step(result):.1f} s, held-out strict "
          f"{result['eval']['accuracy']:.1%} lenient {result['eval']['lenient_accuracy']:.1%}, "
          f"peak RSS {result.get('peak_memory_mib', 0):.0f} MiB ({time.time() - start:.0f} s)", flush=True)
    return result


def evaluate(model: str, paths: dict, args, name: str) -> dict:
    """``posttrain eval`` of ``model`` on the held-out split: greedy, the rollout's token limit."""
    out = Path(args.out) / f"eval_{name}.json"
    subprocess.run([str(Path(sys.executable).parent / "posttrain"), "eval", "--model", model, "--data", paths["test"],
                    "--prompt-type", "hf_chat_template", "--verifier", "answer_is", "--max-tokens", "32",
                    "--output", str(out), "--force"], check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    return json.loads(out.read_text())


def median_step(result: dict) -> float:
    return statistics.median(r["step_s"] for r in result["records"][1:])  # step 1 warms up


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"posttrain": "tab:blue", "trl": "tab:orange"}
    fig, (ax_r, ax_a, ax_t) = plt.subplots(1, 3, figsize=(15, 4))
    for side, runs in report["runs"].items():
        for seed, res in runs.items():
            steps = [r["step"] for r in res["records"]]
            ax_r.plot(steps, [r["reward"] for r in res["records"]], color=colors[side], alpha=0.8,
                      label=f"{side} seed {seed}", linestyle="-" if seed == min(runs) else "--")
            ax_t.plot(steps, [r["step_s"] for r in res["records"]], color=colors[side], alpha=0.8,
                      label=f"{side} seed {seed}", linestyle="-" if seed == min(runs) else "--")
            ax_a.plot([0, steps[-1]], [report["base"]["lenient_accuracy"], res["eval"]["lenient_accuracy"]],
                      marker="o", color=colors[side], linestyle="-" if seed == min(runs) else "--",
                      label=f"{side} seed {seed}")
    ax_r.set(xlabel="step", ylabel="mean reward (answer_is)", title="training reward", ylim=(0, 1))
    ax_a.set(xlabel="step", ylabel="held-out lenient accuracy (greedy)", title="held-out (55 problems)",
             ylim=(0, 1))
    ax_t.set(xlabel="step", ylabel="seconds", title="time per step (2 threads)", ylim=(0, None))
    for ax in (ax_r, ax_a, ax_t):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"GRPO on SmolLM2-135M-Instruct, products task: posttrain vs TRL 1.16, equal settings, "
                 f"{report.get('precision', 'fp32')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", default="/tmp/perf/work")
    p.add_argument("--out", default="/tmp/perf/learning")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seeds", type=int, nargs="+", default=[1234, 1235])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                   help="bf16: TRL with bf16=True, posttrain with its hardware default (run.py --precision)")
    args = p.parse_args()

    sys.path.insert(0, str(HERE))
    from common import prepare

    Path(args.out).mkdir(parents=True, exist_ok=True)
    paths = prepare(Path(args.work), SIZE)
    report = {"steps": args.steps, "threads": args.threads, "precision": args.precision, "base": evaluate(paths["model"], paths, args, "base"),
              "runs": {"posttrain": {}, "trl": {}}, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(f"base model: held-out strict {report['base']['accuracy']:.1%}, "
          f"lenient {report['base']['lenient_accuracy']:.1%}", flush=True)
    for i, seed in enumerate(args.seeds):
        for side in (["posttrain", "trl"] if i % 2 == 0 else ["trl", "posttrain"]):
            report["runs"][side][seed] = train_one(side, seed, args, paths)
            (Path(args.out) / "learning.json").write_text(json.dumps(report, indent=2))
    plot(report, Path(args.out) / "learning.png")
    print("\n| side | seed | reward, first 3 steps -> last 3 | held-out strict | held-out lenient | "
          "median step | peak RSS |\n|---|---|---|---|---|---|---|")
    for side, runs in report["runs"].items():
        for seed, res in runs.items():
            rewards = [r["reward"] for r in res["records"]]
            print(f"| {side} | {seed} | {statistics.mean(rewards[:3]):.2f} -> {statistics.mean(rewards[-3:]):.2f} | "
                  f"{res['eval']['accuracy']:.1%} | {res['eval']['lenient_accuracy']:.1%} | "
                  f"{median_step(res):.1f} s | {res.get('peak_memory_mib', 0) / 1024:.1f} GiB |")
    print(f"wrote {Path(args.out) / 'learning.json'} and learning.png")


if __name__ == "__main__":
    main()
