"""Does LoRA GRPO learn the same with its frozen base stored in bf16 as in fp32? The LoRA demo
(``python -m posttrain.demo --config-name grpo_lora_smollm2_demo``) in bf16
(``megatron_training.bf16=true generate_config.dtype=bfloat16``: bf16 autocast, a bf16 rollout) with
the base in bf16 (posttrain's default since ``Plan.frozen_dtype``) against the same run with the
base kept in fp32 (the child patches ``Plan.frozen_dtype``), several seeds, runs interleaved so both
see the same machine load. Needs a CPU with AMX or AVX512-BF16 (else both runs are fp32 and equal).
Not a CI test (minutes a run):

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python benchmarks/lora/learn_bf16_storage.py \
        --out runs/learn_bf16_storage --seeds 1234 1235

Each run's directory holds the demo's ``summary.json`` and ``eval.jsonl``; ``comparison.json`` and
the printed table give the held-out lenient accuracy before and after, the rewards and the time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BF16 = ["megatron_training.bf16=true", "generate_config.dtype=bfloat16"]
STORAGES = ("bfloat16", "float32")


def child(argv: list[str]) -> int:
    """``--child STORAGE DEMO_ARGS...``: the demo in this process with the frozen weights in STORAGE."""
    from posttrain.config.plan import Plan
    from posttrain.demo.run import main as demo_main

    storage = argv[0]
    Plan.frozen_dtype = property(lambda self: storage if self.train_dtype == "bfloat16" else "float32")
    return demo_main(argv[1:])


def run_one(out: Path, storage: str, seed: int, extra: list[str]) -> dict:
    cmd = [sys.executable, __file__, "--child", storage, "--config-name", "grpo_lora_smollm2_demo",
           "--out", str(out), "--seed", str(seed), *BF16, *extra]
    load = os.getloadavg()
    print(f"[{time.strftime('%H:%M:%S')}] {storage} base, seed {seed}: load {load}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with open(out / "run.log", "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    if rc != 0:
        return {"storage": storage, "seed": seed, "failed": rc,
                "error": (out / "run.log").read_text(errors="replace").splitlines()[-5:]}
    summary = json.loads((out / "summary.json").read_text())
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines() if line.strip()]
    run = json.loads((out / "run.json").read_text()) if (out / "run.json").is_file() else {}
    return {"storage": storage, "seed": seed, "load_before": load, "load_after": os.getloadavg(),
            "wall_s": time.time() - start, "train_dtype": run.get("train_dtype"),
            "lenient": [e["eval/lenient_accuracy"] for e in evals],
            "rewards": [r for _, r in summary["rewards"]], "s_per_iter": summary["seconds_per_iteration"]}


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/learn_bf16_storage")
    p.add_argument("--seeds", type=int, nargs="+", default=[1234, 1235])
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides for every run")
    args = p.parse_args()
    out, results = Path(args.out), []
    for seed in args.seeds:
        for storage in STORAGES:
            results.append(run_one(out / f"{storage}_{seed}", storage, seed, args.overrides))
            print(json.dumps(results[-1]), flush=True)
            (out / "comparison.tmp").write_text(json.dumps(results, indent=1))
            (out / "comparison.tmp").rename(out / "comparison.json")
    print("\nbase      seed  lenient before -> after  s/iter  rewards")
    for r in results:
        if "failed" in r:
            print(f"{r['storage']:9s} {r['seed']}  FAILED (exit {r['failed']}): {r['error'][-1:]}")
            continue
        print(f"{r['storage']:9s} {r['seed']}  {r['lenient'][0]:.1%} -> {r['lenient'][-1]:.1%}  "
              f"{r['s_per_iter']:.1f}  " + " ".join(f"{x:.2f}" for x in r["rewards"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
