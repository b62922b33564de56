"""Where a step's distance from its FLOP floor goes: matrix multiplications against the rest, per phase.

One profiled run, read after the fact::

    posttrain bench --config-name bench_chat --config-path /tmp/perf/work --iters 1 --warmup 1 \\
        --profile /tmp/prof --output /tmp/prof/bench.json --force
    python benchmarks/floor_gap.py /tmp/prof

Before against after on a shared machine, variants alternating in rounds of fresh processes::

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/floor_gap.py --compare --size chat \\
        --precision fp32 --rounds 3 [--variants before,after,regions]

``--compare`` writes the workload's config (``benchmarks/vs_trl/common.py``: ``chat`` is issue 22's
8 prompts x 8 samples x up to 64 tokens on SmolLM2-135M-Instruct) and runs ``posttrain bench
--warmup 1 --iters 2`` once per variant per round, the variants' order turning each round (AB, BA,
...), so a change of load falls on all of them. Variants (:data:`VARIANTS`): ``before`` =
``POSTTRAIN_ROLLOUT_PACKED=off`` and ``rl_config.compile_regions=false`` (issue 43's sampler change
has no switch, so ``before`` samples with the new sampler); ``after`` = posttrain's defaults;
``regions`` = the defaults plus ``rl_config.compile_regions=true``; ``masked_attention`` = the
defaults with ``POSTTRAIN_CPU_ATTENTION=off`` (the packed attention's masked SDPA, before its CPU
path: ``posttrain.models.cpu_attention``); ``base`` = the defaults of the posttrain in ``--base-src``
(another checkout's ``src``, e.g. a ``git worktree`` of the commit before a change that has no
switch). Every run uses ``--threads``
torch threads (default 1: two threads on a 2-core machine where others hold a core stall each
other) and records the load average before and after, the CPU cores other processes used during
each iteration (``posttrain bench``'s ``CpuMeter``, from ``/proc/stat``), the CPU model and flags,
and the kernels the run chose (its ``run.json``: fp32 linear kernel, packed rollout weights).
The first measured iteration runs plain (its step time is the one compared with the floor), the
second under ``torch.profiler`` (the split into matmuls, attention and the rest). Medians over
rounds are printed per variant and phase, with the non-matmul share of the step and step / floor;
there every floor is set at the best matmul peak that any of the runs measured (a run's own
measurement under load is low, and its floor high, by whatever share of the cores it got). A last
row per variant estimates the plain iteration's non-matmul share (:func:`plain_non_matmul_share`).
On the chat workload the profiler costs about 0-3% (a profiled iteration against the same
iteration unprofiled); the plain iteration is shorter because it samples shorter answers. With
``--twin`` each run is repeated without the profiler: a seeded run's iterations repeat their
tokens, so the profiled iteration's matmul time is set against the very same iteration's plain
time (:func:`twin_share`), which needs no scaling.

``posttrain bench`` sets each phase's floor at its model FLOPs over the matmul peak it measured on
the spot (``timing/<phase> x mfu/<phase>``, the better of a measurement before and after the
run). This script reads the profiled iteration's trace (``trace.json``) and sums, inside each
phase, the time of the leaf matrix-multiplication kernels (the BLAS's ``aten::mm``, ``addmm``,
``bmm``, or oneDNN's ``mkldnn::_linear_pointwise``) and of the attention kernels (SDPA forward and
backward). The matmuls alone, at the speed the kernels run them at the workload's shapes, bound
the step from below: no change outside the kernels brings a step under ``sum(matmul time) /
floor`` times its floor.
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
sys.path.insert(0, str(HERE))
from machine_record import load_average, machine  # noqa: E402

MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise")  # the last: oneDNN (cpu_linear)
PHASES = ("rollout", "old_log_p", "reference_model", "update")  # the last two only where the run has them
VARIANTS = {  # name: (environment, config overrides)
    "before": ({"POSTTRAIN_ROLLOUT_PACKED": "off"}, ["rl_config.compile_regions=false"]),
    "after": ({}, []),
    "regions": ({}, ["rl_config.compile_regions=true"]),
    "masked_attention": ({"POSTTRAIN_CPU_ATTENTION": "off"}, []),  # issue 43's attention before its CPU path
    "base": ({}, []),  # the defaults, run from --base-src
}


# ---- one profiled run ------------------------------------------------------------------------------
def phase_spans(trace: dict) -> dict[str, tuple[float, float]]:
    """The ``timing/<phase>`` spans of the trace, by phase (microseconds)."""
    spans = {}
    for event in trace["traceEvents"]:
        name = event.get("name", "")
        if event.get("ph") == "X" and name.startswith("timing/") and name[len("timing/"):] in PHASES:
            spans[name[len("timing/"):]] = (event["ts"], event["ts"] + event["dur"])
    return spans


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


def analyse(folder: Path, bench: dict) -> dict:
    """Per phase of the profiled (last) iteration: time, floor, matmul, attention, rest; and the step's."""
    trace = json.loads((folder / "trace.json").read_text())
    spans = phase_spans(trace)
    if "rollout" not in spans or "update" not in spans:
        raise SystemExit(f"{folder / 'trace.json'}: no timing/rollout and timing/update spans; profile an "
                         f"on-policy run")
    kernels = kernel_times(trace, spans)
    last = bench["iterations"][-1]
    phases = {}
    for phase in PHASES:
        if phase not in spans:
            continue
        took = last[f"timing/{phase}"]
        mm, attn = kernels[phase]["matmul"], kernels[phase]["attention"]
        phases[phase] = {"time": took, "floor": took * last[f"mfu/{phase}"], "matmul": mm, "attention": attn,
                         "rest": took - mm - attn}
    step = last["timing/all"]
    matmul = sum(p["matmul"] for p in phases.values())
    attention = sum(p["attention"] for p in phases.values())
    return {"phases": phases, "step": step, "floor": last["floor_s"], "matmul": matmul, "attention": attention,
            "rest_share": (step - matmul - attention) / step, "non_linear_share": (step - matmul) / step}


