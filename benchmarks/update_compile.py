"""The update's non-matmul time: eager vs the compiled regions (RMSNorm, SiLU-mul, rotary, the LM head's
log-softmax-gather), interleaved in one process.

    PYTHONPATH=src python benchmarks/update_compile.py [--model smollm2|tiny|DIR] [--threads 1] [--repeats 5]
        [--profile] [--profile-compiled] [--regions rms_norm,silu_mul,rotary,logprob] [--regions-only]

The workload is the update of issue 22's chat workload: SmolLM2-135M-Instruct in fp32, 8 prompts of
54 tokens x 8 samples with answers of 6 to 64 tokens (mean 18.75), packed with shared prompts
(posttrain's defaults), the chunked LM head at temperature 0.5, the fp32 linear kernel the run would
choose (:mod:`posttrain.models.cpu_linear`), and torch's fused AdamW. One step = the actor's
forward + backward + optimizer step; a log-prob pass = the same forward without a graph (old
log-probs, the reference). Eager and compiled steps alternate (``--repeats`` pairs) so the load of
a shared machine falls on both alike; the script prints the medians, the median of the per-pair
ratios, the first compiled call (compile time, which Inductor's disk cache shortens in later
processes), the CPU model, the thread count, the linear kernel and the cores other processes used
(``/proc/stat``). ``--profile`` prints the eager step's top operators by self time first,
``--profile-compiled`` the compiled step's; ``--regions-only`` times each region alone.
"""

from __future__ import annotations

import argparse
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


def _region_cases(tokens: int, hidden: int, inter: int, heads: tuple[int, int, int], head_tokens: int,
                  vocab: int) -> dict:
    """Each region's eager function, compiled function and inputs at the chat update's shapes."""
    from posttrain.algo.logprob import scaled_logprobs_and_entropy
    from posttrain.training.compiled_logprob import compiled_logprobs_and_entropy
    from posttrain.training.fused_regions import compiled, rms_norm, rotary, silu_mul

    def eager_logprob(logits, labels):  # the head's eager chunk: scaled_logits, then the log-prob Function
        return scaled_logprobs_and_entropy(logits.float() / 0.5, labels, True, False)[0]

    def compiled_logprob(logits, labels):
        return compiled_logprobs_and_entropy()(logits, labels, 0.5, True, False)[0]

    q_heads, kv_heads, dim = heads  # q and k as the attention makes them: [1, N, h*D] viewed [1, h, N, D]
    q = torch.randn(1, tokens, q_heads * dim).view(1, tokens, q_heads, dim).transpose(1, 2)
    k = torch.randn(1, tokens, kv_heads * dim).view(1, tokens, kv_heads, dim).transpose(1, 2)
    cos, sin = torch.randn(1, tokens, dim), torch.randn(1, tokens, dim)
    labels = torch.randint(0, vocab, (head_tokens,))
    return {"rms_norm": (rms_norm, compiled("rms_norm"), (torch.randn(1, tokens, hidden), torch.randn(hidden), 1e-5)),
            "silu_mul": (silu_mul, compiled("silu_mul"),
                         (torch.randn(1, tokens, inter), torch.randn(1, tokens, inter))),
            "rotary": (rotary, compiled("rotary"), (q, k, cos, sin)),
            "logprob": (eager_logprob, compiled_logprob, (torch.randn(head_tokens, vocab), labels))}


