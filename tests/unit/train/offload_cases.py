"""Shared by the CPU and the CUDA offload tests: two SFT updates of a tiny Qwen2, with or without
:class:`~posttrain.training.offload.StateOffload`, recording where the optimizer state is during each
step; and rollouts with the weights off the device (``offload_train_param``)."""

from __future__ import annotations

import gc

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from posttrain.training.engine import TrainEngine
from posttrain.training.batch import build_batch
from posttrain.training.loss_fns import make_sft_loss_fn
from posttrain.training.offload import StateOffload
from posttrain.training.optim import build_optimizer


def tiny_model(device: str, hidden: int = 32) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=48, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    return Qwen2ForCausalLM(config).float().to(device)


def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 48, (n,), generator=g) for n in (5, 3, 4, 2)]
    responses = [torch.randint(1, 48, (n,), generator=g) for n in (4, 6, 2, 5)]
    return build_batch(prompts, responses, pad_token_id=0)


def two_updates(device: str, offload: bool):
    """(engine, optimizer-state bytes on the device during each loss call, and after each update)."""
    model = tiny_model(device)
    optimizer = build_optimizer(model, lr=1e-2, weight_decay=0.0)
    state = StateOffload(optimizer, optimizer_state=True, grads=True) if offload else None
    engine = TrainEngine(model, optimizer, micro_batch_size=2, offload=state)
    sft, during, after = make_sft_loss_fn(), [], []
    probe = state or StateOffload(optimizer, optimizer_state=False, grads=False)  # reads the bytes only

    def loss_fn(m, micro_batch, **kw):
        during.append(probe.device_bytes())
        return sft(m, micro_batch, **kw)

    for _ in range(2):
        engine.update(batch(), loss_fn, mini_batch_size=4)
        after.append(probe.device_bytes())
    return engine, during, after


def moment_bytes(model) -> int:
    """AdamW's two moments of ``model``'s parameters."""
    return 2 * sum(p.numel() * p.element_size() for p in model.parameters())


def rollouts_with_weights_off(device: str, hidden: int = 32) -> dict:
    """generate_config.offload_train_param's mechanism on ``device``: a native engine sampling from
    its bf16 copy of a tiny fp32 actor, with the actor's weights on the host during each
    ``generate`` (:func:`~posttrain.training.offload.weights_off_during_rollout`), around an optimizer
    step. Returns the samples of each call with and without the offload, the weights' bytes on the
    device (and, on CUDA, the allocated device bytes) seen inside each call, the weights' bytes and
    whether every weight came back bit-exact (``hidden``: the model's width; a GPU's allocator
    rounds small tensors up, so the CUDA test measures a wider one)."""
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.native import NativeEngine
    from posttrain.training.offload import weights_off_during_rollout

    model = tiny_model(device, hidden)
    engine = NativeEngine(model, pad_token_id=0, eos_token_ids=[], dtype="bfloat16")
    rollout = weights_off_during_rollout(engine, model)
    offload, inner = rollout.offload, engine.generate
    seen = {"weights": [], "allocated": []}

    def watched(*args, **kwargs):  # what the device holds while the engine samples
        seen["weights"].append(offload.device_bytes())
        if device.startswith("cuda"):
            seen["allocated"].append(torch.cuda.memory_allocated())
        return inner(*args, **kwargs)

    engine.generate = watched
    prompts, sampling = [[5, 6, 7], [8, 9]], SamplingParams(temperature=1.0, max_tokens=8, seed=3)
    samples = {"offloaded": [], "plain": []}
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    before_allocated = torch.cuda.memory_allocated() if device.startswith("cuda") else 0
    exact = True
    optimizer = build_optimizer(model, lr=1e-1, weight_decay=0.0)
    for step in range(2):
        before = [p.detach().clone() for p in model.parameters()]
        samples["offloaded"].append([[o.token_ids for o in g] for g in rollout.generate(prompts, 2, sampling)])
        exact = exact and all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        fresh = NativeEngine(model, pad_token_id=0, eos_token_ids=[], dtype="bfloat16")  # its own new copy
        samples["plain"].append([[o.token_ids for o in g] for g in fresh.generate(prompts, 2, sampling)])
        del fresh
        gc.collect()  # its copy is gone before the next call measures the device
        if step == 0:  # the weights move: the next call must sample from a refreshed copy
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)  # the device holds the weights and AdamW's moments
    return {"samples": samples, "seen": seen, "weights": weights, "exact": exact, "offload": offload,
            "before_allocated": before_allocated}
