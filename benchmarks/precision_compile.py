"""fp32 vs bf16 autocast vs torch.compile for the update's forward + backward (and a forward alone).

    python benchmarks/precision_compile.py [--model tiny|DIR] [--rows 64] [--seq 72] [--repeats 5] [--threads 1]
                                           [--no-bf16] [--no-compile]

Times ``response_logprobs`` forward + backward over a ``[rows, seq]`` batch of the model, median
of ``--repeats`` after one warm-up (compile time is reported separately), and records the CPU
cores other processes used meanwhile. The master weights stay fp32 in every variant.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from posttrain.commands.bench import CpuMeter
from posttrain.training.forward import response_logprobs
from posttrain.training.batch import build_batch


def load(model: str):
    from transformers import AutoModelForCausalLM

    if model == "tiny":
        from posttrain.commands.init_model import init_model

        model = str(init_model("tiny_qwen2", Path(tempfile.mkdtemp()) / "tiny"))
    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="sdpa")


def step(model, batch, dtype, backward=True):
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else torch.autocast("cpu", enabled=False)
    with torch.set_grad_enabled(backward), ctx:
        lp, _ = response_logprobs(model, batch)
    if backward:
        lp.sum().backward()
        model.zero_grad(set_to_none=True)


def timed(fn, repeats):
    with CpuMeter() as meter:
        start = time.perf_counter()
        fn()
        first = time.perf_counter() - start
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return first, statistics.median(times), meter.result["others_cores"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--seq", type=int, default=72)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--no-bf16", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = load(args.model).train()
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (8,), generator=g).tolist() for _ in range(args.rows)]
    resps = [torch.randint(3, vocab, (args.seq - 8,), generator=g).tolist() for _ in range(args.rows)]
    batch = build_batch(prompts, resps, pad_token_id=0)
    variants = {"fp32 eager": (model, "fp32")}
    if not args.no_bf16:
        variants["bf16 autocast eager"] = (model, "bf16")
    if not args.no_compile:
        variants["fp32 torch.compile"] = (torch.compile(model), "fp32")
    print(f"{args.rows} x {args.seq} tokens, {args.threads} threads")
    for name, (net, dtype) in variants.items():
        for backward in (False, True):
            first, median, others = timed(lambda: step(net, batch, dtype, backward), args.repeats)
            what = "fwd+bwd" if backward else "fwd    "
            print(f"{name:<22} {what} median {median:7.3f} s  first call {first:7.2f} s  others {others:.2f} cores",
                  flush=True)


if __name__ == "__main__":
    main()
