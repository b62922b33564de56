"""The HF engine vs the Megatron-Core engine (issue 17) on the same model and batch, on this CPU.

One GRPO optimizer step (the actor loss of posttrain.training.loss_fns, 8 rows of 48 prompt + 48
response tokens, ``--micro-batch-size`` rows per micro-batch (default 1), Adam, clip_grad 1.0) is
timed in each layout, with the same micro-batch size for both engines:

* ``hf``: ``TrainEngine`` in one process;
* ``mcore_tp1``: ``MegatronEngine`` at TP 1 in one process (a gloo group of 1);
* ``mcore_tp2`` / ``mcore_pp2``: ``MegatronEngine`` at TP 2 / PP 2 on 2 processes;
* ``mcore_ep2`` (with ``--moe``): ``MegatronEngine`` at EP 2 on 2 processes, each a data-parallel
  rank with half of the rows (4) and half of the experts.

Each layout runs in fresh processes with 1 thread each: 2 warm-up steps, then the median of
``--steps`` steps (wall time of the step on rank 0), and the peak resident set (``VmHWM``) of each
process. The model is a random Qwen2 (hidden 512, 8 layers, 8 heads in 4 groups, FFN 1536, vocab
8192, qkv bias, untied), written once to ``--work``; with ``--moe`` a random Qwen3-MoE of the same
size (8 experts of width 768, 2 per token, renormalised, so as many active parameters per token as
the dense model). The results (and the load average at the end) go to ``--out`` (default
``--work``/results.json, results_moe.json with ``--moe``) under the micro-batch size, so runs with
different sizes fill one file:

    .venv/bin/python benchmarks/megatron/bench_backends.py --work /tmp/bench_backends --steps 5
    .venv/bin/python benchmarks/megatron/bench_backends.py --work /tmp/bench_backends --steps 5 --micro-batch-size 4
    .venv/bin/python benchmarks/megatron/bench_backends.py --work /tmp/bench_backends --steps 5 --moe \
        --layouts hf,mcore_tp1,mcore_ep2
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

LAYOUTS = {"hf": (0, 0, 1), "mcore_tp1": (1, 1, 1), "mcore_tp2": (2, 1, 1), "mcore_pp2": (1, 2, 1),
           "mcore_ep2": (1, 1, 2)}  # (TP, PP, EP)
VOCAB = 8192


def make_model(work: Path, moe: bool = False) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    out = work / ("moe_model" if moe else "model")
    if not (out / "config.json").is_file():
        torch.manual_seed(0)
        sizes = dict(vocab_size=VOCAB, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                     num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                     tie_word_embeddings=False)
        if moe:
            model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**sizes, head_dim=64, num_experts=8, num_experts_per_tok=2,
                                                       moe_intermediate_size=768, norm_topk_prob=True))
        else:
            model = Qwen2ForCausalLM(Qwen2Config(**sizes))
        model.save_pretrained(out)
    return out


def make_batch():
    from posttrain.training.batch import build_batch

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, VOCAB, (48,), generator=g) for _ in range(8)]
    responses = [torch.randint(1, VOCAB, (48,), generator=g) for _ in range(8)]
    batch = build_batch(prompts, responses, pad_token_id=0)
    mask = batch["response_mask"].float()
    batch["old_logprobs"] = -5.0 * mask
    batch["advantages"] = torch.randn(8, 1, generator=g).expand_as(mask) * mask
    return batch


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def timed_steps(step, steps: int) -> list[float]:
    for _ in range(2):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def run_hf(model_dir: Path, steps: int, micro_batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM

    from posttrain.training.engine import TrainEngine
    from posttrain.training.loss_fns import make_actor_loss_fn
    from posttrain.training.optim import build_optimizer

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    engine = TrainEngine(model, build_optimizer(model, 1e-5, weight_decay=0.0), clip_grad=1.0,
                         micro_batch_size=micro_batch_size)
    batch, loss_fn = make_batch(), make_actor_loss_fn()
    times = timed_steps(lambda: engine.update(batch, loss_fn, mini_batch_size=8), steps)
    return {"times": times, "peak_rss_mib": [peak_rss_mib()]}


def mcore_worker(rank: int, world: int, port: int, model_dir: str, tp: int, pp: int, ep: int, steps: int,
                 micro_batch_size: int, out: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from posttrain.training.loss_fns import make_actor_loss_fn
    from posttrain.training.megatron.cpu_shims import cpu_megatron
    from posttrain.training.megatron.engine import MegatronEngine
    from posttrain.training.megatron.model import hf_to_megatron

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    with cpu_megatron():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep)
        [chunk], args = hf_to_megatron(model_dir, for_training=True)  # one chunk: no virtual stages
        wrapped = DistributedDataParallel(chunk.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False), chunk)
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-5, weight_decay=0.0,
                                                           clip_grad=1.0, bf16=False), [wrapped])
        engine = MegatronEngine(wrapped, optimizer, vocab_size=int(args.vocab_size),
                                micro_batch_size=micro_batch_size)
        batch, loss_fn = make_batch(), make_actor_loss_fn()
        if ep > 1:  # the data-parallel ranks share the rows out
            batch = {k: v[rank::world] for k, v in batch.items()}
        times = timed_steps(lambda: engine.update(batch, loss_fn, mini_batch_size=8 // (world // (tp * pp))), steps)
        ps.destroy_model_parallel()
    peaks = [None] * world
    dist.all_gather_object(peaks, peak_rss_mib())
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "peak_rss_mib": peaks}))
    dist.destroy_process_group()


def run_mcore(model_dir: Path, tp: int, pp: int, ep: int, steps: int, micro_batch_size: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        world = tp * pp * ep  # expert parallelism splits the data-parallel ranks' experts
        mp.spawn(mcore_worker, args=(world, port, str(model_dir), tp, pp, ep, steps, micro_batch_size, str(out)),
                 nprocs=world, join=True)
        return json.loads(out.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--micro-batch-size", type=int, default=1, help="rows per micro-batch (both engines)")
    p.add_argument("--out", type=Path, help="results JSON, merged per micro-batch size (default WORK/results.json)")
    p.add_argument("--moe", action="store_true", help="a Qwen3-MoE model of the same size (for mcore_ep2)")
    args = p.parse_args()
    mbs = args.micro_batch_size
    args.work.mkdir(parents=True, exist_ok=True)
    model_dir = make_model(args.work, args.moe)
    results = {}
    for name in args.layouts.split(","):
        tp, pp, ep = LAYOUTS[name]
        if name == "hf":  # in a fresh process too, for a comparable peak
            with mp.get_context("spawn").Pool(1) as pool:
                results[name] = pool.apply(run_hf, (model_dir, args.steps, mbs))
        else:
            results[name] = run_mcore(model_dir, tp, pp, ep, args.steps, mbs)
        r = results[name]
        print(f"{name}: step median {statistics.median(r['times']):.3f} s {['%.3f' % t for t in r['times']]}, "
              f"peak RSS per process {[round(m) for m in r['peak_rss_mib']]} MiB", flush=True)
    with open("/proc/loadavg") as fh:
        load = fh.read().split()[:3]
    out = args.out or args.work / ("results_moe.json" if args.moe else "results.json")
    saved = json.loads(out.read_text()) if out.is_file() else {}
    saved = saved if "micro_batch_size" in saved else {"micro_batch_size": {}}
    saved["micro_batch_size"][str(mbs)] = {"steps": args.steps, "load_average": load, "results": results}
    out.write_text(json.dumps(saved, indent=2) + "\n")
    base = statistics.median(results["hf"]["times"]) if "hf" in results else None
    print(f"\nmicro-batch size {mbs}")
    print("| layout | processes | step median (s) | vs hf | peak RSS per process (MiB) |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        median = statistics.median(r["times"])
        ratio = f"{median / base:.2f}x" if base else "-"
        print(f"| {name} | {len(r['peak_rss_mib'])} | {median:.3f} | {ratio} | "
              f"{' / '.join(str(round(m)) for m in r['peak_rss_mib'])} |")
    print(f"load average at the end: {' '.join(load)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