def print_one(bench: dict, result: dict) -> None:
    print(f"matmul peak {bench['matmul_peak_gflops']:.1f} GFLOP/s, {bench['torch_threads']} threads, "
          f"{bench['train_dtype']} train / {bench['rollout_dtype']} rollout")
    print(f"{'phase':<16} {'time':>7} {'floor':>7} {'matmul':>7} {'attn':>7} {'rest':>7} {'matmul/floor':>13}")
    for phase, row in result["phases"].items():
        print(f"{phase:<16} {row['time']:7.2f} {row['floor']:7.2f} {row['matmul']:7.2f} {row['attention']:7.2f} "
              f"{row['rest']:7.2f} {row['matmul'] / row['floor']:12.2f}x")
    floor = result["floor"]
    print(f"step {result['step']:.2f} s = {result['step'] / floor:.2f}x its floor ({floor:.2f} s); its matmuls "
          f"alone take {result['matmul']:.2f} s = {result['matmul'] / floor:.2f}x the floor, the lower bound "
          f"with these kernels; rest (not matmul, not attention) {100 * result['rest_share']:.0f}% of the step")


# ---- variants alternating in rounds ----------------------------------------------------------------
def write_config(work: Path, size: str, precision: str) -> str:
    """The workload's posttrain config as YAML under ``work``; returns its name."""
    import yaml

    sys.path.insert(0, str(HERE / "vs_trl"))
    from common import posttrain_config, prepare

    paths = prepare(work, size)
    name = f"floor_gap_{size}_{precision}"
    cfg = posttrain_config(paths, 3, str(work / f"{name}_out"), size=size, precision=precision)
    (work / f"{name}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return name


def variant_env(variant: str, args) -> tuple[dict, list[str]]:
    """The environment and config overrides of one ``variant``'s run (:data:`VARIANTS`; ``base``: the
    posttrain of ``--base-src`` first on ``PYTHONPATH``, this checkout's ``src`` off it)."""
    env_extra, overrides = VARIANTS[variant]
    env = {k: v for k, v in os.environ.items() if k not in ("POSTTRAIN_ROLLOUT_PACKED", "POSTTRAIN_CPU_ATTENTION")}
    env.update(env_extra, OMP_NUM_THREADS=str(args.threads))
    if variant == "base":
        if not args.base_src or not (Path(args.base_src) / "posttrain").is_dir():
            raise SystemExit(f"the base variant needs --base-src: another checkout's src folder (got {args.base_src!r})")
        env["PYTHONPATH"] = os.pathsep.join([args.base_src, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                              if p and Path(p).resolve() != HERE.parent / "src"]])
    return env, overrides


