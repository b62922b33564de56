"""Memory of a colocated GRPO run on SmolLM2-135M-Instruct with and without offload, on this CPU.

Each variant runs 2 GRPO iterations (the demo's task and model; 2 prompts x 4 samples, 16 new
tokens, a KL reference) in a fresh process. A thread in that process reads ``/proc/self/status``
every 10 ms; the run records ``VmRSS`` (the resident set) and ``RssAnon`` (its anonymous part:
tensors, Python; not memory-mapped files such as safetensors the kernel can drop) when each rollout
starts, and their peaks over the run. The table shows the median of ``--repeats`` runs per variant.

    .venv/bin/python benchmarks/cluster/bench_offload_memory.py --work /tmp/offload_bench
    .venv/bin/python benchmarks/cluster/bench_offload_memory.py --work /tmp/ray_bench --workers 2 --variants none

With ``--workers 2`` the run trains on 2 Ray actor workers (1 thread each) and the numbers are their
processes' (read from ``/proc/<pid>/status``): the first worker's at each rollout, the larger peak of
the two. A change is measured against another checkout by running it with ``PYTHONPATH=OTHER/src``
(the workers import the driver's ``PYTHONPATH``).

Variants: ``none``; ``grad`` (generate_config.offload_train_grad: gradients freed between updates);
``reference`` (rl_config.offload_reference: the reference dropped between uses, mapped back from a
file); ``both``. ``offload_train_optimizer`` has no effect on a CPU (host memory is the device's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

VARIANTS = {"none": [], "grad": ["generate_config.offload_train_grad=true"],
            "reference": ["rl_config.offload_reference=true"],
            "both": ["generate_config.offload_train_grad=true", "rl_config.offload_reference=true"]}
MIB = 1024


def rss_kib(pid: int | str = "self") -> dict[str, int]:
    """``VmRSS`` (the resident set) and ``RssAnon`` (its anonymous part) of process ``pid``, in KiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("VmRSS", "RssAnon"):
            out[key] = int(line.split()[1])
    return out


def child(work: Path, variant: str, workers: int = 1) -> dict:
    from posttrain.config.run import load_run_config
    from posttrain.config.plan import resolve_plan
    from posttrain.demo.pretrained import ensure_smollm2
    from posttrain.demo.run import prepare_data
    from posttrain.loops.build import build_trainer

    model = ensure_smollm2()
    data = prepare_data(work / "data", model) if not (work / "data" / "data").exists() else {
        "train": str(work / "data" / "data" / "train" / "data")}
    out = work / f"run_{variant}"
    overrides = [f"megatron_training.tokenizer_name_or_path={model}", f"megatron_training.data_path={data['train']}",
                 f"rl_config.output_dir={out}", "megatron_training.train_iters=2", "megatron_training.global_batch_size=2",
                 "rl_config.n_samples_per_prompt=4", "rl_config.mini_batch_size=2", "rl_config.init_kl_coef=0.001",
                 "rl_config.use_tensorboard=false", *VARIANTS[variant]]
    if workers > 1:  # each worker's share of the 8 rows in micro-batches of 4
        overrides += [f"rl_config.actor_resource.num_npus={workers}", "actor_config.micro_batch_size=4"]
    cfg = load_run_config("grpo_smollm2_demo", None, overrides)
    peak, done = {"VmRSS": 0, "RssAnon": 0}, threading.Event()
    trainer = build_trainer(resolve_plan(cfg))
    cluster = trainer.s.cluster
    pids = [info["pid"] for info in cluster.info] if cluster is not None else ["self"]

    def watch():
        while not done.is_set():
            for pid in pids:
                try:
                    for key, value in rss_kib(pid).items():
                        peak[key] = max(peak[key], value)
                except FileNotFoundError:  # a worker gone at the end of the run
                    pass
            time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    at_rollout, generate = [], trainer.s.policy.rollout.generate

    def recording(*args, **kwargs):
        at_rollout.append(rss_kib(pids[0]))
        return generate(*args, **kwargs)

    trainer.s.policy.rollout.generate = recording
    trainer.fit()
    done.set()
    thread.join()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"variant": variant, "rss_at_rollout_mib": [round(v["VmRSS"] / MIB) for v in at_rollout],
            "anon_at_rollout_mib": [round(v["RssAnon"] / MIB) for v in at_rollout],
            "peak_rss_mib": round(peak["VmRSS"] / MIB), "peak_anon_mib": round(peak["RssAnon"] / MIB),
            "pg_loss": [r.get("actor/pg_loss") for r in rows], "kl_loss": [r.get("actor/kl_loss") for r in rows]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--child", choices=sorted(VARIANTS))
    p.add_argument("--repeats", type=int, default=3, help="runs per variant (the table shows medians)")
    p.add_argument("--workers", type=int, default=1, help="Ray actor workers (1: the run in one process)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.child:
        print(json.dumps(child(args.work, args.child, args.workers)))
        return 0
    variants = args.variants.split(",")
    results = {v: [] for v in variants}
    for _ in range(args.repeats):  # variants interleaved, so a change of load hits them alike
        for variant in variants:
            for name in ("metrics.jsonl", "eval.jsonl"):
                (args.work / f"run_{variant}" / name).unlink(missing_ok=True)
            proc = subprocess.run([sys.executable, __file__, "--work", str(args.work), "--child", variant,
                                   "--workers", str(args.workers)], capture_output=True, text=True, check=True)
            results[variant].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(json.dumps(results[variant][-1]), flush=True)
    with open("/proc/loadavg") as fh:
        load = fh.read().split()[:3]
    (args.work / "results.json").write_text(json.dumps({"load_average": load, "results": results}, indent=2))
    def median(variant, key, index=None):
        values = [r[key] if index is None else r[key][index] for r in results[variant]]
        return round(statistics.median(values))

    print("| variant | RSS at rollout 1 / 2 (MiB) | RssAnon at rollout 1 / 2 (MiB) | peak RSS (MiB) | peak RssAnon (MiB) |")
    print("|---|---|---|---|---|")
    for v in variants:
        print(f"| {v} | {median(v, 'rss_at_rollout_mib', 0)} / {median(v, 'rss_at_rollout_mib', 1)} | "
              f"{median(v, 'anon_at_rollout_mib', 0)} / {median(v, 'anon_at_rollout_mib', 1)} | "
              f"{median(v, 'peak_rss_mib')} | {median(v, 'peak_anon_mib')} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
