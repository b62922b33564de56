"""The CPU path of the packed attention (issue 43): equal to the general masked SDPA in fp32, forward
and backward; within bf16 rounding in bf16 (and closer to fp32 than bf16 SDPA); off restores it."""

import pytest
import torch
import torch.nn.functional as F

from posttrain.errors import ConfigError
from posttrain.models import cpu_attention
from posttrain.training import remove_padding as rp

HEADS, KV_HEADS, DIM = 6, 2, 8
LENGTHS = [9, 3, 7, 7, 2, 5]  # rows of a block; slots past a row's length are padding


class _Module(torch.nn.Module):
    pass


def _block_inputs(seed=0):
    """Packed q/k/v ``[1, h, N, D]`` and one block's ``pad_index``/``valid`` (padding slots clamped)."""
    g = torch.Generator().manual_seed(seed)
    total, width = sum(LENGTHS), max(LENGTHS)
    starts = torch.tensor([0] + LENGTHS[:-1]).cumsum(0)[:, None]
    slots = torch.arange(width)[None, :]
    valid = slots < torch.tensor(LENGTHS)[:, None]
    index = (starts + slots).clamp(max=total - 1)
    q = torch.randn(1, HEADS, total, DIM, generator=g)
    k, v = (torch.randn(1, KV_HEADS, total, DIM, generator=g) for _ in range(2))
    return q, k, v, index, valid


def _reference(q, k, v, index, valid):
    """The masked form written out: per row, causal attention over its own real slots (GQA repeated)."""
    rows, width = index.shape
    gather = [x[0][:, index.reshape(-1)].reshape(x.shape[1], rows, width, DIM).transpose(0, 1) for x in (q, k, v)]
    qb, kb, vb = gather[0], *(x.repeat_interleave(HEADS // KV_HEADS, 1) for x in gather[1:])
    mask = torch.ones(width, width, dtype=torch.bool).tril()[None, None] & valid[:, None, None, :]
    return F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask).transpose(1, 2).reshape(rows * width, HEADS, DIM)


def _run(q, k, v, index, valid, dtype=torch.float32):
    """``_block_attention`` on the real slots: output and the grads of q/k/v for a fixed output grad."""
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    out = rp._block_attention(_Module().eval(), *leaves, 0.0, None, index, valid)
    real = valid.reshape(-1)
    grad = torch.linspace(-1, 1, int(real.sum()) * HEADS * DIM).reshape(-1, HEADS, DIM)
    (out[real].float() * grad).sum().backward()
    return out[real].float(), [x.grad.float() for x in leaves]


def test_fp32_equals_masked_path_forward_and_backward(monkeypatch):
    inputs = _block_inputs()
    monkeypatch.setenv(cpu_attention.ENV, "off")
    old_out, old_grads = _run(*inputs)
    ref = _reference(*inputs)[inputs[4].reshape(-1)]
    assert torch.equal(old_out, ref)  # off: the general masked SDPA, bit for bit
    monkeypatch.setenv(cpu_attention.ENV, "on")
    new_out, new_grads = _run(*inputs)
    assert torch.allclose(new_out, old_out, atol=1e-5)
    assert all(g.abs().sum() > 0 and torch.allclose(g, o, atol=1e-5) for g, o in zip(new_grads, old_grads))


def test_bf16_is_within_bf16_rounding_and_closer_to_fp32(monkeypatch):
    q, k, v, index, valid = _block_inputs(seed=1)
    inputs = (*(x.bfloat16().float() for x in (q, k, v)), index, valid)  # values bf16 holds exactly
    exact_out, exact_grads = _run(*inputs)
    monkeypatch.setenv(cpu_attention.ENV, "off")
    old_out, old_grads = _run(*inputs, dtype=torch.bfloat16)
    monkeypatch.setenv(cpu_attention.ENV, "on")
    new_out, new_grads = _run(*inputs, dtype=torch.bfloat16)
    assert torch.allclose(new_out, old_out, atol=3e-2) and torch.allclose(new_out, exact_out, atol=1e-2, rtol=1e-2)
    for new, old, exact in zip(new_grads, old_grads, exact_grads):
        assert torch.allclose(new, exact, atol=5e-2, rtol=2e-2)
        assert (new - exact).abs().mean() <= (old - exact).abs().mean()  # one rounding, at the output


def test_bf16_under_autocast_returns_bf16_from_fp32_inputs():
    q, k, v, index, valid = _block_inputs(seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = rp._block_attention(_Module().eval(), q, k, v, 0.0, None, index, valid)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out[valid.reshape(-1)].float(), _reference(q, k, v, index, valid)[valid.reshape(-1)], atol=1e-2)


def test_the_rule_keeps_bf16_on_amx_and_fp32_untouched(monkeypatch):
    cpu_attention.bf16_in_fp32.cache_clear()
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert cpu_attention.compute_dtype(torch.bfloat16) == torch.bfloat16
    cpu_attention.bf16_in_fp32.cache_clear()
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert cpu_attention.compute_dtype(torch.bfloat16) == torch.float32
    assert cpu_attention.compute_dtype(torch.float32) == torch.float32
    cpu_attention.bf16_in_fp32.cache_clear()
    assert not cpu_attention.enabled(torch.device("meta"))  # other devices: the masked path


def test_a_bad_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv(cpu_attention.ENV, "maybe")
    with pytest.raises(ConfigError, match="POSTTRAIN_CPU_ATTENTION"):
        cpu_attention.enabled(torch.device("cpu"))
