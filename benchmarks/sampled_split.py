"""The step's split into matrix multiplications, attention and the rest, by sampling native stacks.

``floor_gap.py`` splits a step with ``torch.profiler``, which records every operator (on the chat
workload a profiled iteration took 0-3% longer than the same iteration unprofiled). This script
measures the same split with no cost per operator, as a check on it: ``py-spy record --native``
(``pip install py-spy``) samples the call stack of a ``posttrain bench`` process, Python and C++
frames together, at a fixed rate, and each sampled interval is counted where its stack says the
thread was::

    POSTTRAIN_CPU_LINEAR=blas OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/sampled_split.py \\
        --size chat --precision fp32 --iters 4 --rate 25 [--variants after,base --base-src BASE/src]

* **attention**: a call of SDPA, forward or backward. MKL's GEMM kernels, which ATen's CPU attention
  calls as the linear layers do, carry no unwind information, so a stack sampled inside one lacks
  the C++ frames between the kernel and Python, and an attention backward inside ``loss.backward()``
  would look like a linear layer's. The sampled process therefore runs
  ``torch.nn.functional.scaled_dot_product_attention`` through :func:`install_marked_sdpa` (a Python frame,
  and for a graph an ``autograd.Function`` whose backward runs SDPA's own backward node by
  ``torch.autograd.grad``: the same kernels and numbers, about 10 us more a call, counted as attention);
* **matmul**: a frame of a GEMM (MKL's or oneDNN's ``gemm``/``brgemm``, oneDNN's ``inner_product``
  and ``mkldnn_matmul``, ``mkldnn_linear_pointwise``, ATen's ``linear``/``matmul``/``mm``/``addmm``/
  ``bmm`` and their backward nodes), or code without a symbol: oneDNN writes its kernels (the
  prepacked products, bf16 GEMMs) at run time, and a stack walker sees them as bare addresses, often
  with the frames between them and Python lost (oneDNN's generated weight reorders of
  :mod:`posttrain.models.packed_linear`'s packing excepted: rest);
* **rest**: everything else inside the phase: elementwise and reduction kernels, copies, the
  sampler, the optimizer, Python, allocation. Like the profiler's split, the dispatch from Python
  to a matmul operator counts as rest, the operator's own set-up as matmul.

The phase comes from the Python frames (the rollout: the producer's ``generate_and_score``; the
update: ``TrainEngine.update``), and the iterations from the rollouts inside
``OnPolicyTrainer.train_step`` (each on-policy iteration begins with one): the first (the warm-up) is
dropped. Sampling pauses the process for each sample: at 25 samples a second
the chat workload's phases took 1.01-1.17x their unsampled twins' time (``--twin``: the same seeded
iterations without the sampler), and that cost seems to fall more on the small operators after a
pause (cold caches) and on deep Python stacks than on the GEMMs, so the shares lean towards the
rest: on that workload two variants whose twins ran equally fast measured 3 points apart. The statistical
error of a share is about ``sqrt(p (1 - p) / samples)``: give enough iterations (``--iters``).
Variants (``--variants``) run alternating, as in ``floor_gap.py``, in fresh processes.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from floor_gap import add_run_arguments, alternating, run_bench, variant_env  # noqa: E402
from machine_record import load_average  # noqa: E402

ATTENTION = re.compile(r"scaled_?dot_?product|flash_attention", re.I)
MATMUL = re.compile(r"gemm|inner_product|mkldnn_linear_pointwise|mkldnn_matmul"
                    r"|_ops::(linear|matmul|mm|addmm|bmm)(_out)?::|THPVariable_(linear|matmul|mm|addmm|bmm)\b"
                    r"|(Mm|Addmm|Bmm)Backward", re.I)
JIT = re.compile(r"^0x[0-9a-f]+$")  # a frame py-spy could not name, in no library ("?"): code generated at run time
PACKING = ("pack", "refresh")  # packed_linear's weight reorders: oneDNN's generated code too, but no matmul
MARK = "marked_sdpa"  # the Python frames of install_marked_sdpa's marked_sdpa and MarkedSDPA
PHASES = {"rollout": "generate_and_score", "update": "TrainEngine.update"}
STEP = "OnPolicyTrainer.train_step"
KINDS = ("matmul", "attention", "rest")


def kind_of(stack: list[dict]) -> str:
    """``matmul``, ``attention`` or ``rest`` for one sampled stack (outermost frame first)."""
    names = [frame["name"] for frame in stack]
    if any(ATTENTION.search(n) or MARK in n.lower() for n in names):
        return "attention"
    if any(MATMUL.search(n) for n in names):
        return "matmul"
    python = [i for i, frame in enumerate(stack) if frame["python"]]
    packing = any(names[i] in PACKING for i in python[-3:])
    if not packing and any(JIT.match(f["name"]) and f["where"].startswith("?:") for f in stack):
        return "matmul"
    return "rest"


def phase_of(stack: list[dict]) -> str:
    names = {frame["name"] for frame in stack}
    return next((phase for phase, marker in PHASES.items() if any(marker in n for n in names)), "other")


def intervals(trace: list[dict]):
    """``(seconds, stack, step)`` per sampled interval of the thread that runs the steps, from
    py-spy's chrometrace (``B``/``E`` events per frame at sample times), inside ``train_step`` only.
    ``step`` counts the iterations from 0 (-1 before the first rollout): one begins where a rollout
    begins after anything else of a step (each on-policy iteration is a rollout, then the rest)."""
    threads = collections.defaultdict(list)
    for event in trace:
        if event.get("ph") in ("B", "E"):
            threads[event["tid"]].append(event)
    events = max(threads.values(), key=lambda evs: sum(e["name"] == STEP for e in evs))
    stack: list[dict] = []
    step, last_ts, last_phase = -1, None, None
    for event in events:
        ts = event["ts"]
        if last_ts is not None and ts > last_ts and stack and any(f["name"] == STEP for f in stack):
            phase = phase_of(stack)
            if phase == "rollout" and last_phase != "rollout":
                step += 1
            last_phase = phase
            yield (ts - last_ts) / 1e6, stack, step
        last_ts = ts
        if event["ph"] == "B":
            filename = event.get("args", {}).get("filename", "")
            stack = [*stack, {"name": event["name"].split(" (")[0], "python": filename.endswith(".py"),
                              "where": f"{filename}:{event.get('args', {}).get('line', 0)}"}]
        else:
            stack = stack[:-1]


def split(trace: list[dict]) -> dict:
    """Seconds per phase and kind over the steps after the first, and the rest's largest lines."""
    seconds = collections.defaultdict(float)
    rest_lines = collections.Counter()
    steps = set()
    for took, stack, step in intervals(trace):
        if step < 1:  # the warm-up (the first), or a step's beginning before its rollout
            continue
        steps.add(step)
        phase, kind = phase_of(stack), kind_of(stack)
        seconds[(phase, kind)] += took
        if kind == "rest":
            rest_lines[f"{phase} {_innermost_python(stack)}"] += took
    phases = {p: {k: seconds[(p, k)] for k in KINDS} for p in [*PHASES, "other"]}
    total = sum(seconds.values())
    matmul = sum(v for (p, k), v in seconds.items() if k == "matmul")
    return {"steps": len(steps), "phases": phases, "sampled_s": total,
            "non_matmul_share": 1 - matmul / total if total else float("nan"),
            "rest_share": sum(v for (p, k), v in seconds.items() if k == "rest") / total if total else float("nan"),
            "top_rest": rest_lines.most_common(25)}


