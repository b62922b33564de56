"""Matmul peak of this machine, fp32 and bf16, at a few thread counts (the MFU denominator).

    python benchmarks/matmul_peak.py [--threads 1 2] [--seconds 2] [--size 1024]

Prints the best GFLOP/s of a square matmul per dtype and thread count (posttrain.trainers.
bench_cmd.matmul_peak), the CPU's bf16 flags, and how many cores other processes used meanwhile.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from posttrain.commands.bench import CpuMeter, matmul_peak


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--size", type=int, default=1024)
    args = p.parse_args()
    flags = Path("/proc/cpuinfo").read_text()
    print("bf16 units:", [f for f in ("amx_bf16", "avx512_bf16") if f in flags] or "none")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for dtype in ("float32", "bfloat16"):
            with CpuMeter() as meter:
                peak = matmul_peak(dtype, "cpu", size=args.size, seconds=args.seconds)
            print(f"threads {threads} {dtype:<9} {peak / 1e9:8.1f} GFLOP/s   "
                  f"(others used {meter.result['others_cores']:.2f} of {meter.result['num_cpus']} cores)")


if __name__ == "__main__":
    main()
