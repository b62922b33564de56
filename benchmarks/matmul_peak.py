"""Matmul peak of this machine, fp32 and bf16, at a few thread counts (the MFU denominator).

    python benchmarks/matmul_peak.py [--threads 1 2] [--seconds 2] [--size 1024] [--tokens 1136]

Prints the best GFLOP/s of a square matmul per dtype and thread count (posttrain.commands.bench.
matmul_peak: in fp32 the better of PyTorch's BLAS and oneDNN's GEMM), the CPU's bf16 flags, and how many cores other processes used meanwhile.
``--tokens T`` also times the matmuls of SmolLM2-135M's update at T tokens per micro-batch (each
linear layer's forward ``x W^T`` and its two backward products), weighted by how often each
occurs: what the model's own shapes reach against the square peak, i.e. how close to the FLOP
floor an update can get here.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from posttrain.commands.bench import CpuMeter, matmul_peak
from posttrain.device import best_seconds


# SmolLM2-135M's linear layers as (in, out, count per token pass): q, k, v, o, gate, up, down x 30
# layers, and the tied LM head
SMOLLM2_LINEARS = [(576, 576, 60), (576, 192, 60), (576, 1536, 60), (1536, 576, 30), (576, 49152, 1)]


def model_shapes(tokens: int, dtype: torch.dtype, seconds: float) -> float:
    """FLOP/s of one update's matmuls (forward + both backward products) at ``tokens`` tokens."""
    flops = total = 0.0
    for d_in, d_out, count in SMOLLM2_LINEARS:
        x, w = torch.randn(tokens, d_in).to(dtype), torch.randn(d_out, d_in).to(dtype)
        dy = torch.randn(tokens, d_out).to(dtype)
        for fn in (lambda: x @ w.T, lambda: dy @ w, lambda: dy.T @ x):  # forward, dX, dW
            total += count * best_seconds(fn, seconds / 15)
            flops += count * 2.0 * tokens * d_in * d_out
    return flops / total


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=0, help="also time SmolLM2-135M's update matmuls at this many tokens")
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
            if args.tokens:
                with CpuMeter() as meter:
                    rate = model_shapes(args.tokens, getattr(torch, dtype), args.seconds)
                print(f"threads {threads} {dtype:<9} {rate / 1e9:8.1f} GFLOP/s on SmolLM2's update matmuls at "
                      f"{args.tokens} tokens ({100 * rate / peak:.0f}% of the square peak; others used "
                      f"{meter.result['others_cores']:.2f} cores)")


if __name__ == "__main__":
    main()