def run_bench(cmd: list[str], env: dict, output: Path) -> dict:
    """Run a ``posttrain bench`` command; its ``--output`` JSON (``output``)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0 or not output.exists():
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr[-4000:]}")
    return json.loads(output.read_text())


def run_variant(variant: str, rnd: int, name: str, args) -> dict:
    """One fresh ``posttrain bench`` process of ``variant``; its analysed result with the load."""
    env, overrides = variant_env(variant, args)
    folder = Path(args.work) / "floor_gap_runs" / f"{name}_{variant}_{rnd}"
    cmd = [sys.executable, "-m", "posttrain", "bench", "--config-name", name, "--config-path", args.work,
           "--iters", "2", "--warmup", "1", "--profile", str(folder), "--output", str(folder / "bench.json"),
           "--force", *overrides]
    start, load_before = time.time(), load_average()
    bench = run_bench(cmd, env, folder / "bench.json")
    result = analyse(folder, bench)
    plain = bench["iterations"][-2]  # the measured iteration before the profiled one
    result.update(variant=variant, round=rnd, plain_step=plain["timing/all"], plain_floor=plain["floor_s"],
                  plain_phases={p: plain[f"timing/{p}"] for p in result["phases"]},
                  loadavg={"before": load_before, "after": load_average()}, run=bench.get("run", {}),
                  others_cores=[it["cpu/others_cores"] for it in bench["iterations"]],
                  peak_gflops=bench["matmul_peak_gflops"], dtypes=[bench["train_dtype"], bench["rollout_dtype"]],
                  peak_memory_mib=bench["peak_memory_mib"], wall_s=time.time() - start)
    if args.twin:  # the same run without the profiler: a seeded run repeats its iterations' tokens
        twin_cmd = [c for c in cmd if c not in ("--profile", str(folder))]
        twin_cmd[twin_cmd.index(str(folder / "bench.json"))] = str(folder / "twin.json")
        result["twin"] = twin_share(result, bench, run_bench(twin_cmd, env, folder / "twin.json"))
    print(f"  round {rnd} {variant:<8} step {result['plain_step']:6.1f} s plain / {result['step']:6.1f} s profiled, "
          f"floor {result['plain_floor']:.2f} s, rest {100 * result['rest_share']:.0f}%, load "
          f"{load_before[0]:.1f}->{result['loadavg']['after'][0]:.1f}, others "
          f"{statistics.median(result['others_cores']):.2f} cores, {result['run']} ({result['wall_s']:.0f} s)",
          flush=True)
    return result


def at_best_peak(runs: list[dict]) -> list[dict]:
    """``runs`` with every floor set at the best matmul peak any of them measured: under load a run's
    own peak measurement is low, and its floor high, by however many cores it got at that moment."""
    best = max(r["peak_gflops"] for r in runs)
    out = []
    for r in runs:
        scale = r["peak_gflops"] / best
        phases = {p: {**row, "floor": row["floor"] * scale} for p, row in r["phases"].items()}
        out.append({**r, "phases": phases, "floor": r["floor"] * scale, "plain_floor": r["plain_floor"] * scale})
    return out


def median_table(runs: list[dict], variants: list[str]) -> list[str]:
    """Markdown rows per variant and phase: medians over rounds, floors at the best peak measured."""
    def med(values):
        return statistics.median(values)

    runs = at_best_peak(runs)
    lines = [f"floors at the best matmul peak of these runs, {max(r['peak_gflops'] for r in runs):.0f} GFLOP/s",
             "| variant | phase | time s | floor s | matmuls s | attention s | rest s | time / floor |",
             "|---|---|---|---|---|---|---|---|"]
    for variant in variants:
        mine = [r for r in runs if r["variant"] == variant]
        for phase in mine[0]["phases"]:
            rows = [r["phases"][phase] for r in mine]
            t, f = med([x["time"] for x in rows]), med([x["floor"] for x in rows])
            lines.append(f"| {variant} | {phase} | {t:.2f} | {f:.2f} | {med([x['matmul'] for x in rows]):.2f} | "
                         f"{med([x['attention'] for x in rows]):.2f} | {med([x['rest'] for x in rows]):.2f} | "
                         f"{t / f:.2f}x |")
        step, plain = med([r["step"] for r in mine]), med([r["plain_step"] for r in mine])
        ratio = med([r["plain_step"] / r["plain_floor"] for r in mine])
        lines.append(f"| {variant} | **step** | {step:.2f} profiled, **{plain:.2f}** plain | "
                     f"{med([r['plain_floor'] for r in mine]):.2f} | {med([r['matmul'] for r in mine]):.2f} | "
                     f"{med([r['attention'] for r in mine]):.2f} | rest {100 * med([r['rest_share'] for r in mine]):.0f}%"
                     f", not linear {100 * med([r['non_linear_share'] for r in mine]):.0f}% | "
                     f"**{ratio:.2f}x** (plain) |")
        scaled = med([plain_non_matmul_share(r) for r in mine])
        lines.append(f"| {variant} | plain step, estimated | | | | | not linear about {100 * scaled:.0f}% "
                     f"(matmul time scaled by the FLOPs) | |")
        paired = [r for r in mine if r.get("twin", {}).get("same_tokens")]
        if paired:
            shares = [100 * r["twin"]["share"] for r in paired]
            lines.append(f"| {variant} | the profiled iteration's twin, unprofiled | "
                         f"{med([r['twin']['step'] for r in paired]):.2f} | | "
                         f"{med([r['matmul'] for r in paired]):.2f} | | "
                         f"not linear **{med(shares):.1f}%** (runs {', '.join(f'{x:.1f}' for x in shares)}) | |")
    return lines


def plain_non_matmul_share(run: dict) -> float:
    """The plain iteration's non-matmul share (attention counted), its matmul time estimated from the
    profiled iteration's by the ratio of their FLOP floors (the two iterations sample different tokens;
    :func:`twin_share` compares the same iteration instead)."""
    return 1 - run["matmul"] * (run["plain_floor"] / run["floor"]) / run["plain_step"]


def twin_share(result: dict, bench: dict, twin: dict) -> dict:
    """The profiled iteration's non-matmul share (attention counted) against its twin: the same
    iteration of the same seeded run, unprofiled, in another process (the same tokens: checked by the
    response length). The matmuls are a few thousand large operators, which the profiler times
    closely; the plain step is the twin's, which no profiler slowed."""
    mine, other = bench["iterations"][-1], twin["iterations"][-1]
    same = mine.get("response_length/mean") == other.get("response_length/mean")
    step = other["timing/all"]
    return {"same_tokens": same, "step": step, "share": 1 - result["matmul"] / step,
            "phases": {p: other[f"timing/{p}"] for p in result["phases"]}}


