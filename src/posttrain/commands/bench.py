"""``posttrain bench``: time on-policy iterations of a config and report where the time goes.

It builds the same session and loop as ``posttrain train`` (checkpoints and evaluation off), runs
``warmup`` iterations that are not counted, then ``iters`` measured ones, and reports:

* per-phase seconds (``timing/rollout``, ``rule_reward``, ``adv``, ``reference_model``,
  ``old_log_p``, ``update``, ``all``): median, min, max;
* ``e2e_tps``, ``update_tps``, ``vllm_tps`` (the seed's formula, seed section 6.3) and the rollout's
  response tokens/s;
* model FLOPs utilisation against a matmul peak measured on the spot (:func:`matmul_peak`), and the
  step-time floor that peak sets (:func:`iteration_flops`);
* peak memory (process max RSS; CUDA max allocated on GPU);
* how many CPU cores other processes used during each iteration (:class:`CpuMeter`, from
  ``/proc/stat``), since a shared machine makes every timing noisy.

The JSON written by ``--output`` holds the summary, every measured iteration and the run's ``run.json``
(device, dtypes, threads, the fp32 linear kernel, packed rollout weights, compile regions). With
``--profile DIR`` the last iteration runs under ``torch.profiler`` (:func:`profiled`): the ops
that took the most time go to ``DIR/profile.txt`` (each phase is a ``record_function`` span named
``timing/<phase>``) and a trace to ``DIR/trace.json``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from posttrain.commands.outputs import check_output_file, check_writable_dir
from posttrain.files import write_text_atomic
from posttrain.config.plan import resolve_plan
from posttrain.config.run import load_run_config, run_config_from_dict
from posttrain.device import best_seconds, machine_busy_seconds
from posttrain.errors import ConfigError
from posttrain.loops.build import build_trainer
from posttrain.models import cpu_linear

PHASES = ("rollout", "rule_reward", "adv", "reference_model", "old_log_p", "update", "all")
THROUGHPUT = ("e2e_tps", "update_tps", "vllm_tps", "rollout_response_tps")


# ---- CPU use of other processes ------------------------------------------------------------------
def _own_tree_cpu(root: int) -> float:
    """CPU seconds of process ``root`` (with its reaped children) plus its live descendants."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, list[str]]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            rest = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        stats[int(entry)] = (int(rest[1]), rest)
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _) in stats.items():
            if ppid == parent and pid not in tree:
                tree.add(pid)
                frontier.append(pid)
    total = 0.0
    for pid in tree:
        if pid in stats:
            rest = stats[pid][1]
            total += int(rest[11]) + int(rest[12]) + (int(rest[13]) + int(rest[14]) if pid == root else 0)
    return total / tick


class CpuMeter:
    """``with CpuMeter() as m: ...``; then ``m.result`` = wall seconds and average cores used by this
    process tree (``own_cores``) and by every other process (``others_cores``), of ``num_cpus``."""

    def __init__(self, pid: int | None = None):
        self.pid = pid or os.getpid()
        self.result: dict[str, float] = {}

    def __enter__(self) -> "CpuMeter":
        self._t0, self._busy0, self._own0 = time.perf_counter(), machine_busy_seconds(), _own_tree_cpu(self.pid)
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self._t0
        busy = machine_busy_seconds() - self._busy0
        own = _own_tree_cpu(self.pid) - self._own0
        self.result = {"wall_s": wall, "own_cores": own / wall, "others_cores": max(busy - own, 0.0) / wall,
                       "num_cpus": os.cpu_count() or 1}


