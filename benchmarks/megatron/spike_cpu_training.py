"""Spike (issue 17): which parts of Megatron-Core's *training* path run on a CPU with gloo.

The converter's check (tests/megatron) runs Megatron-Core's GPTModel forward and backward through
its pipeline schedules. A training backend needs more: Megatron's DistributedDataParallel (grad
buffers), its optimizer (plain and distributed), activation recompute (``CheckpointFunction``
saves and restores CUDA RNG states) and the RNG tracker's ``add``. Each step below runs in 2 gloo
processes (TP 2, then PP 2, each in its own 2-process world) under posttrain's CPU shims
(``posttrain.training.megatron.cpu_shims``), and reports what ran and what failed, with the error:

    .venv/bin/python benchmarks/megatron/spike_cpu_training.py

Findings are recorded in docs/parallelism.md.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp


STEPS = ("model", "rng_tracker_add", "ddp_wrap", "optimizer", "forward_backward", "finalize_grads",
         "optimizer_step", "optimizer_step_no_clip", "recompute_full", "distributed_optimizer")


def tiny_config(tp: int, pp: int, recompute: bool = False):
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
        add_qkv_bias=True, add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
        normalization="RMSNorm", layernorm_epsilon=1e-6, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, params_dtype=torch.float32,
        use_cpu_initialization=True, perform_initialization=True, bias_dropout_fusion=False,
        apply_rope_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, hidden_dropout=0.0, attention_dropout=0.0, attention_softmax_in_fp32=True,
        recompute_granularity="full" if recompute else None, recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None)


def build(tp: int, pp: int, recompute: bool = False):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = tiny_config(tp, pp, recompute)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    return config, GPTModel(config, spec, vocab_size=128, max_sequence_length=64,
                            pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                            parallel_output=True, share_embeddings_and_output_weights=False,
                            position_embedding_type="rope")


def train_step(model, config, optimizer, tokens):
    """One forward/backward through the schedule and (optionally) an optimizer step."""
    from functools import partial

    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batch, seq = tokens.shape
    position_ids = torch.arange(seq).unsqueeze(0)
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    labels = torch.roll(tokens, -1, dims=1)
    losses = []

    def loss_func(labels_mb, logits):
        ce = tensor_parallel.vocab_parallel_cross_entropy(logits.float().contiguous(), labels_mb)
        loss = ce.mean()
        losses.append(loss.detach())
        return loss, {"loss": loss.detach()}

    def forward_step(data_iterator, m):
        b = next(data_iterator)
        return m(tokens[b:b + 1], position_ids, causal), partial(loss_func, labels[b:b + 1])

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(range(batch)), model=[model],
                                num_microbatches=batch, seq_length=seq, micro_batch_size=1, forward_only=False)
    return losses


def trajectory(tp: int, steps: int = 3, recompute: bool = False) -> list[float]:
    """Losses of ``steps`` training steps (Megatron DDP + optimizer, clip_grad 1.0) from the same
    initial weights: Megatron's CPU initialisation draws each full weight with the same seed and
    splits it, so TP 1 (2 data-parallel replicas on the same data) and TP 2 start alike and must
    follow the same losses if the optimizer step, the clipping shim and recompute are right."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    config, model = build(tp, 1, recompute=recompute)
    wrapped = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.0, bf16=False,
                                                       clip_grad=1.0), [wrapped])
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(steps):
        wrapped.zero_grad_buffer()
        optimizer.zero_grad()
        step_losses = train_step(wrapped, config, optimizer, tokens)
        finalize_model_grads([wrapped])
        optimizer.step()
        losses.append(float(sum(step_losses) / len(step_losses)))
    ps.destroy_model_parallel()
    return losses


