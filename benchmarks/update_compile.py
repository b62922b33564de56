"""The update's non-matmul time: eager vs the compiled RMSNorm / SiLU-mul regions, interleaved in one process.

    PYTHONPATH=src python benchmarks/update_compile.py [--model smollm2|tiny|DIR] [--threads 1]
                                                      [--repeats 5] [--profile] [--regions rms_norm,silu_mul]

The workload is the update of issue 22's chat workload: SmolLM2-135M-Instruct in fp32, 8 prompts of
54 tokens x 8 samples with answers of 6 to 64 tokens (mean 18.75), packed with shared prompts
(posttrain's defaults), the chunked LM head at temperature 0.5, the fp32 linear kernel the run would
choose (:mod:`posttrain.models.cpu_linear`), and torch's fused AdamW. One step = the actor's
forward + backward + optimizer step; a log-prob pass = the same forward without a graph (old
log-probs, the reference). Eager and compiled steps alternate (``--repeats`` pairs) so the load of
a shared machine falls on both alike; the script prints the medians, the median of the per-pair
ratios, the first compiled call (compile time, which Inductor's disk cache shortens in later
processes), the CPU model, the thread count, the linear kernel and the cores other processes used
(``/proc/stat``). ``--profile`` prints the eager step's top operators by self time first.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from posttrain.commands.bench import CpuMeter
from posttrain.models.cpu_linear import resolve_cpu_linear, set_cpu_linear
from posttrain.training.batch import build_batch
from posttrain.training.forward import response_logprobs
from posttrain.training.fused_regions import fused_regions
from posttrain.training.remove_padding import Packing

ANSWER_LENGTHS = (6, 8, 10, 12, 14, 16, 20, 64)


def load(model: str):
    from transformers import AutoModelForCausalLM

    if model == "smollm2":
        from posttrain.demo.pretrained import ensure_smollm2

        model = str(ensure_smollm2())
    elif model == "tiny":
        from posttrain.commands.init_model import init_model

        model = str(init_model("tiny_qwen2", Path(tempfile.mkdtemp()) / "tiny"))
    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="sdpa").train()


def chat_batch(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (54,), generator=g).tolist() for _ in range(8)]
    answers = [torch.randint(3, vocab, (ANSWER_LENGTHS[i % 8],), generator=g).tolist() for i in range(64)]
    return build_batch([p for p in prompts for _ in range(8)], answers, pad_token_id=0)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def make_step(model, batch, optimizer, train: bool):
    packing = Packing(share_prompts=True)

    def step():
        with torch.set_grad_enabled(train):
            lp, _ = response_logprobs(model, batch, temperature=0.5, with_entropy=True, entropy_grad=False,
                                      packing=packing)
        if train:
            (lp.sum() / 1000).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return step


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def compare(model, step, repeats: int, names: tuple[str, ...]) -> dict:
    """Alternate eager and compiled calls of ``step``; the first compiled call is the compile."""
    with fused_regions(model, names=names):
        first = timed(step)
    eager, fused = [], []
    with CpuMeter() as meter:
        for _ in range(repeats):
            eager.append(timed(step))
            with fused_regions(model, names=names):
                fused.append(timed(step))
    ratios = [e / f for e, f in zip(eager, fused)]
    return {"first": first, "eager": statistics.median(eager), "fused": statistics.median(fused),
            "ratio": statistics.median(ratios), "others": meter.result["others_cores"],
            "pairs": " ".join(f"{e:.2f}/{f:.2f}" for e, f in zip(eager, fused))}


def region_times(tokens: int, hidden: int, inter: int, repeats: int) -> None:
    """Best of ``repeats`` (robust to a shared machine's load) for each region alone, eager and compiled,
    forward + backward and forward alone, at the chat update's packed shape ``[1, tokens, .]``."""
    from posttrain.training.fused_regions import compiled, rms_norm, silu_mul

    x, w = torch.randn(1, tokens, hidden), torch.randn(hidden)
    gate, up = torch.randn(1, tokens, inter), torch.randn(1, tokens, inter)
    cases = {"rms_norm": (rms_norm, (x, w, 1e-5)), "silu_mul": (silu_mul, (gate, up))}
    for name, (eager, args) in cases.items():
        grad_out = torch.randn_like(args[0])
        for backward in (True, False):
            leaves = [a.detach().requires_grad_(backward) if isinstance(a, torch.Tensor) else a for a in args]
            best = {}
            for label, fn in (("eager", eager), ("compiled", compiled(name))):
                def call():
                    with torch.set_grad_enabled(backward):
                        out = fn(*leaves)
                        if backward:  # a dense upstream gradient, as in the model (sum()'s is a stride-0 view)
                            out.backward(grad_out)
                first = timed(call)
                best[label] = min(timed(call) for _ in range(repeats))
                if label == "compiled":
                    best["first"] = first
            print(f"{name:<9} {'fwd+bwd' if backward else 'fwd    '} eager {best['eager'] * 1e3:7.2f} ms  "
                  f"compiled {best['compiled'] * 1e3:7.2f} ms  eager/compiled {best['eager'] / best['compiled']:.2f}x  "
                  f"(best of {repeats}; first compiled call {best['first']:.1f} s)", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--regions", default="rms_norm,silu_mul")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--no-logprob", action="store_true", help="time the update step only")
    p.add_argument("--regions-only", action="store_true", help="time each region alone (SmolLM2's shapes)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.regions_only:
        print(f"{cpu_model()}; {args.threads} threads; load {os.getloadavg()[0]:.2f}")
        return region_times(1632, 576, 1536, max(args.repeats, 20))
    kernel = resolve_cpu_linear("cpu")
    set_cpu_linear(kernel)
    names = tuple(args.regions.split(","))
    model = load(args.model)
    batch = chat_batch(model.config.vocab_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7, fused=True)
    print(f"{cpu_model()}; {args.threads} threads; linear {kernel}; torch {torch.__version__}; "
          f"regions {','.join(names)}; load {os.getloadavg()[0]:.2f}", flush=True)
    train, logprob = make_step(model, batch, optimizer, True), make_step(model, batch, optimizer, False)
    train()  # warm-up: the eager path's first call
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            train()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    for what, step in (("update step", train), ("log-prob pass", logprob))[:1 if args.no_logprob else 2]:
        r = compare(model, step, args.repeats, names)
        print(f"{what:<14} eager {r['eager']:6.3f} s  compiled {r['fused']:6.3f} s  eager/compiled "
              f"{r['ratio']:.3f}x (median of {args.repeats} pairs)  first compiled call {r['first']:6.2f} s  "
              f"others {r['others']:.2f} cores; pairs (eager/compiled s) {r['pairs']}", flush=True)


if __name__ == "__main__":
    main()