def _innermost_python(stack: list[dict]) -> str:
    python = [frame for frame in stack if frame["python"]]
    own = [frame for frame in python if "/posttrain/" in frame["where"]]
    frame = own[-1] if own else python[-1] if python else stack[-1]
    where = frame["where"].split("/posttrain/")[-1]
    native = [f["name"] for f in stack[stack.index(frame) + 1:] if not f["python"]][:1]
    return f"{where} {frame['name']}" + (f" -> {native[0][:60]}" if native else "")


def run_variant(variant: str, rnd: int, name: str, args) -> dict:
    """One sampled ``posttrain bench`` process of ``variant``; its split with the load and step times."""
    env, overrides = variant_env(variant, args)
    folder = Path(args.work) / "sampled_split_runs" / f"{name}_{variant}_{rnd}"
    folder.mkdir(parents=True, exist_ok=True)
    trace_path = folder / "stacks.json"
    bench_cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "bench", "--config-name", name,
                 "--config-path", args.work, "--iters", str(args.iters), "--warmup", "1", "--force", *overrides]
    sampler = [args.py_spy, "record", "--native", "--rate", str(args.rate), "--format", "chrometrace",
               "--output", str(trace_path), "--"]
    start, load_before = time.time(), load_average()
    bench = run_bench(sampler + bench_cmd + ["--output", str(folder / "bench.json")], env, folder / "bench.json")
    result = split(json.loads(trace_path.read_text()))
    measured = bench["iterations"][1:]
    result.update(variant=variant, round=rnd, loadavg=[load_before, load_average()], run=bench.get("run", {}),
                  others_cores=[it["cpu/others_cores"] for it in measured],
                  sampled_phase_s={p: sum(it.get(f"timing/{p}", 0.0) for it in measured) for p in PHASES})
    if args.twin:  # the same iterations (a seeded run repeats its tokens) without the sampler
        twin = run_bench(bench_cmd + ["--output", str(folder / "twin.json")], env, folder / "twin.json")
        result["plain_phase_s"] = {p: sum(it.get(f"timing/{p}", 0.0) for it in twin["iterations"][1:]) for p in PHASES}
    result["wall_s"] = time.time() - start
    slower = ""
    if args.twin:
        slower = ", sampling slowed " + ", ".join(
            f"{p} {result['sampled_phase_s'][p] / result['plain_phase_s'][p]:.2f}x" for p in PHASES)
    print(f"  round {rnd} {variant:<6} {result['steps']} steps, non-matmul {100 * result['non_matmul_share']:.1f}%, "
          f"rest {100 * result['rest_share']:.1f}%{slower}, load {load_before[0]:.1f}->{result['loadavg'][1][0]:.1f}, "
          f"others {statistics.median(result['others_cores']):.2f} cores, {result['run']} ({result['wall_s']:.0f} s)",
          flush=True)
    return result


