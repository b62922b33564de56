"""Memory of a colocated GRPO run on SmolLM2-135M-Instruct with and without offload, on this CPU.

Each variant runs 2 GRPO iterations (the demo's task and model; 2 prompts x 4 samples, 16 new
tokens, a KL reference) in a fresh process. A thread in that process reads ``/proc/self/status``
every 10 ms; the run records ``RssAnon`` (memory the process owns: tensors, Python; not the
memory-mapped files the kernel can drop) when each rollout starts, and its peak over the run.

    .venv/bin/python benchmarks/cluster/bench_offload_memory.py --work /tmp/offload_bench

Variants: ``none``; ``grad`` (generate_config.offload_train_grad: gradients freed between updates);
``reference`` (rl_config.offload_reference: the reference dropped between uses, mapped back from a
file); ``both``. ``offload_train_optimizer`` has no effect on a CPU (host memory is the device's).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

VARIANTS = {"none": [], "grad": ["generate_config.offload_train_grad=true"],
            "reference": ["rl_config.offload_reference=true"],
            "both": ["generate_config.offload_train_grad=true", "rl_config.offload_reference=true"]}
MIB = 1024


def rss_anon_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0


def child(work: Path, variant: str) -> dict:
    from posttrain.config.loader import load_run_config
    from posttrain.config.plan import resolve_plan
    from posttrain.demo.pretrained import ensure_smollm2
    from posttrain.demo.run import prepare_data
    from posttrain.trainers.stages import build_trainer

    model = ensure_smollm2()
    data = prepare_data(work / "data", model) if not (work / "data" / "data").exists() else {
        "train": str(work / "data" / "data" / "train" / "data")}
    out = work / f"run_{variant}"
    overrides = [f"megatron_training.tokenizer_name_or_path={model}", f"megatron_training.data_path={data['train']}",
                 f"rl_config.output_dir={out}", "megatron_training.train_iters=2", "megatron_training.global_batch_size=2",
                 "rl_config.n_samples_per_prompt=4", "rl_config.mini_batch_size=2", "rl_config.init_kl_coef=0.001",
                 "rl_config.use_tensorboard=false", *VARIANTS[variant]]
    cfg = load_run_config("grpo_smollm2_demo", None, overrides)
    peak, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], rss_anon_kib())
            time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    trainer = build_trainer(cfg, resolve_plan(cfg), out)
    at_rollout, generate = [], trainer.s.policy.rollout.generate

    def recording(*args, **kwargs):
        at_rollout.append(rss_anon_kib())
        return generate(*args, **kwargs)

    trainer.s.policy.rollout.generate = recording
    trainer.fit()
    done.set()
    thread.join()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"variant": variant, "rss_anon_at_rollout_mib": [round(v / MIB) for v in at_rollout],
            "peak_rss_anon_mib": round(peak[0] / MIB), "kl_loss": [r.get("actor/kl_loss") for r in rows],
            "pg_loss": [r.get("actor/pg_loss") for r in rows]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--child", choices=sorted(VARIANTS))
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.child:
        print(json.dumps(child(args.work, args.child)))
        return 0
    results = []
    for variant in VARIANTS:
        for name in ("metrics.jsonl", "eval.jsonl"):
            (args.work / f"run_{variant}" / name).unlink(missing_ok=True)
        proc = subprocess.run([sys.executable, __file__, "--work", str(args.work), "--child", variant],
                              capture_output=True, text=True, check=True)
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    with open("/proc/loadavg") as fh:
        load = fh.read().split()[:3]
    (args.work / "results.json").write_text(json.dumps({"load_average": load, "results": results}, indent=2))
    print("| variant | RssAnon when each rollout starts (MiB) | peak RssAnon (MiB) |")
    print("|---|---|---|")
    for r in results:
        print(f"| {r['variant']} | {' / '.join(map(str, r['rss_anon_at_rollout_mib']))} | {r['peak_rss_anon_mib']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
