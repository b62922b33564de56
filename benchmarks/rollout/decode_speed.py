"""The native rollout's decode on a CPU, variant against variant, interleaved in one process (issue 43).

Workload: issue 22's chat rollout (SmolLM2-135M-Instruct, the products demo's first 8 problems in
its chat template, 8 samples each, up to 64 new tokens, temperature 0.5, no top-k/top-p, stop at
EOS), fp32 (``--dtype bfloat16``: the bf16 sampling copy), one engine per variant kept across repeats
(as a run keeps one), freed memory kept (as a run does, ``posttrain.host_memory``), repeats alternating
between the variants so that the machine's load falls on all of them alike. Variants:

* ``plain``: the engine as before issue 43's rollout work: weights as they are (the fp32 kernel
  ``--kernel`` installed, default oneDNN), the compacting dynamic KV cache;
* ``packed``: prepacked oneDNN weights (``posttrain.models.packed_linear``), repacked before every
  repeat (a run repacks after every update, so the packing is part of the cost), sampled through
  the lean forward (``posttrain.models.lean_forward``: stacked q/k/v and gate/up packs);
* ``packed_model_forward``: the same packed weights through transformers' own forward (the lean
  forward off, as ``POSTTRAIN_LEAN_FORWARD=off``);
* ``static``: packed, on the fixed-shape static KV cache (``static_cache=True``; no compaction);
* ``compiled`` (``--compile``): static on plain weights (Inductor cannot lower the opaque packed
  ones), its decode step compiled by ``torch.compile(dynamic=False)`` (Inductor's CPU backend); the
  first call's compile time is reported apart;
* ``base`` (``--base-src DIR``): ``packed`` through the lean forward of another checkout's ``src``
  (``DIR/posttrain/models/lean_forward.py``, e.g. a ``git worktree`` of the commit before a change),
  swapped into the engine for each of its calls; the rest of posttrain is this tree's. In one process
  a change to the decode layer shows at 1-2% of the rollout, which whole-step comparisons between
  processes (whose speeds differ by up to 8-19% here) cannot resolve.

``--variants`` picks some (e.g. ``packed,base``); the order of the variants turns every repeat.

It also times the sampler alone on ``[rows, 49152]`` logits (64, 8 and 1 rows of SmolLM2's vocabulary:
the workload's first and last decode steps) against its two predecessors (:func:`sampler_ms`).
Each line records the load average, the CPU model and flags, the kernel and the thread count.

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python benchmarks/rollout/decode_speed.py --threads 1 --repeats 3
    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python benchmarks/rollout/decode_speed.py --threads 1 --repeats 8 \
        --kernel blas --dtype bfloat16 --variants packed,base --base-src /tmp/base/src
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def machine() -> dict:
    """The load, CPU model, relevant flags and threads, for the record."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    return {"cpu": model, "flags": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags],
            "loadavg": load, "threads": torch.get_num_threads(), "torch": torch.__version__}


def old_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The inverse CDF before issue 43: the clamp's pass over every row, every token."""
    cdf = probs.double().cumsum(dim=-1)
    target = uniforms.to(cdf.dtype)[:, None] * cdf[:, -1:]
    index = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return torch.minimum(index, (probs > 0).cumsum(dim=-1).argmax(dim=-1))


def whole_row_sample(logits: torch.Tensor, temperature: float, uniforms: torch.Tensor, inverse_cdf):
    """The untruncated draw before the blocked one: the tempered logits, their softmax, the inverse
    CDF on it, and the sampled token's log-softmax (a second pass of ``exp``)."""
    scaled = logits / temperature
    tokens = inverse_cdf(torch.softmax(scaled, dim=-1), uniforms)
    return tokens, scaled.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(scaled, dim=-1)


def sampler_ms(repeats: int = 20, rows: int = 64) -> dict[str, float]:
    """Median ms of one sampling step on [rows, 49152] logits at temperature 0.5, interleaved:
    ``new`` = today's sampler (one exp pass, the inverse CDF by blocks); ``whole_row`` = a softmax
    and a whole-row float64 cumulative sum (before the blocks, 2026-12-06); ``old`` = that with the
    clamp on every row (before issue 43)."""
    from posttrain.rollout import sampling
    from posttrain.rollout.base import SamplingParams

    torch.manual_seed(0)
    logits, u = torch.randn(rows, 49152) * 3, torch.rand(rows, dtype=torch.float64)
    sp = SamplingParams(max_tokens=1, seed=0, temperature=0.5, top_k=-1)
    variants = {"new": lambda: sampling.sample_next(logits, sp, u),
                "whole_row": lambda: whole_row_sample(logits, 0.5, u, sampling._inverse_cdf_flat),
                "old": lambda: whole_row_sample(logits, 0.5, u, old_inverse_cdf)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            start = time.perf_counter()
            tokens = fn()[0]
            times[name].append(time.perf_counter() - start)
    assert all(torch.equal(tokens, fn()[0]) for fn in variants.values())  # the same draws
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


class OtherLeanForward:
    """An engine whose calls run through another ``lean_forward`` module (``base_src``'s)."""

    def __init__(self, engine, base_src: str):
        path = Path(base_src) / "posttrain" / "models" / "lean_forward.py"
        if not path.is_file():
            raise SystemExit(f"--base-src {base_src}: no {path}")
        spec = importlib.util.spec_from_file_location("base_lean_forward", path)
        self.module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
        spec.loader.exec_module(self.module)
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, *args, **kwargs):
        from posttrain.rollout import native

        own, native.lean_forward = native.lean_forward, self.module
        try:
            return self.engine.generate(*args, **kwargs)
        finally:
            native.lean_forward = own


