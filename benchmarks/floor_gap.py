"""Where a step's distance from its FLOP floor goes: matrix multiplications against the rest, per phase.

    posttrain bench --config-name bench_chat --config-path /tmp/perf/work --iters 1 --warmup 1 \\
        --profile /tmp/prof --output /tmp/prof/bench.json --force
    python benchmarks/floor_gap.py /tmp/prof

``posttrain bench`` sets each phase's floor at its model FLOPs over the matmul peak it measured on
the spot (``timing/<phase> x mfu/<phase>``). This script reads the profiled iteration's trace
(``trace.json``) and sums, inside each phase, the time of the leaf matrix-multiplication kernels
(the BLAS's ``aten::mm``, ``addmm``, ``bmm``, or oneDNN's ``mkldnn::_linear_pointwise``) and of the
attention kernels (SDPA forward and backward). The matmuls alone, at the speed the kernels run them
at the workload's shapes, bound the step from below: no change outside the kernels brings a step
under ``sum(matmul time) / floor`` times its floor.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise")  # the last: oneDNN (cpu_linear)
PHASES = ("rollout", "update")


def kernel_times(trace: dict, phase_spans: dict[str, tuple[float, float]]) -> dict[str, dict[str, float]]:
    """Seconds of matmul and attention kernels that start inside each phase's span."""
    out = {p: {"matmul": 0.0, "attention": 0.0} for p in phase_spans}
    for event in trace["traceEvents"]:
        if event.get("ph") != "X":
            continue
        name = event["name"]
        kind = "matmul" if name in MATMUL else "attention" if name.startswith("aten::_scaled_dot_product") else None
        if kind is None:
            continue
        for phase, (start, end) in phase_spans.items():
            if start <= event["ts"] <= end:
                out[phase][kind] += event["dur"] / 1e6
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile_dir", help="the --profile DIR of posttrain bench, holding trace.json and bench.json")
    p.add_argument("--bench", default=None, help="posttrain bench --output JSON (default: DIR/bench.json)")
    args = p.parse_args()

    folder = Path(args.profile_dir)
    bench = json.loads(Path(args.bench or folder / "bench.json").read_text())
    trace = json.loads((folder / "trace.json").read_text())
    spans = {}
    for event in trace["traceEvents"]:
        name = event.get("name", "")
        if event.get("ph") == "X" and name.startswith("timing/") and name[len("timing/"):] in PHASES:
            spans[name[len("timing/"):]] = (event["ts"], event["ts"] + event["dur"])
    if set(spans) != set(PHASES):
        raise SystemExit(f"{folder / 'trace.json'}: no timing/rollout and timing/update spans; profile an on-policy run")
    kernels = kernel_times(trace, spans)
    summary = bench["summary"]
    floor_all = summary["floor_s"]["median"]
    step = summary["timing/all"]["median"]
    print(f"matmul peak {bench['matmul_peak_gflops']:.1f} GFLOP/s, {bench['torch_threads']} threads, "
          f"{bench['train_dtype']} train / {bench['rollout_dtype']} rollout")
    print(f"{'phase':<8} {'time':>7} {'floor':>7} {'matmul':>7} {'attn':>7} {'rest':>7} {'matmul/floor':>13}")
    matmul_total = 0.0
    for phase in PHASES:
        took = summary[f"timing/{phase}"]["median"]
        floor = took * summary[f"mfu/{phase}"]["median"]
        mm, attn = kernels[phase]["matmul"], kernels[phase]["attention"]
        matmul_total += mm
        print(f"{phase:<8} {took:7.2f} {floor:7.2f} {mm:7.2f} {attn:7.2f} {took - mm - attn:7.2f} {mm / floor:12.2f}x")
    print(f"step {step:.2f} s = {step / floor_all:.2f}x its floor ({floor_all:.2f} s); its matmuls alone take "
          f"{matmul_total:.2f} s = {matmul_total / floor_all:.2f}x the floor, the lower bound with these kernels")


if __name__ == "__main__":
    main()
