"""LoRA (PEFT) vs full fine-tuning on SmolLM2-135M-Instruct on this CPU (issue 18).

Each variant runs in a fresh process with 1 thread:

* ``full``: GRPO's actor update (posttrain.training.loss_fns, AdamW) on all weights;
* ``lora``: the same on a rank-16 adapter on every linear of the transformer layers
  (``linear_qkv, linear_proj, linear_fc1, linear_fc2``), the base frozen;
* ``rollout_merged`` / ``rollout_peft``: the native rollout engine sampling from the adapted model,
  with the adapter merged into the base weights for the call (posttrain's default,
  :class:`posttrain.models.lora.MergedRollout`) or through PEFT's adapter layers at every step;
* ``ref_copy`` / ``ref_shared``: the reference's log-probs of those 32 rows next to the adapted
  actor, from a frozen copy of the model or, with ``share_backbone``, from the actor with its
  adapter off (:class:`posttrain.models.lora.AdapterOff`).

Reported: the median wall time of ``--steps`` updates (32 rows of 48 prompt + 48 response tokens, 8
rows per micro-batch) or rollouts (32 prompts of 40 tokens, 32 new tokens, greedy), after one
warm-up; the optimizer state's bytes; the peak resident set (``VmHWM``) of the process. The results
and the load average are appended to ``--out``::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lora/bench_lora.py --steps 5 --out benchmarks/lora/results_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def load(model_dir: str, lora: bool):
    from transformers import AutoModelForCausalLM

    from posttrain.models.lora import LoraOptions, add_adapter

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.use_cache = False
    if lora:
        model = add_adapter(model, LoraOptions(r=16, alpha=32, target_modules=tuple(TARGETS)))
    return model


def timed(step, steps: int) -> list[float]:
    step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def run(variant: str, model_dir: str, steps: int) -> dict:
    from posttrain.models.lora import MergedRollout
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.native import NativeEngine
    from posttrain.training.engine import TrainEngine
    from posttrain.training.batch import build_batch
    from posttrain.training.loss_fns import make_actor_loss_fn
    from posttrain.training.optim import build_optimizer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = load(model_dir, variant != "full")
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    out: dict = {}
    if variant.startswith("ref_"):
        import copy

        from posttrain.models.lora import AdapterOff

        batch = build_batch([torch.randint(1, vocab, (48,), generator=g) for _ in range(32)],
                            [torch.randint(1, vocab, (48,), generator=g) for _ in range(32)], pad_token_id=0)
        if variant == "ref_copy":
            reference = TrainEngine(copy.deepcopy(model).requires_grad_(False), micro_batch_size=8)
        else:
            reference = AdapterOff(TrainEngine(model, micro_batch_size=8), model)
        out["times"] = timed(lambda: reference.compute_logprobs(batch), steps)
    elif variant.startswith("rollout"):
        engine = NativeEngine(model, pad_token_id=0, eos_token_ids=None, max_num_seqs=32)
        if variant == "rollout_merged":
            engine = MergedRollout(engine, model)
        prompts = [torch.randint(1, vocab, (40,), generator=g).tolist() for _ in range(32)]
        sampling = SamplingParams(temperature=0, max_tokens=32)
        out["times"] = timed(lambda: engine.generate(prompts, 1, sampling), steps)
    else:
        optimizer = build_optimizer(model, 1e-5, weight_decay=0.0)
        engine = TrainEngine(model, optimizer, micro_batch_size=8)
        batch = build_batch([torch.randint(1, vocab, (48,), generator=g) for _ in range(32)],
                            [torch.randint(1, vocab, (48,), generator=g) for _ in range(32)], pad_token_id=0)
        mask = batch["response_mask"].float()
        batch["old_logprobs"] = -5.0 * mask
        batch["advantages"] = torch.randn(32, 1, generator=g).expand_as(mask) * mask
        loss_fn = make_actor_loss_fn()
        out["times"] = timed(lambda: engine.update(batch, loss_fn, mini_batch_size=32), steps)
        out["optimizer_state_mib"] = sum(t.numel() * t.element_size() for s in optimizer.state.values()
                                         for t in s.values() if torch.is_tensor(t)) / 2**20
        out["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    out["peak_rss_mib"] = peak_rss_mib()
    return out


def main() -> int:
    from posttrain.demo.pretrained import resolve_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--variants", default="full,lora,rollout_merged,rollout_peft,ref_copy,ref_shared")
    p.add_argument("--model", default=None, help="an HF model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/lora/results_cpu.json"))
    args = p.parse_args()
    model = str(resolve_model(args.model or "smollm2-135m-instruct"))
    with open("/proc/loadavg") as fh:
        load_start = fh.read().split()[:3]
    results = {}
    for variant in args.variants.split(","):
        with mp.get_context("spawn").Pool(1) as pool:
            results[variant] = r = pool.apply(run, (variant, model, args.steps))
        extra = f", optimizer state {r['optimizer_state_mib']:.1f} MiB" if "optimizer_state_mib" in r else ""
        print(f"{variant}: median {statistics.median(r['times']):.3f} s {['%.3f' % t for t in r['times']]}, "
              f"peak RSS {r['peak_rss_mib']:.0f} MiB{extra}", flush=True)
    with open("/proc/loadavg") as fh:
        load_end = fh.read().split()[:3]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    saved = json.loads(args.out.read_text()) if args.out.is_file() else {"runs": []}  # one entry per invocation
    saved["runs"] = saved.get("runs", []) + [{"model": model, "steps": args.steps, "load_average_start": load_start,
                                              "load_average_end": load_end, "results": results}]
    args.out.write_text(json.dumps(saved, indent=2) + "\n")
    for a, b in (("lora", "full"), ("rollout_merged", "rollout_peft"), ("ref_shared", "ref_copy")):
        if a in results and b in results:
            ratio = statistics.median(results[a]["times"]) / statistics.median(results[b]["times"])
            print(f"{a} / {b}: {ratio:.2f}x time")
    print(f"load average: {' '.join(load_start)} at the start, {' '.join(load_end)} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
