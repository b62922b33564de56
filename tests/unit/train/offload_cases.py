"""Shared by the CPU and the CUDA offload tests: two SFT updates of a tiny Qwen2, with or without
:class:`~posttrain.train.offload.StateOffload`, recording where the optimizer state is during each step."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from posttrain.train.engine import TrainEngine
from posttrain.train.batch import build_batch
from posttrain.train.loss_fns import make_sft_loss_fn
from posttrain.train.offload import StateOffload
from posttrain.train.optim import build_optimizer


def tiny_model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
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
