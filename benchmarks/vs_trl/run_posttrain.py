"""One posttrain GRPO run on the shared setup (common.py); writes per-step records as JSON.

    python benchmarks/vs_trl/run_posttrain.py --work /tmp/perf/work --size tiny --steps 4 --threads 2 --out pt.json

Extra config keys: ``--set rl_config.use_remove_padding=true`` (repeatable; YAML values).
With ``--save DIR`` the run trains every step (``posttrain train``, none of them a warm-up) and
saves the final model in DIR, for ``learning.py``.
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
    p.add_argument("--save", default=None, help="train all steps and save the final model here")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                   help="fp32 pinned, or bf16: posttrain's hardware default")
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from common import posttrain_config, prepare, settings
    from posttrain.config.run import run_config_from_dict
    from posttrain.commands.bench import bench

    paths = prepare(Path(args.work), args.size)
    extra = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.set)}
    if args.save:
        extra.update({"actor_config.save": args.save, "actor_config.save_interval": args.steps})
    cfg = run_config_from_dict(posttrain_config(paths, args.steps, str(Path(args.out).with_suffix(".pt_out")), extra,
                                                args.size, args.precision),
                               name=f"vs_trl_{args.size}")
    start = time.time()
    if args.save:
        Path(args.out).write_text(json.dumps(train_records(cfg, start), indent=2))
        return
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


def train_records(cfg, start: float) -> dict:
    """Train ``cfg`` to the end; its reward and step time per iteration, from metrics.jsonl."""
    import resource

    from posttrain.data.readers import read_jsonl
    from posttrain.commands.train import train_config as train

    train(cfg)
    rows = read_jsonl(Path(cfg.rl.output_dir) / "metrics.jsonl", strict=True)
    records = [{"step": r["iteration"], "reward": r["grpo/score/mean"], "step_s": r["timing/all"],
                "response_length": r["response_length/mean"]} for r in rows if "grpo/score/mean" in r]
    return {"side": "posttrain", "total_s": time.time() - start, "records": records,
            "peak_memory_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


if __name__ == "__main__":
    main()