def run_rows(runs: list[dict]) -> list[str]:
    """Markdown rows, one per run: its step, floor, load and the kernels it chose."""
    lines = ["| round | variant | step s (plain; profiled) | floor s | step / floor | rest share | matmul peak GFLOP/s |"
             " load before, after | others' cores | fp32 linear | packed rollout |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        load = f"{r['loadavg']['before'][0]:.1f}, {r['loadavg']['after'][0]:.1f}"
        others = ", ".join(f"{x:.2f}" for x in r["others_cores"][1:])
        lines.append(f"| {r['round'] + 1} | {r['variant']} | {r['plain_step']:.1f}; {r['step']:.1f} | "
                     f"{r['plain_floor']:.2f} | {r['plain_step'] / r['plain_floor']:.2f}x | "
                     f"{100 * r['rest_share']:.0f}% | {r['peak_gflops']:.0f} | {load} | {others} | {r['run'].get('cpu_linear')} | "
                     f"{r['run'].get('rollout_packed_weights')} |")
    return lines


def alternating(args, script: str, run_one, note: str = "") -> tuple[list[dict], list[str], Path]:
    """``run_one(variant, round, config_name, args)`` for each of ``--variants`` in ``--rounds`` rounds,
    their order turning each round, on the workload's config written under ``--work``; every run is
    saved to ``--output`` (default ``WORK/<script>_<size>_<precision>.json``) as it ends."""
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; use some of {', '.join(VARIANTS)}")
    work = Path(args.work)
    name = write_config(work, args.size, args.precision)
    host = machine(args.threads)
    print(f"{host['cpu']} ({', '.join(host['flags'])}; {host['cpus']} CPUs), torch {host['torch']}, "
          f"{args.threads} threads, {args.precision}{note}, load {host['loadavg']}", flush=True)
    runs: list[dict] = []
    out = Path(args.output or work / f"{script}_{args.size}_{args.precision}.json")
    for rnd in range(args.rounds):
        for variant in variants[rnd % len(variants):] + variants[:rnd % len(variants)]:
            runs.append(run_one(variant, rnd, name, args))
            out.write_text(json.dumps({"size": args.size, "precision": args.precision, "machine": host,
                                       "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                       "runs": runs}, indent=2, default=str))
    return runs, variants, out


def compare(args) -> None:
    runs, variants, out = alternating(args, "floor_gap", run_variant)
    print("\n" + "\n".join(run_rows(runs)))
    print(f"\nmedians over {args.rounds} rounds ({args.size}, {args.precision}, {args.threads} threads):")
    print("\n".join(median_table(runs, variants)))
    print(f"wrote {out}")


def summarise(saved: list[dict]) -> None:
    """Print the per-run rows and the medians of saved comparisons, their rounds numbered in turn."""
    if len({(x["size"], x["precision"]) for x in saved}) != 1:
        raise SystemExit("--summarise: give comparisons of one size and precision")
    runs, offset = [], 0
    for one in saved:
        runs += [{**r, "round": r["round"] + offset} for r in one["runs"]]
        offset = max(r["round"] for r in runs) + 1
    variants = list(dict.fromkeys(r["variant"] for r in runs))
    print(f"{saved[0]['size']}, {saved[0]['precision']}, {saved[0]['machine']}:")
    print("\n".join(run_rows(runs)) + "\n")
    print("\n".join(median_table(runs, variants)))


def add_run_arguments(p: argparse.ArgumentParser, rounds: int, variants: str) -> None:
    """The workload, precision, rounds, variants and threads of :func:`alternating`."""
    p.add_argument("--size", default="chat", help="the workload (benchmarks/vs_trl/common.py)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                   help="fp32 pinned, or bf16: posttrain's hardware default")
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--variants", default=variants, help=f"some of {', '.join(VARIANTS)}")
    p.add_argument("--base-src", default=None, help="the base variant's posttrain: another checkout's src folder")
    p.add_argument("--threads", type=int, default=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile_dir", nargs="?", help="the --profile DIR of posttrain bench (trace.json, bench.json)")
    p.add_argument("--bench", default=None, help="posttrain bench --output JSON (default: DIR/bench.json)")
    p.add_argument("--compare", action="store_true", help="run the variants alternating in rounds")
    p.add_argument("--summarise", nargs="+", default=None, metavar="JSON",
                   help="print the medians of --compare JSONs of one precision, their rounds in turn (also one "
                        "stopped early: the rounds it finished)")
    add_run_arguments(p, rounds=3, variants="before,after")
    p.add_argument("--twin", action="store_true",
                   help="--compare: also run each bench unprofiled; the non-matmul share of the profiled "
                        "iteration's matmuls against its twin's plain step (twin_share)")
    p.add_argument("--work", default="/tmp/perf/work")
    p.add_argument("--output", default=None, help="--compare: JSON of every run (default: WORK/floor_gap_*.json)")
    args = p.parse_args()
    if args.compare:
        compare(args)
        return
    if args.summarise:
        summarise([json.loads(Path(path).read_text()) for path in args.summarise])
        return
    if not args.profile_dir:
        p.error("give a profile DIR, or --compare")
    folder = Path(args.profile_dir)
    bench = json.loads(Path(args.bench or folder / "bench.json").read_text())
    print_one(bench, analyse(folder, bench))


if __name__ == "__main__":
    main()
