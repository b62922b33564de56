"""Optimizer parameter groups and the Megatron-style LR schedule."""

import math

import pytest
import torch

from posttrain.errors import ConfigError
from posttrain.training.optim import build_lr_scheduler, build_optimizer


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.emb = torch.nn.Embedding(5, 4)


def _opt(lr=1.0):
    return build_optimizer(_Tiny(), lr=lr, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.9)


def test_no_weight_decay_on_biases_and_norms():
    opt = _opt()
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {tuple(p.shape) for p in decay["params"]} == {(4, 4), (5, 4)}  # linear weight, embedding
    assert len(no_decay["params"]) == 3  # linear bias, norm weight, norm bias
    assert decay["betas"] == (0.8, 0.9)
    with pytest.raises(ConfigError, match="lr"):
        build_optimizer(_Tiny(), lr=None)


def _lrs(style, steps, **kw):
    opt = _opt()
    sched = build_lr_scheduler(opt, lr=1.0, lr_decay_style=style, **kw)
    out = [opt.param_groups[0]["lr"]]
    for _ in range(steps):
        sched.step()
        out.append(opt.param_groups[0]["lr"])
    return out


def test_linear_warmup_then_linear_decay_to_min_lr():
    lrs = _lrs("linear", 12, min_lr=0.1, lr_warmup_fraction=0.2, total_steps=10)
    assert lrs[:3] == pytest.approx([0.0, 0.5, 1.0])  # W = 2 warmup steps from 0
    # after warmup: 0.1 + (1 - (s-2)/8) * 0.9
    assert lrs[6] == pytest.approx(0.1 + 0.5 * 0.9)
    assert lrs[10] == pytest.approx(0.1)
    assert lrs[11] == pytest.approx(0.1) and lrs[12] == pytest.approx(0.1)


def test_cosine_endpoints_and_midpoint():
    lrs = _lrs("cosine", 11, min_lr=0.2, total_steps=10)
    assert lrs[0] == pytest.approx(1.0)
    assert lrs[5] == pytest.approx(0.6)  # half way: min + 0.5 * (max - min)
    assert lrs[3] == pytest.approx(0.2 + 0.5 * (1 + math.cos(math.pi * 0.3)) * 0.8)
    assert lrs[10] == pytest.approx(0.2)
    assert lrs[11] == pytest.approx(0.2)


def test_constant_and_state_dict():
    assert _lrs("constant", 5, min_lr=0.5, total_steps=3) == pytest.approx([1.0] * 6)
    opt = _opt()
    sched = build_lr_scheduler(opt, lr=1.0, lr_decay_style="linear", total_steps=4)
    sched.step()
    opt2 = _opt()
    sched2 = build_lr_scheduler(opt2, lr=1.0, lr_decay_style="linear", total_steps=4)
    sched2.load_state_dict(sched.state_dict())
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.75)


def test_schedule_errors():
    with pytest.raises(ConfigError, match="cosine"):
        build_lr_scheduler(_opt(), lr=1.0, lr_decay_style="wsd", total_steps=3)
    with pytest.raises(ConfigError, match="min_lr"):
        build_lr_scheduler(_opt(), lr=1.0, min_lr=2.0, total_steps=3)


def test_sgd_steps_equal_hand_steps_of_momentum_sgd_with_l2_decay():
    """optimizer: sgd (megatron_training keys -> OptimOptions -> the role's optimizer): two steps equal
    torch SGD's rule by hand, buf = m * buf + (g + wd * p), p -= lr * buf, with no decay on biases and norms."""
    from posttrain.config.megatron import MegatronConfig
    from posttrain.config.options import optim_options
    from posttrain.training.optim import build_role_optimizer

    options = optim_options(MegatronConfig(optimizer="sgd", sgd_momentum=0.5, lr=0.1, weight_decay=0.2))
    model = _Tiny()
    opt = build_role_optimizer(model, options)
    assert isinstance(opt, torch.optim.SGD)
    named = dict(model.named_parameters())
    hand = {name: p.detach().clone() for name, p in named.items()}
    initial = hand["linear.weight"]
    bufs = {}
    for step in range(2):
        opt.zero_grad()
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        loss = (model.norm(model.linear(x)) ** 2).sum() + (model.emb(torch.tensor([1, 3])) ** 3).sum()
        loss.backward()
        for name, p in named.items():
            wd = 0.0 if name.endswith("bias") or p.ndim < 2 else 0.2
            d = p.grad + wd * hand[name]
            bufs[name] = d.clone() if step == 0 else 0.5 * bufs[name] + d
            hand[name] = hand[name] - 0.1 * bufs[name]
        opt.step()
    for name, p in named.items():
        assert torch.allclose(p.detach(), hand[name], atol=1e-6), name
    assert (hand["linear.weight"] - initial).abs().max() > 1e-3  # it moved
    with pytest.raises(ConfigError, match="optimizer"):
        build_optimizer(model, lr=0.1, optimizer="lion")
