"""The oneDNN fp32 linear (posttrain.models.cpu_linear): its forward and both gradients against
float64, a whole model's loss and gradients against PyTorch's own kernel, what it leaves alone,
and how the kernel is chosen."""

from __future__ import annotations

import pytest
import torch

from posttrain.models import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="this PyTorch build has no oneDNN")


@pytest.fixture
def onednn():
    cpu_linear.set_cpu_linear("onednn")
    yield
    cpu_linear.set_cpu_linear("blas")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(37, 48), (2, 5, 48), (3, 1, 48)])
def test_forward_and_gradients_equal_float64(shape, bias):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen, requires_grad=True)
    w = torch.randn(24, 48, generator=gen, requires_grad=True)
    b = torch.randn(24, generator=gen, requires_grad=True) if bias else None
    grad = torch.randn(*shape[:-1], 24, generator=gen)
    out = cpu_linear.onednn_linear(x, w, b)
    out.backward(grad)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_() if bias else None
    want = torch.nn.functional.linear(x64, w64, b64)
    want.backward(grad.double())
    assert out.shape == want.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)
    if bias:
        torch.testing.assert_close(b.grad.double(), b64.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])  # q/k/v biases; a tied LM head
def test_a_model_trains_the_same_through_onednn(tiny_hf, kind, onednn):
    """A causal LM's loss and every parameter's gradient equal those of PyTorch's kernel (fp32
    rounding), and the oneDNN path really ran (its autograd node is in the graph)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_hf(kind))
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))

    def loss_and_grads():
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, loss

    got_loss, got, graph = loss_and_grads()
    nodes, seen = [graph.grad_fn], set()
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nodes.extend(n for n, _ in node.next_functions)
    assert any("OneDnnLinear" in type(n).__name__ for n in seen)
    cpu_linear.set_cpu_linear("blas")
    want_loss, want, _ = loss_and_grads()
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)


def test_it_leaves_bf16_autocast_and_other_dtypes_to_torch(onednn):
    layer = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16  # autocast's own (oneDNN bf16) path
    half = torch.nn.Linear(8, 4).to(torch.bfloat16)
    assert half(x.to(torch.bfloat16)).dtype == torch.bfloat16
    assert layer(torch.randn(0, 8)).shape == (0, 4)
    assert layer(x).grad_fn is not None and "OneDnnLinear" in type(layer(x).grad_fn).__name__


def test_set_cpu_linear_restores_torchs_forward():
    original = torch.nn.Linear.forward
    cpu_linear.set_cpu_linear("onednn")
    assert torch.nn.Linear.forward is not original
    cpu_linear.set_cpu_linear("blas")
    assert torch.nn.Linear.forward is original


def test_the_choice(monkeypatch):
    monkeypatch.setenv(cpu_linear.ENV, "onednn")
    assert cpu_linear.resolve_cpu_linear("cpu") == "onednn"
    monkeypatch.setenv(cpu_linear.ENV, "BLAS")
    assert cpu_linear.resolve_cpu_linear("cpu") == "blas"
    monkeypatch.setenv(cpu_linear.ENV, "mkl")
    with pytest.raises(Exception, match=r"POSTTRAIN_CPU_LINEAR='mkl': use one of blas, onednn"):
        cpu_linear.resolve_cpu_linear("cpu")
    monkeypatch.delenv(cpu_linear.ENV)
    assert cpu_linear.resolve_cpu_linear("cuda:0") == "blas"
    monkeypatch.setattr(cpu_linear, "speedup", lambda threads: 2.2)
    assert cpu_linear.resolve_cpu_linear("cpu") == "onednn"
    monkeypatch.setattr(cpu_linear, "speedup", lambda threads: 1.1)
    assert cpu_linear.resolve_cpu_linear("cpu") == "blas"


def test_speedup_is_measured_once_per_thread_count():
    first = cpu_linear.speedup(torch.get_num_threads())
    assert first > 0 and cpu_linear.speedup(torch.get_num_threads()) == first