def report(runs: list[dict], variants: list[str]) -> list[str]:
    """Markdown: per variant, the phases' sampled seconds and shares (summed over its runs), how much
    slower the sampled phases ran than their twins (``--twin``), and the step's non-matmul share."""
    lines = ["| variant | phase | sampled s | matmul | attention | rest | sampled / plain time |",
             "|---|---|---|---|---|---|---|"]
    for variant in variants:
        mine = [r for r in runs if r["variant"] == variant]
        for phase in [*PHASES, "other"]:
            row = {k: sum(r["phases"][phase][k] for r in mine) for k in KINDS}
            total = sum(row.values())
            if not total:
                continue
            twins = [r for r in mine if "plain_phase_s" in r and phase in PHASES]
            sampled, plain = (sum(r[key][phase] for r in twins) for key in ("sampled_phase_s", "plain_phase_s"))
            slower = f"{sampled / plain:.2f}x" if twins else ""
            lines.append(f"| {variant} | {phase} | {total:.1f} | " +
                         " | ".join(f"{100 * row[k] / total:.1f}%" for k in KINDS) + f" | {slower} |")
        shares = [100 * r["non_matmul_share"] for r in mine]
        lines.append(f"| {variant} | **step** ({sum(r['steps'] for r in mine)} steps) | "
                     f"{sum(r['sampled_s'] for r in mine):.1f} | non-matmul **{statistics.median(shares):.1f}%** "
                     f"(runs {', '.join(f'{x:.1f}' for x in shares)}) | | | |")
    return lines


# ---- the sampled process -------------------------------------------------------------------------
def install_marked_sdpa() -> None:
    """Route ``F.scaled_dot_product_attention`` through ``marked_sdpa`` in this process: a Python
    frame around each call, and with a graph an ``autograd.Function`` whose backward runs SDPA's own
    backward node (``torch.autograd.grad`` over the graph its forward kept): the same kernels."""
    import torch
    import torch.nn.functional as F

    sdpa = F.scaled_dot_product_attention

    class MarkedSDPA(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, kwargs):
            leaves = [x.detach().requires_grad_(x.requires_grad) for x in (q, k, v)]
            with torch.enable_grad():
                out = sdpa(*leaves, **kwargs)
            ctx.graph = (leaves, out)
            return out.detach()

        @staticmethod
        def backward(ctx, grad):
            leaves, out = ctx.graph
            grads = iter(torch.autograd.grad(out, [x for x in leaves if x.requires_grad], grad))
            return (*(next(grads) if x.requires_grad else None for x in leaves), None)

    def marked_sdpa(q, k, v, *args, **kwargs):
        kwargs.update(zip(("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"), args))
        if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
            return MarkedSDPA.apply(q, k, v, kwargs)
        return sdpa(q, k, v, **kwargs)

    F.scaled_dot_product_attention = marked_sdpa


def child(argv: list[str]) -> None:
    """``posttrain`` with ``argv``, SDPA marked."""
    import runpy

    install_marked_sdpa()
    sys.argv = ["posttrain", *argv]
    runpy.run_module("posttrain", run_name="__main__", alter_sys=True)


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(p, rounds=1, variants="after")
    p.add_argument("--iters", type=int, default=4, help="sampled iterations per run (after one warm-up)")
    p.add_argument("--rate", type=int, default=25, help="samples a second")
    p.add_argument("--twin", action="store_true",
                   help="also run each bench without the sampler: the same iterations' phase times, to show "
                        "how much sampling slowed each phase")
    p.add_argument("--work", default="/tmp/perf/sampled")
    p.add_argument("--py-spy", default=shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"))
    p.add_argument("--output", default=None, help="JSON of every run (default: WORK/sampled_split_*.json)")
    args = p.parse_args()
    if not Path(args.py_spy).exists():
        raise SystemExit(f"py-spy not found at {args.py_spy}: pip install py-spy, or give --py-spy PATH")
    runs, variants, out = alternating(args, "sampled_split", run_variant, f", {args.rate} samples/s")
    print("\n" + "\n".join(report(runs, variants)))
    for variant in variants:
        top = collections.Counter()
        for r in runs:
            if r["variant"] == variant:
                top.update(dict(r["top_rest"]))
        print(f"\n{variant}: the rest's largest lines, seconds sampled over its runs")
        for where, took in top.most_common(20):
            print(f"  {took:6.2f}  {where}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