def engines(model, tokenizer, dtype: str, compile_step: bool, static: bool, base_src: str | None = None) -> dict:
    from posttrain.rollout.native import NativeEngine

    common = dict(pad_token_id=tokenizer.pad_token_id or 0, eos_token_ids=[tokenizer.eos_token_id], dtype=dtype)
    out = {"plain": NativeEngine(model, packed_weights=False, **common),
           "packed_model_forward": NativeEngine(model, packed_weights=True, **common),
           "packed": NativeEngine(model, packed_weights=True, **common)}
    out["packed_model_forward"].use_lean_forward = False  # transformers' forward on the packed layers
    if static:
        out["static"] = NativeEngine(model, packed_weights=True, static_cache=True, **common)
    if compile_step:
        # Inductor cannot lower a prepacked (opaque mkldnn) weight: the compiled step multiplies plain weights
        out["compiled"] = NativeEngine(model, packed_weights=False, static_cache=True, **common)
        out["compiled"]._graph_step = torch.compile(out["compiled"]._forward, dynamic=False)
    if base_src:
        out["base"] = OtherLeanForward(NativeEngine(model, packed_weights=True, **common), base_src)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kernel", default="onednn", choices=["blas", "onednn"], help="the fp32 kernel installed")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the rollout dtype (bfloat16: the engine's bf16 sampling copy)")
    p.add_argument("--no-static", action="store_true", help="leave the static-cache variant out")
    p.add_argument("--compile", action="store_true", help="add the compiled static step (minutes to compile)")
    p.add_argument("--base-src", default=None, help="add the variant base: packed through DIR's lean forward")
    p.add_argument("--variants", default=None, help="comma-separated variants to run (default: all built)")
    p.add_argument("--output", default=None, help="write the results as JSON here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from bench_rollout import _smollm2_instruct, chat_prompts
    from posttrain.demo.pretrained import ensure_smollm2
    from posttrain.host_memory import keep_freed_memory
    from posttrain.models.cpu_linear import use_cpu_linear
    from posttrain.rollout.base import SamplingParams

    model = _smollm2_instruct().eval()
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_smollm2()))
    prompts, sp = chat_prompts(8), SamplingParams(max_tokens=64, seed=1, temperature=0.5, top_k=-1)
    report = {"machine_start": machine(), "kernel": args.kernel, "dtype": args.dtype,
              "sampler_ms": {rows: sampler_ms(rows=rows) for rows in (64, 8, 1)}}
    print(json.dumps(report))
    with use_cpu_linear(args.kernel), keep_freed_memory("cpu"):  # as a run does
        variants = engines(model, tokenizer, args.dtype, args.compile, not args.no_static, args.base_src)
        if args.variants:
            chosen = args.variants.split(",")
            unknown = sorted(set(chosen) - set(variants))
            if unknown:
                raise SystemExit(f"--variants: no {', '.join(unknown)}; built: {', '.join(variants)}")
            variants = {name: variants[name] for name in chosen}
        first = {}
        for name, engine in variants.items():  # warm-up (and compile): not counted
            start = time.perf_counter()
            first[name] = engine.generate(prompts, 8, sp)
            report.setdefault("first_call_s", {})[name] = round(time.perf_counter() - start, 2)
        reference = "plain" if "plain" in first else next(iter(first))
        want = first[reference]
        for name, outs in first.items():
            diff = max((abs(a - b) for g, h in zip(outs, want) for o, r in zip(g, h)
                        for a, b in zip(o.logprobs, r.logprobs)), default=0.0)
            same = [o.token_ids for g in outs for o in g] == [o.token_ids for g in want for o in g]
            report.setdefault(f"equal_to_{reference}", {})[name] = {"tokens": same, "max_logprob_diff": diff}
        times: dict[str, list[float]] = {name: [] for name in variants}
        names = list(variants)
        for repeat in range(args.repeats):
            for name in names if repeat % 2 == 0 else names[::-1]:
                engine = variants[name]
                engine._packs.clear()  # as after an update: the packing is part of each call
                start = time.perf_counter()
                engine.generate(prompts, 8, sp)
                times[name].append(time.perf_counter() - start)
            print({name: round(t[-1], 2) for name, t in times.items()}, Path("/proc/loadavg").read_text().strip())
    report["seconds"] = {name: sorted(round(x, 2) for x in t) for name, t in times.items()}
    report["median_s"] = {name: round(statistics.median(t), 2) for name, t in times.items()}
    # the first variant's time over each other's, repeat by repeat (both ran in the same repeat)
    report[f"median_{names[0]}_over"] = {name: round(statistics.median(a / b for a, b in zip(times[names[0]], t)), 3)
                                         for name, t in times.items() if name != names[0]}
    report["machine_end"] = machine()
    print(json.dumps(report, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("POSTTRAIN_ROLLOUT_PACKED", "off")  # each variant says what it uses
    main()
