"""A tied embedding's sparse gradient (``training.tied_embedding``): the same step as the dense one."""

import copy

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from posttrain.training import tied_embedding as tied
from posttrain.training.engine import TrainEngine
from posttrain.training.loss_fns import make_actor_loss_fn
from tests.unit.train.test_train_engine import VOCAB, PAD, _actor_batch


def _model(tie: bool = True):
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        pad_token_id=PAD, tie_word_embeddings=tie)).float()


def test_only_a_trainable_tied_embedding_on_one_cpu_process_applies():
    model = _model()
    assert tied.tied_embedding(model) is model.get_input_embeddings()
    assert tied.tied_embedding(_model(tie=False)) is None
    frozen = _model()
    frozen.get_input_embeddings().weight.requires_grad_(False)
    assert tied.tied_embedding(frozen) is None


def test_the_embedding_sends_its_rows_only_inside_and_the_weight_gradient_ends_dense():
    model = _model()
    embed = model.get_input_embeddings()
    ids = torch.tensor([[3, 5, 3, 7]])
    with tied.sparse_embedding_grad(model) as on:
        assert on and embed.sparse
        assert torch.autograd.grad(embed(ids).sum(), embed.weight)[0].is_sparse  # the embedding's own gradient
        model(ids).logits.square().mean().backward()  # head and embedding: dense + sparse = dense
        sparse_sum, embed.weight.grad = embed.weight.grad, None
        model.model(ids).last_hidden_state.square().mean().backward()  # the embedding's rows alone, made dense
        rows_only, embed.weight.grad = embed.weight.grad, None
    assert not embed.sparse and sparse_sum.layout == torch.strided and rows_only.layout == torch.strided
    model(ids).logits.square().mean().backward()
    assert torch.allclose(sparse_sum, embed.weight.grad, atol=1e-7, rtol=1e-6)
    embed.weight.grad = None
    model.model(ids).last_hidden_state.square().mean().backward()
    assert torch.equal(rows_only, embed.weight.grad)


def test_an_update_step_equals_the_dense_gradients(monkeypatch):
    base = _model()
    batch = _actor_batch(base)
    seen = []
    sparse, dense = copy.deepcopy(base), copy.deepcopy(base)
    sparse.get_input_embeddings().register_forward_hook(lambda module, *_: seen.append(module.sparse))
    for model in (sparse, dense):
        if model is dense:
            monkeypatch.setattr(tied, "tied_embedding", lambda model: None)
        engine = TrainEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), clip_grad=1.0, micro_batch_size=4)
        engine.update(batch, make_actor_loss_fn(), mini_batch_size=8)
    assert seen and all(seen)  # the sparse model's update forwards ran with the sparse gradient
    for a, b in zip(sparse.parameters(), dense.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    assert not torch.equal(sparse.lm_head.weight, base.lm_head.weight)