def run_layout(tp: int, pp: int) -> dict[str, str]:
    """Every step of the spike at one layout; {step: "ok" | the error}."""
    from megatron.core import parallel_state as ps

    out: dict[str, str] = {}

    def attempt(step, fn):
        try:
            value = fn()
            out[step] = "ok"
            return value
        except Exception as err:  # noqa: BLE001 - the spike records every failure
            where = traceback.extract_tb(err.__traceback__)[-1]
            first = (str(err).splitlines() or [""])[0][:300]
            out[step] = f"{type(err).__name__}: {first} ({Path(where.filename).name}:{where.lineno}: {where.line})"
            out[step + "_trace"] = traceback.format_exc(limit=-4)
            return None

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    attempt("rng_tracker_add", lambda: model_parallel_cuda_manual_seed(1234))
    built = attempt("model", lambda: build(tp, pp))
    if built is None:
        return out
    config, model = built
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))

    def ddp_wrap_model(m, distributed: bool):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=distributed)
        return DistributedDataParallel(config, ddp_config, m)

    def ddp_wrap(distributed: bool):
        return ddp_wrap_model(model, distributed)

    def optimizer_for(wrapped, distributed: bool, clip_grad: float = 1.0):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        opt_config = OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.0, bf16=False, fp16=False,
                                     use_distributed_optimizer=distributed, clip_grad=clip_grad)
        return get_megatron_optimizer(opt_config, [wrapped])

    def wrapped_step(distributed: bool, clip_grad: float):
        """A fresh model in Megatron's DDP, its optimizer, one schedule pass and one step."""
        from megatron.core.distributed import finalize_model_grads

        _, m = build(tp, pp)
        w = ddp_wrap_model(m, distributed)
        opt = optimizer_for(w, distributed, clip_grad=clip_grad)
        w.zero_grad_buffer()
        train_step(w, config, opt, tokens)
        finalize_model_grads([w])
        return opt.step()

    wrapped = attempt("ddp_wrap", lambda: ddp_wrap(False))
    optimizer = attempt("optimizer", lambda: optimizer_for(wrapped, False)) if wrapped is not None else None
    if wrapped is not None:
        wrapped.zero_grad_buffer()
        attempt("forward_backward", lambda: train_step(wrapped, config, optimizer, tokens))

        def finalize():
            from megatron.core.distributed import finalize_model_grads

            finalize_model_grads([wrapped])

        attempt("finalize_grads", finalize)
        if optimizer is not None:
            attempt("optimizer_step", lambda: optimizer.step())

        attempt("optimizer_step_no_clip", lambda: wrapped_step(distributed=False, clip_grad=0.0))

    def recompute():
        _, m = build(tp, pp, recompute=True)
        cfg = tiny_config(tp, pp, recompute=True)
        train_step(m, cfg, None, tokens)

    attempt("recompute_full", recompute)

    attempt("distributed_optimizer", lambda: wrapped_step(distributed=True, clip_grad=1.0))
    ps.destroy_model_parallel()
    return out


def worker(rank: int, world: int, port: int, out_dir: str, tp: int, pp: int) -> None:
    import warnings
    from datetime import timedelta

    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    from posttrain.training.megatron.cpu_shims import cpu_megatron

    torch.set_num_threads(1)
    # a step that fails on one rank leaves the other in a collective: it ends at this timeout
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    with cpu_megatron():
        result = run_layout(tp, pp)
        if pp == 1:  # the same 3 steps at TP 1 (2 replicas) and at TP 2, with and without recompute
            result["trajectories"] = {f"tp{t}{'_recompute' if r else ''}": trajectory(t, recompute=r)
                                      for t in (1, tp) for r in (False, True)}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result, indent=2))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    for tp, pp in ((2, 1), (1, 2)):  # each layout in its own world: a failure cannot leak into the next
        with tempfile.TemporaryDirectory() as out:
            try:
                mp.spawn(worker, args=(2, free_port(), out, tp, pp), nprocs=2, join=True)
            except Exception as err:  # noqa: BLE001 - report, then the next layout
                print(f"== tp{tp}_pp{pp}: a rank failed: {str(err).strip().splitlines()[-1][:300]}")
            path = Path(out, "rank0.json")
            steps = json.loads(path.read_text()) if path.exists() else {}
        print(f"== tp{tp}_pp{pp}")
        for step in STEPS:
            print(f"  {step:22s} {steps.get(step, 'not reached')}")
        for name, losses in steps.get("trajectories", {}).items():
            print(f"  losses {name:16s} " + " ".join(f"{v:.6f}" for v in losses))
        for key, value in steps.items():
            if key.endswith("_trace") and os.environ.get("SPIKE_TRACES"):
                print(f"--- {key}\n{value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
