"""The experience table's traffic of one GRPO iteration: the TransferDock (cells in the driver) against
``data_strategy: tq`` (cells in TransferQueue's storage units, Ray actors reached over ZMQ).

    PYTHONPATH=src /work/wt/F-venv/bin/python benchmarks/cluster/bench_tq.py --out results_tq.json

Needs ``pip install 'posttrain[tq]' torch==<your torch>``. Each repeat runs the puts and reads of one
on-policy iteration in the loop's order and columns (posttrain.loops.experience): the prompts (put
``n`` times each), the rollout's responses and lengths, the scores, the advantages, the reference and
old log-probs (per token), and the update's read of every row with its per-token columns. Timed:
the seconds of all puts and of all reads of the iteration, and TransferQueue's start (``ray.init``,
controller and storage actors). Reported: medians over ``--repeats``, the batch's bytes, the load
average before and after (the machine's other work changes the TQ numbers: its client, controller and
storage units are separate processes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from types import SimpleNamespace

SHAPES = {  # name: (prompts, samples per prompt, prompt tokens, response tokens)
    "test_run": (4, 8, 24, 12),  # tests/cluster/test_transfer_queue.py's GRPO run
    "seed_like": (32, 16, 256, 1024),  # the seed's gbs 32 x n 16 with 1k-token responses
}
PER_TOKEN = ("ref_logprobs", "old_logprobs", "advantages")


def batch(prompts: int, n: int, prompt_len: int, response_len: int, seed: int = 0) -> dict:
    """Prompts, responses of varying length (half to full ``response_len``), their per-token floats."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(response_len // 2, response_len + 1, (prompts * n,), generator=g).tolist()
    return {"prompts": [torch.randint(3, 1000, (prompt_len,), generator=g) for _ in range(prompts)],
            "responses": [torch.randint(3, 1000, (k,), generator=g) for k in lengths],
            "floats": [torch.randn(k, generator=g) for k in lengths], "lengths": lengths}


def iteration(dock, data: dict) -> tuple[float, float]:
    """One iteration's puts and reads, in the loop's order: (seconds of the puts, seconds of the reads)."""
    rows = list(range(dock.max_len))
    put = get = 0.0

    def timed_put(columns, values, indexes=rows):
        nonlocal put
        start = time.perf_counter()
        dock.put(columns, indexes, values)
        put += time.perf_counter() - start

    def timed_get(consumer, columns):
        nonlocal get
        start = time.perf_counter()
        out, idx = dock.get(consumer, columns, dock.max_len)
        get += time.perf_counter() - start
        return idx

    start = time.perf_counter()
    dock.put_prompts({"prompts": data["prompts"]})
    put += time.perf_counter() - start
    idx = timed_get("rollout", ["prompts"])
    timed_put(["responses", "response_length"], [[data["responses"][i] for i in idx],
                                                 [data["lengths"][i] for i in idx]], idx)
    idx = timed_get("reward", ["prompts", "responses"])
    timed_put(["scores"], [[float(i % 2) for i in idx]], idx)
    idx = timed_get("advantages", ["scores", "response_length"])
    timed_put(["advantages"], [[data["floats"][i] for i in idx]], idx)
    for column in ("ref_logprobs", "old_logprobs"):
        idx = timed_get(column, ["prompts", "responses", "response_length"])
        timed_put([column], [[data["floats"][i] for i in idx]], idx)
    timed_get("actor_update", ["prompts", "responses", "response_length", *PER_TOKEN])
    return put, get


def measure(make_dock, data: dict, repeats: int) -> dict:
    puts, gets = [], []
    for _ in range(repeats):
        dock = make_dock()
        p, g = iteration(dock, data)
        puts.append(p)
        gets.append(g)
        dock.clear()
    return {"put_s": statistics.median(puts), "get_s": statistics.median(gets), "repeats": repeats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shards", type=int, default=1, help="TransferQueue storage units")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    from posttrain.cluster.transfer_queue import TransferQueueStore
    from posttrain.config.options import ClusterOptions
    from posttrain.loops.experience import new_dock

    results = {"load_before": os.getloadavg(), "cpus": os.cpu_count(), "shards": args.shards, "shapes": {}}
    start = time.perf_counter()
    store = TransferQueueStore.start(SimpleNamespace(cluster=ClusterOptions(), queue_shards=args.shards,
                                                     data_strategy="tq"))
    results["tq_start_s"] = time.perf_counter() - start
    try:
        for name, (prompts, n, prompt_len, response_len) in SHAPES.items():
            data = batch(prompts, n, prompt_len, response_len)
            tokens = prompts * n * prompt_len + sum(data["lengths"])
            row = {"rows": prompts * n, "int64_tokens": tokens, "float32_values": 3 * sum(data["lengths"]),
                   "mib": (8 * tokens + 4 * 3 * sum(data["lengths"])) / 2**20}
            for strategy, queue in (("td", None), ("tq", store)):
                row[strategy] = measure(lambda: new_dock(prompts * n, n, guarantee_order=False, seed=0, queue=queue),
                                        data, args.repeats)
            results["shapes"][name] = row
            print(name, json.dumps(row))
    finally:
        store.close()
    results["load_after"] = os.getloadavg()
    print(json.dumps({k: v for k, v in results.items() if k != "shapes"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
