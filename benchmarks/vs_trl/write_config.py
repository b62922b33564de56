"""Write the posttrain side of the vs_trl setup as a YAML config for ``posttrain bench``.

    python benchmarks/vs_trl/write_config.py --work /tmp/perf/work --size tiny
    posttrain bench --config-name bench_tiny --config-path /tmp/perf/work --iters 3 --warmup 1

``--precision fp32`` (the default) pins training and rollout to fp32 and writes ``bench_<size>.yaml``;
``bf16`` leaves both to posttrain's hardware default and writes ``bench_<size>_bf16.yaml``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", default="/tmp/perf/work")
    p.add_argument("--size", default="tiny")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    args = p.parse_args()
    from common import posttrain_config, prepare

    work = Path(args.work)
    paths = prepare(work, args.size)
    name = f"bench_{args.size}" + ("_bf16" if args.precision == "bf16" else "")
    cfg = posttrain_config(paths, args.steps, str(work / f"{name}_out"), size=args.size, precision=args.precision)
    out = work / f"{name}.yaml"
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    print(out)


if __name__ == "__main__":
    main()
