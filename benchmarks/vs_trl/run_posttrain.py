"""One posttrain GRPO run on the shared setup (common.py); writes per-step records as JSON.

    python benchmarks/vs_trl/run_posttrain.py --work /tmp/perf/work --size tiny --steps 4 --threads 2 --out pt.json

Extra config keys: ``--set rl_config.use_remove_padding=true`` (repeatable; YAML values).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", default="/tmp/perf/work")
    p.add_argument("--size", default="tiny")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--set", action="append", default=[], help="section.key=value")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from common import posttrain_config, prepare, settings
    from posttrain.config.run import run_config_from_dict
    from posttrain.commands.bench import bench

    paths = prepare(Path(args.work), args.size)
    extra = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.set)}
    cfg = run_config_from_dict(posttrain_config(paths, args.steps, str(Path(args.out).with_suffix(".pt_out")), extra,
                                                args.size),
                               name=f"vs_trl_{args.size}")
    start = time.time()
    report = bench(cfg, iters=args.steps - 1, warmup=1)
    rows = settings(args.size)["num_prompts"] * settings(args.size)["n"]
    records = []
    for step, rec in enumerate(report["iterations"], start=1):
        tokens = (rec["prompt_length/mean"] + rec["response_length/mean"]) * rows
        records.append({"step": step, "tokens": tokens, "e2e_tokens_per_s": tokens / rec["cpu/wall_s"],
                        "reward": rec.get("grpo/score/mean"), **rec})
    out = {"side": "posttrain", "size": args.size, "threads": args.threads, "total_s": time.time() - start,
           "settings": args.set, "bench": {k: v for k, v in report.items() if k != "iterations"},
           "records": records}
    Path(args.out).write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