def region_times(repeats: int, names: tuple[str, ...], tokens: int = 1632, hidden: int = 576, inter: int = 1536,
                 heads: tuple[int, int, int] = (9, 3, 64), head_tokens: int = 682, vocab: int = 49152) -> None:
    """Median of ``repeats`` interleaved eager/compiled calls for each region alone, forward + backward and
    forward alone, at the chat update's packed shapes (SmolLM2's: ``[1, tokens, .]``; the LM head's chunk of
    ``head_tokens`` x ``vocab`` logits)."""
    cases = _region_cases(tokens, hidden, inter, heads, head_tokens, vocab)
    for name in names:
        eager, fused, args = cases[name]
        for backward in (True, False):
            leaves = [a.detach().requires_grad_(backward and a.is_floating_point()) if isinstance(a, torch.Tensor)
                      else a for a in args]

            with torch.no_grad():  # dense upstream gradients, as in the model (sum()'s is a stride-0 view)
                out = eager(*leaves)
                grads = [torch.randn_like(o) for o in (out if isinstance(out, tuple) else (out,))]

            def call(fn):
                with torch.set_grad_enabled(backward):
                    out = fn(*leaves)
                    if backward:
                        torch.autograd.backward(out if isinstance(out, tuple) else (out,), grads)
            timed(lambda: call(eager))
            first = timed(lambda: call(fused))
            pairs = [(timed(lambda: call(eager)), timed(lambda: call(fused))) for _ in range(repeats)]
            e, c = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
            ratio = statistics.median(p[0] / p[1] for p in pairs)
            print(f"{name:<9} {'fwd+bwd' if backward else 'fwd    '} eager {e * 1e3:7.2f} ms  compiled {c * 1e3:7.2f} ms"
                  f"  eager/compiled {ratio:.2f}x (median of {repeats} interleaved pairs; first compiled call "
                  f"{first:.1f} s)", flush=True)


def profile_step(step, top: int = 30) -> None:
    """The top operators of one call of ``step`` by self CPU time (1 thread: self time is wall time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--regions", default="rms_norm,silu_mul,rotary,logprob")
    p.add_argument("--profile", action="store_true", help="profile one eager step")
    p.add_argument("--profile-compiled", action="store_true", help="profile one step with the regions on")
    p.add_argument("--no-logprob", action="store_true", help="time the update step only")
    p.add_argument("--regions-only", action="store_true", help="time each region alone (SmolLM2's shapes)")
    p.add_argument("--auto", type=int, metavar="UPDATES", help="what compile_regions auto chooses for a run of "
                   "UPDATES updates of this workload (posttrain.training.compile_auto), then exit")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    names = tuple(args.regions.split(","))
    if args.regions_only:
        print(f"{cpu_model()}; {args.threads} threads; torch {torch.__version__}; load {Path('/proc/loadavg').read_text().strip()}")
        return region_times(max(args.repeats, 20), names)
    kernel = resolve_cpu_linear("cpu")
    set_cpu_linear(kernel)
    model = load(args.model)
    batch = chat_batch(model.config.vocab_size)
    if args.auto:
        from posttrain.training.compile_auto import choose_regions, update_tokens

        start = time.perf_counter()
        choices = choose_regions(model, *update_tokens(batch, share_prompts=True), args.auto)
        for region, choice in choices.items():
            print(f"{region:<9} {'on ' if choice.on else 'off'} {choice.reason}", flush=True)
        return print(f"chosen in {time.perf_counter() - start:.1f} s", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7, fused=True)
    print(f"{cpu_model()}; {args.threads} threads; linear {kernel}; torch {torch.__version__}; "
          f"regions {','.join(names)}; load {Path('/proc/loadavg').read_text().strip()}", flush=True)
    train, logprob = make_step(model, batch, optimizer, True), make_step(model, batch, optimizer, False)
    train()  # warm-up: the eager path's first call
    if args.profile:
        profile_step(train)
    if args.profile_compiled:
        with fused_regions(model, names=names):
            print(f"first compiled step (compiles the regions) {timed(train):.1f} s", flush=True)
            profile_step(train)
    for what, step in (("update step", train), ("log-prob pass", logprob))[:1 if args.no_logprob else 2]:
        r = compare(model, step, args.repeats, names)
        print(f"{what:<14} eager {r['eager']:6.3f} s  compiled {r['fused']:6.3f} s  eager/compiled "
              f"{r['ratio']:.3f}x (median of {args.repeats} pairs)  first compiled call {r['first']:6.2f} s  "
              f"others {r['others']:.2f} cores; pairs (eager/compiled s) {r['pairs']}", flush=True)


if __name__ == "__main__":
    main()
