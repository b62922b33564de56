"""The Megatron-Core backend's engine on a real GPU (run by `make device-check`; skipped without
CUDA or megatron-core, whose wheel must be carried to the device machine: `pip install --no-deps
megatron-core==0.16.1`). Never run yet: no session had a GPU when it was written.

At TP 1 in one nccl process, without the CPU shims: the fp32 engine's GRPO steps equal the HF
engine's (rel 1e-4, as on a CPU); the bf16 engine (``Float16Module`` weights, Megatron's bf16
optimizer with fp32 main parameters, as ``bf16: true`` builds it on CUDA) takes steps close to them
(rel 5e-2) with its main parameters in float32; a Qwen3-MoE model's fp32 steps equal HF's too."""

from __future__ import annotations

import os
import socket

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
megatron = pytest.importorskip("megatron.core")
from tests.megatron.test_megatron_update import grpo_batch, hf_run, loss_fn  # noqa: E402  (after the skip)


@pytest.fixture(scope="module")
def nccl_world():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    ps.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(0)  # as MegatronPolicy does: attention forks its RNG
    yield
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def megatron_steps(hf_dir, batch, bf16: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from posttrain.training.megatron.engine import MegatronEngine
    from posttrain.training.megatron.model import hf_to_megatron

    options = dict(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16) if bf16 else {}
    [chunk], _ = hf_to_megatron(hf_dir, for_training=True, **options)
    chunk.cuda()
    module = Float16Module(chunk.config, chunk) if bf16 else chunk
    wrapped = DistributedDataParallel(chunk.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.0, clip_grad=1.0,
                                                       bf16=bf16), [wrapped])
    engine = MegatronEngine(wrapped, optimizer, vocab_size=100)
    steps = engine.update({k: v.cuda() for k, v in batch.items()}, loss_fn(), mini_batch_size=2, epochs=2,
                          shuffle=True, seed=5)
    return steps, optimizer


@pytest.mark.parametrize("model,bf16", [("qwen2", False), ("qwen2", True), ("qwen3_moe", False)])
def test_the_megatron_engine_on_cuda(nccl_world, tiny_hf, model, bf16):
    """``qwen3_moe``: a mixture-of-experts model (Megatron-Core's router and all-gather dispatcher
    on CUDA, without TransformerEngine)."""
    hf_dir = str(tiny_hf(model))
    batch = grpo_batch(hf_dir)
    want, _, _ = hf_run(hf_dir, batch, "grpo")
    got, optimizer = megatron_steps(hf_dir, batch, bf16)
    for step, (g, w) in enumerate(zip(got, want)):
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
            assert g[key] == pytest.approx(w[key], rel=5e-2 if bf16 else 1e-4, abs=1e-3 if bf16 else 1e-5), (step, key)
    if bf16:  # fp32 main parameters behind the bf16 weights
        mains = [p for o in getattr(optimizer, "chained_optimizers", [optimizer]) for g in o.optimizer.param_groups
                 for p in g["params"]]
        assert mains and all(p.dtype == torch.float32 for p in mains)
