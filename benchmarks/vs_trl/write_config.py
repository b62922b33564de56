"""Write the posttrain side of the vs_trl setup as a YAML config for ``posttrain bench``.

    python benchmarks/vs_trl/write_config.py --work /tmp/perf/work --size tiny
    posttrain bench --config-name bench_tiny --config-path /tmp/perf/work --iters 3 --warmup 1
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
    args = p.parse_args()
    from common import posttrain_config, prepare

    work = Path(args.work)
    paths = prepare(work, args.size)
    cfg = posttrain_config(paths, args.steps, str(work / f"bench_{args.size}_out"), size=args.size)
    out = work / f"bench_{args.size}.yaml"
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    print(out)


if __name__ == "__main__":
    main()
