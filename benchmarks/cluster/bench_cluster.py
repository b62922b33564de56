"""Ray start-up and per-iteration cost: GRPO on the tiny Qwen2 with 2 CPU Ray workers vs in process.

    .venv/bin/python benchmarks/cluster/bench_cluster.py --work /tmp/bench_cluster --iters 5 --warmup 1

Each mode runs in a fresh process (one after the other, never two at once):

* ``inproc1`` / ``inproc2``: the in-process session, torch with 1 / 2 threads;
* ``ray1``: 1 Ray actor worker x 1 thread: the same work as ``inproc1`` (even the same samples), so
  the difference is what Ray itself costs per iteration;
* ``ray2``: 2 Ray actor workers x 1 thread (one CPU each) on a local Ray cluster; the driver
  holds only the tokenizer;
* ``ray2fsdp``: as ``ray2`` with ``rl_config.ray_sharding: fsdp2`` (sharded training state; the
  parameters are gathered before each rollout / log-prob call).

Workload: tiny Qwen2 (hidden 384, 6 layers, ~9.6M parameters, fp32), 8 prompts x 8 samples, at most
64 new tokens, one optimizer step per iteration (mini-batch = global batch), no reference model.
Reported: start-up (``ray.init``; building the session: worker processes, model loads, process
group, DDP), per-iteration wall time and phases (median), and for Ray the round trip of an empty
remote call and a gloo all-reduce of the model's gradient size between the two workers.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = ("inproc1", "inproc2", "ray1", "ray2", "ray2fsdp")


def prepare(work: Path) -> tuple[Path, str]:
    from posttrain.data.preprocess import preprocess
    from posttrain.commands.init_model import init_model

    model = work / "model"
    if not (model / "config.json").is_file():
        init_model("tiny_qwen2", model, seed=1234)
    data = work / "data" / "rl"
    if not Path(str(data) + ".idx").is_file() and not any((work / "data").glob("*")):
        rng = random.Random(0)
        rows = [{"problem": f"What is {a} + {b}?", "answer": str(a + b)}
                for a, b in ((rng.randint(0, 99), rng.randint(0, 99)) for _ in range(256))]
        (work / "rl.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
        preprocess({"input": str(work / "rl.jsonl"), "handler_name": "R1AlpacaStyleInstructionHandler",
                    "tokenizer_name_or_path": str(model), "prompt_type": "default", "output_prefix": str(data),
                    "map_keys": {"prompt": "problem", "response": "answer"},
                    "dataset_additional_keys": ["labels"]}, progress=False)
    return model, str(data)


def config(model: Path, data: str, work: Path, mode: str, iters: int):
    from posttrain.config.run import run_config_from_dict

    workers = 2 if mode.startswith("ray2") else 1
    address = {"ray_address": "local"} if mode == "ray1" else {}  # Ray with one worker (already initialised)
    if mode == "ray2fsdp":
        address["ray_sharding"] = "fsdp2"
    return run_config_from_dict({
        "megatron_training": {"stage": "ray_grpo", "global_batch_size": 8, "micro_batch_size": 16,
                              "seq_length": 128, "train_iters": iters, "lr": 1e-4, "lr_decay_style": "constant",
                              "tokenizer_name_or_path": str(model), "data_path": data, "seed": 1, "bf16": False,
                              "dataset_additional_keys": ["labels"], "prompt_type": "default"},
        "rl_config": {"n_samples_per_prompt": 8, "mini_batch_size": 8, "verifier_function": ["base_acc"],
                      "verifier_weight": [1.0], "verifier_parallel": 1, "init_kl_coef": 0.0, "device": "cpu",
                      "max_prompt_length": 64, "output_dir": str(work / f"run_{mode}"),
                      "actor_resource": {"num_devices": workers}, **address},
        "generate_config": {"max_model_len": 128, "max_num_seqs": 256, "infer_tensor_parallel_size": 1,
                            "sampling_config": {"max_tokens": 64, "temperature": 1.0, "top_k": -1, "top_p": 1.0}},
    }, name=f"bench_{mode}")


def ray_micro(cluster) -> dict[str, float]:
    """Median round trip of an empty remote call, and of a gloo all-reduce of the gradient size."""
    import ray

    worker = cluster.workers[0]
    times = []
    for _ in range(30):
        start = time.perf_counter()
        ray.get(worker.ready_info.remote())
        times.append(time.perf_counter() - start)
    return {"remote_call_ms": 1e3 * statistics.median(times)}


def run_mode(mode: str, work: Path, iters: int, warmup: int, niceness0: bool = True, ray_up: bool = False) -> dict:
    import torch

    torch.set_num_threads(2 if mode == "inproc2" else 1)
    from posttrain.config.plan import resolve_plan
    from posttrain.loops.build import build_trainer

    model, data = prepare(work)
    cfg = config(model, data, work, mode, iters + warmup)
    out: dict = {"mode": mode, "load_before": os.getloadavg()[0]}
    if mode.startswith("ray") or ray_up:
        import ray

        start = time.perf_counter()
        ray.init(num_cpus=2 if mode.startswith("ray2") else 1, include_dashboard=False, logging_level="WARNING",
                 _system_config={"worker_niceness": 0 if niceness0 else 15})
        out["ray_init_s"] = time.perf_counter() - start
    plan = resolve_plan(cfg, device="cpu")
    start = time.perf_counter()
    trainer = build_trainer(plan)
    session = trainer.s
    out["session_build_s"] = time.perf_counter() - start
    rows = []
    try:
        for it in range(1, iters + warmup + 1):
            start = time.perf_counter()
            metrics = trainer.train_step(it)
            wall = time.perf_counter() - start
            if it > warmup:
                rows.append({"wall": wall, **{k: v for k, v in metrics.items() if k.startswith("timing/")},
                             "response_length/mean": metrics["response_length/mean"]})
        if mode.startswith("ray"):
            out.update(ray_micro(session.cluster))
        if mode.startswith("ray2"):
            out.update(allreduce_ms(session.cluster))
    finally:
        session.close()
    out["load_after"] = os.getloadavg()[0]
    out["iterations"] = rows
    out["median"] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return out


def allreduce_ms(cluster) -> dict[str, float]:
    """Median time of one gloo all-reduce as large as all gradients (what DDP sends per step)."""
    import ray

    grads = ray.get([w.grads.remote() for w in cluster.workers])[0]  # all ranks: a collective under FSDP2
    numel = sum(v.numel() for v in grads.values())
    times = ray.get([w.allreduce_probe.remote(numel, 10) for w in cluster.workers])
    return {"grad_allreduce_ms": times[0], "grad_mbytes": numel * 4 / 1e6}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", default="/tmp/bench_cluster")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--mode", choices=MODES, help="run one mode in this process (internal)")
    p.add_argument("--modes", default=",".join(MODES), help="modes to run, in this order")
    p.add_argument("--ray-niceness-15", action="store_true", help="keep Ray's default worker niceness (15)")
    p.add_argument("--ray-up", action="store_true",
                   help="in-process modes run with an idle local Ray started (same machine state as the Ray modes)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.mode:
        result = run_mode(args.mode, work, args.iters, args.warmup, not args.ray_niceness_15, args.ray_up)
        Path(args.out).write_text(json.dumps(result, indent=2))
        return
    prepare(work)
    results = []
    for mode in args.modes.split(","):
        out = work / f"{mode}.json"
        cmd = [sys.executable, __file__, "--mode", mode, "--work", str(work), "--iters", str(args.iters),
               "--warmup", str(args.warmup), "--out", str(out)]
        cmd += ["--ray-niceness-15"] if args.ray_niceness_15 else []
        cmd += ["--ray-up"] if args.ray_up else []
        start = time.perf_counter()
        subprocess.run(cmd, check=True)
        result = json.loads(out.read_text())
        result["process_s"] = time.perf_counter() - start
        results.append(result)
    (work / "results.json").write_text(json.dumps(results, indent=2))
    phases = sorted({k for r in results for k in r["median"] if k.startswith("timing/")})
    print(f"{'mode':8} {'start-up s':>10} {'iter s':>7} " + " ".join(f"{k[7:]:>11}" for k in phases))
    for r in results:
        startup = r["session_build_s"] + (r.get("ray_init_s", 0.0) if r["mode"].startswith("ray") else 0.0)
        print(f"{r['mode']:8} {startup:10.2f} {r['median']['wall']:7.3f} "
              + " ".join(f"{r['median'].get(k, float('nan')):11.3f}" for k in phases))
    for r in results:
        extra = {k: round(v, 3) for k, v in r.items() if k.endswith(("_s", "_ms", "_before", "_after"))}
        print(r["mode"], extra)


if __name__ == "__main__":
    main()