# ---- hardware peak and model FLOPs -----------------------------------------------------------------
def matmul_peak(dtype: str = "float32", device: str = "cpu", size: int | None = None, seconds: float = 1.0) -> float:
    """Best observed FLOP/s of a square ``size`` matmul (``2 size^3`` FLOPs) in this process's
    thread setting, over about ``seconds`` of repeats: the ceiling the model's own matmuls can
    reach here, measured now. On a shared machine the best repeat is the one that got the cores.
    ``size`` defaults to 1024 on a CPU and 8192 on a GPU (smaller ones leave a GPU's units idle).
    On a CPU in fp32 the best of PyTorch's BLAS and oneDNN's GEMM (:mod:`posttrain.models.cpu_linear`):
    the faster kernel this machine has sets the ceiling, whichever the run uses."""
    size = size or (8192 if device.startswith("cuda") else 1024)
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    a = torch.randn(size, size, device=device).to(tdtype)
    b = torch.randn(size, size, device=device).to(tdtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else None
    kernels = [lambda: torch.matmul(a, b)]
    if device.startswith("cpu") and dtype == "float32" and cpu_linear.available():
        weight = b.t().contiguous()
        kernels.append(lambda: cpu_linear.onednn_linear(a, weight))
    return 2.0 * size**3 / min(best_seconds(kernel, seconds, sync) for kernel in kernels)


def matmul_params(model) -> int:
    """Weights that take part in matmuls: every ``nn.Linear`` (a tied ``lm_head`` counts once as a matmul)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def forward_flops(model, seq_len: float, num_seqs: float) -> float:
    """Forward FLOPs of ``num_seqs`` causal sequences of ``seq_len`` tokens::

        2 * N_matmul * tokens  +  2 * n_layers * d_attn * seq_len^2 * num_seqs

    (the second term is ``QK^T`` and ``AV``, ``2 * 2 * d_attn`` per query-key pair, over the
    ``seq_len^2 / 2`` pairs of a causal mask).
    """
    cfg = getattr(model, "config", None)
    layers = getattr(cfg, "num_hidden_layers", 0) or 0
    heads = getattr(cfg, "num_attention_heads", 0) or 0
    head_dim = getattr(cfg, "head_dim", None) or ((getattr(cfg, "hidden_size", 0) or 0) // max(heads, 1))
    attention = 2.0 * layers * heads * head_dim * seq_len**2 * num_seqs
    return 2.0 * matmul_params(model) * seq_len * num_seqs + attention


def iteration_flops(model, metrics: dict[str, float], *, num_prompts: int, n: int) -> dict[str, float]:
    """Useful model FLOPs of one iteration, per phase, from its mean prompt/response lengths.

    A group's ``n`` samples share their prompt, and under causal attention the prompt's forward is
    the same for all of them, so the useful work of every pass is the ``num_prompts`` prompts once
    plus every sample's response over its context (``forward(P + R) - forward(P)`` per sample).
    Recomputing a prompt ``n`` times is wasted work, like padding (``share_prompt_prefix`` avoids
    it). rollout and each log-prob pass: one such forward; update: 3x (backward = 2x forward).
    """
    prompt, resp = metrics.get("prompt_length/mean", 0.0), metrics.get("response_length/mean", 0.0)
    rows = num_prompts * n
    full = (forward_flops(model, prompt, num_prompts) + forward_flops(model, prompt + resp, rows)
            - forward_flops(model, prompt, rows))
    out = {"rollout": full}
    for phase in ("reference_model", "old_log_p"):
        if f"timing/{phase}" in metrics:
            out[phase] = full
    out["update"] = 3.0 * full
    out["all"] = sum(out.values())
    return out


# ---- the benchmark ---------------------------------------------------------------------------------
def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def peak_memory_mib(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


@contextlib.contextmanager
def profiled(out_dir: str | Path | None, device: str = "cpu"):
    """Run the block under ``torch.profiler`` and write ``profile.txt`` (ops by self time, then by
    total time, which includes the ``timing/<phase>`` spans) and ``trace.json`` into ``out_dir``;
    a no-op when ``out_dir`` is None."""
    if out_dir is None:
        yield
        return

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        yield
    averages = prof.key_averages()
    text = ("ops by self time\n" + averages.table(sort_by="self_cpu_time_total", row_limit=25)
            + "\n\nops and phases by total time\n" + averages.table(sort_by="cpu_time_total", row_limit=25))

    write_text_atomic(out / "profile.txt", text)
    trace = out / f".trace.json.tmp-{os.getpid()}"
    try:
        prof.export_chrome_trace(str(trace))
        os.replace(trace, out / "trace.json")
    finally:
        trace.unlink(missing_ok=True)


def bench(cfg, *, iters: int = 3, warmup: int = 1, profile_dir: str | None = None) -> dict:
    """Run ``warmup + iters`` iterations of the on-policy loop for ``cfg``; return the report dict.
    With ``profile_dir`` the last iteration is profiled (:func:`profiled`)."""
    if iters < 1 or warmup < 0:
        raise ConfigError(f"bench needs --iters >= 1 and --warmup >= 0; got {iters} and {warmup}")
    if cfg.stage == "sft" or cfg.stage == "dpo":
        raise ConfigError(f"posttrain bench times the on-policy loop (grpo, dapo, ppo); stage is {cfg.stage}")
    # the same config with enough iterations, and checkpoints and evaluation off
    run_dir = Path(tempfile.mkdtemp(prefix="posttrain_bench_"))
    overrides = [f"actor_config.train_iters={max(cfg.actor.train_iters or 0, warmup + iters)}",
                 "actor_config.save=null", "rl_config.eval_data_path=null", f"rl_config.output_dir={run_dir}"]
    # the user's overrides again, so that a message about one of them names it (not the YAML file)
    users = list(dict.fromkeys(cfg.origins.overrides.values()))
    cfg = run_config_from_dict(cfg.raw, name=cfg.name, path=cfg.path, overrides=[*users, *overrides],
                               lines=cfg.origins.lines)
    plan = resolve_plan(cfg, files=True)
    trainer = build_trainer(plan)
    session = trainer.s
    try:
        peak = matmul_peak(plan.train_dtype, session.device)
        records = []
        last = warmup + iters
        for iteration in range(1, last + 1):
            with profiled(profile_dir if iteration == last else None, session.device), CpuMeter() as meter:
                metrics = trainer.train_step(iteration)
            session.iteration = iteration
            records.append(_record(metrics, meter.result, session.policy.model, trainer, peak))
        # measured again after the run: under load the better of the two is closer to the truth
        peak_after = matmul_peak(plan.train_dtype, session.device)
        if peak_after > peak:
            for rec in records:
                _rescale_mfu(rec, peak, peak_after)
            peak = peak_after
        return _report(cfg, plan, session, records, peak, warmup)
    finally:
        session.close()


def _record(metrics, cpu, model, trainer, peak) -> dict[str, float]:
    rec = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
    gbs, n = trainer.plan.prompts_per_iteration, trainer.plan.n
    rows = gbs * n
    if rec.get("timing/rollout"):
        rec["rollout_response_tps"] = rec.get("response_length/mean", 0.0) * rows / rec["timing/rollout"]
    flops = iteration_flops(model, rec, num_prompts=gbs, n=n)
    for phase, value in flops.items():
        rec[f"flops/{phase}"] = value
        seconds = rec.get(f"timing/{phase}")
        if seconds:
            rec[f"mfu/{phase}"] = value / seconds / peak
    rec["floor_s"] = flops["all"] / peak
    rec.update({f"cpu/{k}": v for k, v in cpu.items()})
    return rec


def _rescale_mfu(rec: dict[str, float], old_peak: float, new_peak: float) -> None:
    for key in [k for k in rec if k.startswith("mfu/")]:
        rec[key] *= old_peak / new_peak
    rec["floor_s"] *= old_peak / new_peak


def _report(cfg, plan, session, all_records, peak, warmup) -> dict:
    records = all_records[warmup:]
    keys = [f"timing/{p}" for p in PHASES] + list(THROUGHPUT) + \
        [f"mfu/{p}" for p in PHASES] + ["floor_s", "cpu/own_cores", "cpu/others_cores"]
    summary = {k: _summary([r[k] for r in records]) for k in keys if all(k in r for r in records)}
    step = summary["timing/all"]["median"]
    run_json = Path(session.run_dir) / "run.json"  # the kernels and threads the run chose
    return {
        "config": cfg.name, "device": session.device, "train_dtype": plan.train_dtype,
        "rollout_dtype": plan.rollout_dtype, "torch_threads": torch.get_num_threads(),
        "run": json.loads(run_json.read_text()) if run_json.exists() else {},
        "num_params": sum(p.numel() for p in session.policy.model.parameters()),
        "matmul_params": matmul_params(session.policy.model), "matmul_peak_gflops": peak / 1e9,
        "warmup": warmup, "iters": len(records), "peak_memory_mib": peak_memory_mib(session.device),
        "step_over_floor": step / summary["floor_s"]["median"], "summary": summary,
        "iterations": all_records,  # warm-up ones first
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def format_table(report: dict) -> str:
    """A plain-text table of the summary (median [min, max] per row)."""
    lines = [f"posttrain bench: {report['config']} on {report['device']} ({report['train_dtype']} train, "
             f"{report['rollout_dtype']} rollout, {report['torch_threads']} threads), "
             f"{report['iters']} iterations after {report['warmup']} warm-up",
             f"{'metric':<26}{'median':>12}{'min':>12}{'max':>12}"]
    for key, s in report["summary"].items():
        lines.append(f"{key:<26}{s['median']:>12.4g}{s['min']:>12.4g}{s['max']:>12.4g}")
    lines.append(f"matmul peak {report['matmul_peak_gflops']:.1f} GFLOP/s; step / floor "
                 f"{report['step_over_floor']:.2f}x; peak memory {report['peak_memory_mib']:.0f} MiB; "
                 f"{report['num_params'] / 1e6:.2f}M parameters")
    return "\n".join(lines)


def write_json(path: str | Path, report: dict) -> None:
    """Write ``report`` to ``path`` through a temporary file renamed when complete."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(report, indent=2, default=str))


PROFILE_FILES = ("profile.txt", "trace.json")


def check_outputs(args) -> None:
    """``--output`` and ``--profile DIR``, checked before the benchmark runs: a directory where a
    file is expected, a file where a directory is, or an earlier result not to be replaced without
    ``--force`` is refused (each message names its flag)."""
    force = bool(getattr(args, "force", False))
    if args.output:
        check_output_file(args.output, "--output", force=force)
    if getattr(args, "profile", None):
        out = Path(args.profile)
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--profile {out} is an existing file; give a directory (it gets "
                              f"{' and '.join(PROFILE_FILES)})")
        found = [n for n in PROFILE_FILES if os.path.lexists(out / n)]
        if found and not force:
            raise ConfigError(f"--profile {out} already holds {', '.join(found)}; give another directory, or "
                              f"--force to replace them")
        check_writable_dir(out, f"--profile {out}")


def run(args) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cfg = load_run_config(args.config_name, args.config_path, args.overrides)
    check_outputs(args)
    report = bench(cfg, iters=args.iters, warmup=args.warmup, profile_dir=getattr(args, "profile", None))
    print(format_table(report))
    if args.output:
        write_json(args.output, report)
        print(f"wrote {args.output}")
    return 0
