"""posttrain vs TRL GRPOTrainer, same model/data/reward/hyperparameters, alternating runs.

    python benchmarks/vs_trl/run.py --size tiny --steps 4 --repeats 2 --threads 2

Both sides in fp32 by default; ``--precision bf16`` runs TRL with ``bf16=True`` and posttrain with
its hardware default (bf16 training and rollout where the CPU has AMX or AVX512-BF16).

Each run is a fresh process (``run_posttrain.py`` / ``run_trl.py``); the side that goes first
alternates between repeats. Step 1 of every run is a warm-up and is not timed. Per run: the median
over its timed steps of end-to-end tokens/s (prompt + completion tokens of all 64 samples / step
wall time); then the median over repeats per side and the ratio posttrain / TRL. Also printed:
the reward per step of each side (mean over repeats) and the CPU cores that *other* processes used
during the timed steps (from /proc/stat), since the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
from common import MODELS, SETTINGS, WORKLOAD_ENV, prepare  # noqa: E402
from machine_record import available_gib, load_average, machine  # noqa: E402

SCRIPTS = {"posttrain": HERE / "run_posttrain.py", "trl": HERE / "run_trl.py"}


def one_run(side: str, args, rep: int) -> dict:
    out = Path(args.work) / "runs" / f"{name(args)}_{side}_{rep}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(SCRIPTS[side]), "--work", args.work, "--size", args.size, "--steps",
           str(args.steps), "--threads", str(args.threads), "--out", str(out), "--precision", args.precision]
    if side == "posttrain":
        for item in args.set:
            cmd += ["--set", item]
    free = available_gib()
    if args.min_free_gib and free is not None and free < args.min_free_gib:
        raise SystemExit(f"{side} run {rep}: {free:.1f} GiB of memory available, under --min-free-gib "
                         f"{args.min_free_gib} (TRL's fp32 chat run peaks near 19 GiB); free memory or lower it")
    start, load_before = time.time(), load_average()
    env = {**os.environ, WORKLOAD_ENV: json.dumps(args.workload)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    load_after = load_average()
    if proc.returncode != 0:
        raise SystemExit(f"{side} run failed:\n{proc.stderr[-4000:]}")
    result = json.loads(out.read_text())
    timed = result["records"][1:]
    result["tps"] = statistics.median(r["e2e_tokens_per_s"] for r in timed)
    result["step_s"] = statistics.median(r["cpu/wall_s"] for r in timed)
    result["others_cores"] = statistics.median(r["cpu/others_cores"] for r in timed)
    result["peak_mib"] = result.get("peak_memory_mib") or result.get("bench", {}).get("peak_memory_mib")
    result["loadavg"] = {"before": load_before, "after": load_after}
    result["mem_available_gib_before"] = free
    chosen = result.get("bench", {}).get("run", {})  # posttrain's kernel choices (its run.json)
    kernels = f"  linear {chosen.get('cpu_linear')}, packed rollout {chosen.get('rollout_packed_weights')}" \
        if chosen else ""
    print(f"  rep {rep} {side:<9} {result['tps']:8.1f} tok/s  step {result['step_s']:6.2f} s  "
          f"peak RSS {result['peak_mib'] or 0:.0f} MiB  others {result['others_cores']:.2f} cores  "
          f"load {load_before[0] if load_before else 0:.1f}->{load_after[0] if load_after else 0:.1f} "
          f"({time.time() - start:.0f} s){kernels}", flush=True)
    return result


def workload(parser, items: list[str]) -> dict:
    """``--workload KEY=VALUE`` items as a dict of SETTINGS keys (YAML values)."""
    import yaml

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in SETTINGS:
            parser.error(f"--workload {item!r}: use KEY=VALUE with KEY one of {', '.join(SETTINGS)}")
        out[key] = yaml.safe_load(value)
    return out


def name(args) -> str:
    """The size, the changed settings and the precision, for file names and the summary."""
    changed = "".join(f"_{key}{value}" for key, value in sorted(args.workload.items()))
    return f"{args.size}{changed}_{args.precision}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", default="/tmp/perf/work")
    p.add_argument("--size", default="tiny", choices=list(MODELS))
    p.add_argument("--workload", action="append", default=[], metavar="KEY=VALUE",
                   help=f"a setting of both sides changed from the size's (common.SETTINGS: {', '.join(SETTINGS)})")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--set", action="append", default=[], help="extra posttrain config key=value")
    p.add_argument("--output", default=None)
    p.add_argument("--min-free-gib", type=float, default=0.0,
                   help="refuse to start a run with less memory available (a shared machine: an OOM kill hits others)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                   help="bf16: TRL with bf16=True, posttrain with its hardware default")
    args = p.parse_args()
    args.workload = workload(p, args.workload)

    prepare(Path(args.work), args.size)
    host = machine(args.threads)
    print(f"{host['cpu']} ({', '.join(host['flags'])}; {host['cpus']} CPUs), torch {host['torch']}, "
          f"{args.threads} threads, load {host['loadavg']}", flush=True)
    runs: dict[str, list[dict]] = {"posttrain": [], "trl": []}
    for rep in range(args.repeats):
        order = ["posttrain", "trl"] if rep % 2 == 0 else ["trl", "posttrain"]
        for side in order:
            runs[side].append(one_run(side, args, rep))
    summary = {}
    for side, results in runs.items():
        rewards = [[r.get("reward") for r in res["records"]] for res in results]
        summary[side] = {
            "tps_median": statistics.median(r["tps"] for r in results),
            "tps_runs": [r["tps"] for r in results],
            "step_s_median": statistics.median(r["step_s"] for r in results),
            "step_s_runs": [[rec["cpu/wall_s"] for rec in r["records"][1:]] for r in results],
            "loadavg_runs": [r["loadavg"] for r in results],
            "others_cores_runs": [r["others_cores"] for r in results],
            "peak_mib_runs": [r["peak_mib"] for r in results],
            "reward_curve": [statistics.mean(x for x in col if x is not None) for col in zip(*rewards)],
        }
    ratio = summary["posttrain"]["tps_median"] / summary["trl"]["tps_median"]
    print(f"\n{name(args)}: posttrain {summary['posttrain']['tps_median']:.1f} tok/s, "
          f"TRL {summary['trl']['tps_median']:.1f} tok/s, ratio {ratio:.2f}x "
          f"({args.repeats} repeats x {args.steps - 1} timed steps, {args.threads} threads, {args.precision})")
    pt, trl = summary["posttrain"], summary["trl"]
    print(f"  median step: posttrain {pt['step_s_median']:.1f} s, TRL {trl['step_s_median']:.1f} s "
          f"({trl['step_s_median'] / pt['step_s_median']:.2f}x); peak RSS MiB: posttrain {pt['peak_mib_runs']}, "
          f"TRL {trl['peak_mib_runs']}")
    for side in runs:
        curve = " ".join(f"{x:.3f}" for x in summary[side]["reward_curve"])
        print(f"  reward per step {side:<9}: {curve}")
    report = {"size": args.size, "workload": args.workload, "steps": args.steps, "repeats": args.repeats,
              "threads": args.threads, "precision": args.precision,
              "posttrain_settings": args.set, "ratio": ratio, "summary": summary, "machine": host,
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out = Path(args.output or Path(args.work) / f"vs_trl_{name(args)}.json")
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
