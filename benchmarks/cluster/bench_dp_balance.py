"""``rl_config.use_dp_batch_balance`` on a skewed batch: 2 Ray DDP workers x 1 thread, the actor's
log-prob pass and its update, with contiguous shares and with token-balanced ones.

    PYTHONPATH=src .venv/bin/python benchmarks/cluster/bench_dp_balance.py --work /tmp/bench_balance

Workload: the tiny Qwen2 of bench_cluster.py (hidden 384, 6 layers, fp32), ``use_remove_padding``
(each micro-batch packs its real tokens; without packing every row pads to the batch's width and
there is nothing to balance), one synthetic batch of 32 rows: 16-token prompts, the first half of
the rows with 192-token responses, the second half with 24 (8x shorter), micro-batches of 8 rows,
one optimizer step (the mini-batch is the batch). Contiguous shares give one
worker all the long rows; balanced shares give each worker the same tokens. The same workers and
batch serve both settings (``Cluster.balance`` switched between repeats, the order alternated);
every timing is one call from the driver (shipping the rows, the workers' work, the answer).

Two measures per call: the driver's wall time, and each worker's CPU seconds (``psutil`` on the
worker's pid, user + system). On a machine whose cores are shared with other work (more runnable
processes than cores) the wall time follows the total work, which balancing does not change; the
slowest worker's CPU seconds are the step's critical path when every worker has its own core, which
is what balancing shortens. Reported: medians over ``--repeats`` of each phase and measure, the
ratios contiguous / balanced, the machine's load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cluster import config, prepare  # noqa: E402

LONG, SHORT, PROMPT, ROWS = 192, 24, 16, 32


def skewed_batch(vocab: int, seed: int = 0) -> dict:
    import torch

    from posttrain.training.batch import build_batch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (PROMPT,), generator=g) for _ in range(ROWS)]
    responses = [torch.randint(3, vocab, (LONG if i < ROWS // 2 else SHORT,), generator=g) for i in range(ROWS)]
    batch = build_batch(prompts, responses, pad_token_id=0)
    width = batch["response_mask"].shape[1]
    batch["old_logprobs"] = torch.zeros(ROWS, width)
    batch["advantages"] = torch.randn(ROWS, generator=g)[:, None].expand(ROWS, width).contiguous()
    return batch


def timed(fn, workers) -> tuple[float, list[float]]:
    """The wall seconds of ``fn()`` and the CPU seconds each worker process spent meanwhile."""
    before = [sum(w.cpu_times()[:2]) for w in workers]
    start = time.perf_counter()
    fn()
    wall = time.perf_counter() - start
    return wall, [sum(w.cpu_times()[:2]) - b for w, b in zip(workers, before)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_balance"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("results_dp_balance.json"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    import psutil
    import ray
    import torch

    from posttrain.config.plan import resolve_plan
    from posttrain.config.run import run_config_from_dict
    from posttrain.loops.build import build_trainer
    from posttrain.training.loss_fns import make_actor_loss_fn

    torch.set_num_threads(1)
    model, data = prepare(args.work)
    raw = config(model, data, args.work, "ray2", 1).raw
    raw["rl_config"].update(use_remove_padding=True, use_dp_batch_balance=True,
                            output_dir=str(args.work / f"run_balance_{int(time.time())}"))
    raw["megatron_training"].update(seq_length=PROMPT + LONG, micro_batch_size=8)
    raw["generate_config"]["max_model_len"] = PROMPT + LONG
    cfg = run_config_from_dict(raw, name="bench_dp_balance")
    # Ray's workers run at niceness 15 by default: on a shared machine they would wait behind everything
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", _system_config={"worker_niceness": 0})
    load = {"before": os.getloadavg()}
    session = build_trainer(resolve_plan(cfg, device="cpu")).s
    cluster, actor = session.cluster, session.policy.actor
    batch = skewed_batch(len(session.policy.tokenizer))
    loss_fn = make_actor_loss_fn()
    phases = {"logprobs": lambda: actor.compute_logprobs(batch),
              "update": lambda: actor.update(batch, loss_fn, mini_batch_size=ROWS)}
    workers = [psutil.Process(info["pid"]) for info in cluster.info]
    times: dict[str, dict[str, list[float]]] = {p: {"contiguous": [], "balanced": []} for p in phases}
    cpu: dict[str, dict[str, list[list[float]]]] = {p: {"contiguous": [], "balanced": []} for p in phases}
    try:
        for repeat in range(args.repeats + 1):  # the first round warms up
            order = ("contiguous", "balanced") if repeat % 2 else ("balanced", "contiguous")
            for setting in order:
                cluster.balance = setting == "balanced"
                for phase, fn in phases.items():
                    seconds, worker_cpu = timed(fn, workers)
                    if repeat:
                        times[phase][setting].append(seconds)
                        cpu[phase][setting].append(worker_cpu)
                    print(f"round {repeat} {setting} {phase}: {seconds:.2f} s wall, workers' CPU "
                          f"{', '.join(f'{c:.2f}' for c in worker_cpu)} s", file=sys.stderr, flush=True)
    finally:
        session.close()
        ray.shutdown()
    load["after"] = os.getloadavg()
    medians = {p: {s: statistics.median(v) for s, v in t.items()} for p, t in times.items()}
    slowest = {p: {s: statistics.median(max(c) for c in v) for s, v in t.items()} for p, t in cpu.items()}
    result = {"workload": {"rows": ROWS, "prompt": PROMPT, "long": LONG, "short": SHORT, "workers": 2,
                           "threads_per_worker": 1, "model": "tiny_qwen2 (hidden 384, 6 layers)",
                           "use_remove_padding": True, "micro_batch_size": 8},
              "repeats": args.repeats, "wall_s": times, "worker_cpu_s": cpu, "median_wall_s": medians,
              "median_slowest_worker_cpu_s": slowest,
              "ratio_wall_contiguous_over_balanced": {p: m["contiguous"] / m["balanced"] for p, m in medians.items()},
              "ratio_critical_path_contiguous_over_balanced": {p: m["contiguous"] / m["balanced"]
                                                               for p, m in slowest.items()},
              "loadavg": load, "cpus": os.cpu_count()}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k.startswith(("median", "ratio", "load"))}, indent=2))


if __name__ == "__main__":
    main()
