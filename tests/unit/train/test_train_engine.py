"""TrainEngine on a tiny random Qwen2: exact log-probs, micro-batch invariance, clipping, NaN."""

import copy

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from posttrain.algo.logprob import logprobs_from_logits
from posttrain.errors import ConfigError
from posttrain.training.engine import NaNLossError, TrainEngine
from posttrain.training.batch import build_batch, default_position_ids
from posttrain.training.loss_fns import make_actor_loss_fn
from posttrain.training.optim import build_lr_scheduler, build_optimizer

VOCAB, PAD = 48, 0


def tiny_model(seed=0):
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=PAD, tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config).float()


def make_batch(prompt_lens, resp_lens, seed=1):
    """Random prompts and responses of these lengths in the layout of training/batch.py (the builder
    production uses): left-padded prompts || right-padded responses."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (p,), generator=g) for p in prompt_lens]
    responses = [torch.randint(1, VOCAB, (r,), generator=g) for r in resp_lens]
    return build_batch(prompts, responses, pad_token_id=PAD)


def unpadded_logprobs(model, batch, row, P, temperature):
    """Reference: run the row alone without any padding and read the response log-probs."""
    real = batch["input_ids"][row][batch["attention_mask"][row].bool()]
    num_prompt = int(batch["attention_mask"][row, :P].sum())
    with torch.no_grad():
        logits = model(real[None]).logits
    lp = logprobs_from_logits(logits[:, :-1], real[None, 1:], temperature)[0]
    return lp[num_prompt - 1 :]


def test_compute_logprobs_equals_unpadded_forward():
    model = tiny_model()
    batch = make_batch([5, 2, 3], [4, 2, 1])
    engine = TrainEngine(model, micro_batch_size=2)
    logprobs, entropy = engine.compute_logprobs(batch, temperature=0.7, with_entropy=True)
    assert logprobs.shape == (3, 4) and entropy.shape == (3, 4)
    for row, r in enumerate([4, 2, 1]):
        ref = unpadded_logprobs(model, batch, row, 5, 0.7)
        assert torch.allclose(logprobs[row, :r], ref, atol=1e-5)
        assert torch.all(logprobs[row, r:] == 0) and torch.all(entropy[row, r:] == 0)
    assert torch.all(entropy[batch["response_mask"].bool()] > 0)


def test_default_position_ids_skip_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0]])
    assert default_position_ids(mask).tolist() == [[0, 0, 0, 1, 2, 2]]


def _actor_batch(model, seed=3):
    batch = make_batch([5, 1, 3, 2, 4, 5, 2, 3], [4, 1, 3, 2, 4, 2, 1, 3], seed=seed)
    engine = TrainEngine(model, micro_batch_size=8)
    batch["old_logprobs"] = engine.compute_logprobs(batch)
    g = torch.Generator().manual_seed(seed)
    batch["advantages"] = torch.randn(8, 1, generator=g).expand(8, 4) * batch["response_mask"]
    return batch


def _run_update(model, batch, micro, loss_fn, lr=0.1):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    engine = TrainEngine(model, opt, clip_grad=0.0, micro_batch_size=micro)
    return engine.update(batch, loss_fn, mini_batch_size=8)


def test_1x8_and_8x1_micro_batches_give_the_same_step():
    base = tiny_model()
    batch = _actor_batch(base)
    loss_fn = make_actor_loss_fn()
    one, eight = copy.deepcopy(base), copy.deepcopy(base)
    m1 = _run_update(one, batch, micro=8, loss_fn=loss_fn)[0]
    m8 = _run_update(eight, batch, micro=1, loss_fn=loss_fn)[0]
    for p1, p8 in zip(one.parameters(), eight.parameters()):
        assert torch.allclose(p1, p8, atol=1e-6)
    assert m1["actor/grad_norm"] == pytest.approx(m8["actor/grad_norm"], rel=1e-4)
    assert m1["actor/pg_loss"] == pytest.approx(m8["actor/pg_loss"], abs=1e-6)
    assert m1["actor/entropy"] == pytest.approx(m8["actor/entropy"], rel=1e-5)

    # the seed's per-micro-batch token-mean (normaliser = own tokens) depends on the split
    def seed_style(model, mb, *, num_tokens, num_seqs, packing=None):
        return loss_fn(model, mb, num_tokens=None, num_seqs=None)

    s1, s8 = copy.deepcopy(base), copy.deepcopy(base)
    _run_update(s1, batch, micro=8, loss_fn=seed_style)
    _run_update(s8, batch, micro=1, loss_fn=seed_style)
    diff = max((a - b).abs().max().item() for a, b in zip(s1.parameters(), s8.parameters()))
    assert diff > 1e-4


def test_positive_advantage_raises_logprob_and_lr_is_reported():
    model = tiny_model()
    batch = make_batch([3], [4])
    engine = TrainEngine(model, micro_batch_size=1)
    batch["old_logprobs"] = engine.compute_logprobs(batch)
    batch["advantages"] = torch.ones(1, 4)
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.0)
    engine = TrainEngine(model, opt, build_lr_scheduler(opt, lr=1e-2, total_steps=4), micro_batch_size=1)
    metrics = engine.update(batch, make_actor_loss_fn(), mini_batch_size=1)
    after = engine.compute_logprobs(batch)
    assert after.sum() > batch["old_logprobs"].sum() + 0.1
    assert metrics[0]["actor/lr"] == pytest.approx(1e-2)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.75e-2)  # scheduler stepped once


def test_clip_grad_clips_the_global_norm():
    model = tiny_model()
    batch = _actor_batch(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = TrainEngine(model, opt, clip_grad=1e-3, micro_batch_size=4)
    metrics = engine.update(batch, make_actor_loss_fn(), mini_batch_size=8)[0]
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert metrics["actor/grad_norm"] > 1e-2
    assert clipped.item() == pytest.approx(1e-3, rel=1e-3)


def test_nan_loss_raises_without_stepping():
    model = tiny_model()
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    engine = TrainEngine(model, opt, micro_batch_size=1)
    batch = make_batch([2, 2], [2, 2])

    def nan_loss(model, mb, *, num_tokens, num_seqs, packing=None):
        out = model(input_ids=mb["input_ids"]).logits.sum()
        return out * float("nan"), {}

    with pytest.raises(NaNLossError, match="skipped"):
        engine.update(batch, nan_loss, mini_batch_size=2)
    assert not opt.state  # never stepped
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])


def test_minibatch_split_epochs_shuffle_and_errors():
    model = tiny_model()
    batch = _actor_batch(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = TrainEngine(model, opt, micro_batch_size=2)
    metrics = engine.update(batch, make_actor_loss_fn(), mini_batch_size=4, epochs=2, shuffle=True, seed=7)
    assert len(metrics) == 4
    again = engine.update(batch, make_actor_loss_fn(), mini_batch_size=4, epochs=2, shuffle=True, seed=7)
    assert [m["actor/pg_loss"] for m in metrics] == pytest.approx([m["actor/pg_loss"] for m in again])
    with pytest.raises(ConfigError, match="mini-batches"):
        engine.update(batch, make_actor_loss_fn(), mini_batch_size=3)


def test_state_dict_roundtrip():
    model = tiny_model()
    batch = _actor_batch(model)
    opt = build_optimizer(model, lr=1e-3)
    engine = TrainEngine(model, opt, build_lr_scheduler(opt, lr=1e-3, total_steps=10), micro_batch_size=8)
    engine.update(batch, make_actor_loss_fn(), mini_batch_size=8)
    state = engine.state_dict()
    model2 = copy.deepcopy(model)
    opt2 = build_optimizer(model2, lr=1e-3)
    engine2 = TrainEngine(model2, opt2, build_lr_scheduler(opt2, lr=1e-3, total_steps=10))
    engine2.load_state_dict(state)
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.9e-3)
    assert engine2.scheduler.num_steps == 1
    assert len(opt2.state) == len(opt.state)


def test_bf16_autocast_and_activation_checkpointing():
    base = tiny_model()
    batch = _actor_batch(base)
    plain, ckpt = copy.deepcopy(base), copy.deepcopy(base)
    _run_update(plain, batch, micro=4, loss_fn=make_actor_loss_fn())
    opt = torch.optim.SGD(ckpt.parameters(), lr=0.1)
    engine = TrainEngine(ckpt, opt, clip_grad=0.0, micro_batch_size=4, activation_checkpointing=True)
    engine.update(batch, make_actor_loss_fn(), mini_batch_size=8)
    for a, b in zip(plain.parameters(), ckpt.parameters()):
        assert torch.allclose(a, b, atol=1e-5)  # 3 steps of 1e-2 each: rounding only
    bf = copy.deepcopy(base)
    engine = TrainEngine(bf, torch.optim.SGD(bf.parameters(), lr=0.1), micro_batch_size=4, dtype="bfloat16")
    lp = engine.compute_logprobs(batch)
    assert lp.dtype == torch.float32
    assert torch.allclose(lp, batch["old_logprobs"], atol=0.1)  # bf16 is close, not exact
    metrics = engine.update(batch, make_actor_loss_fn(), mini_batch_size=8)[0]
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    with pytest.raises(ConfigError, match="dtype"):
        TrainEngine(bf, dtype="float16")


def test_build_batch_layout():
    batch = build_batch([[5, 6, 7], [8]], [[9], [10, 11]], pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 9, 0], [0, 0, 8, 10, 11]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 0], [0, 0, 1, 1, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 3], [0, 0, 0, 1, 2]]
    assert batch["response_mask"].tolist() == [[1, 0], [1, 1]]


def test_on_policy_skip_equals_explicit_old_logprobs():
    base = tiny_model()
    batch = _actor_batch(base)
    skip = {k: v for k, v in batch.items() if k != "old_logprobs"}
    explicit, skipped = copy.deepcopy(base), copy.deepcopy(base)
    m_explicit = _run_update(explicit, batch, micro=4, loss_fn=make_actor_loss_fn())[0]
    m_skip = _run_update(skipped, skip, micro=4, loss_fn=make_actor_loss_fn())[0]
    assert m_skip["actor/ppo_kl"] == 0.0 and m_skip["actor/pg_clipfrac"] == 0.0
    for a, b in zip(explicit.parameters(), skipped.parameters()):
        assert torch.allclose(a, b, atol=1e-5)  # 3 steps of 1e-2 each: rounding only
    assert m_explicit["actor/pg_loss"] == pytest.approx(m_skip["actor/pg_loss"], abs=1e-5)


def test_nan_gradient_raises_without_stepping():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = TrainEngine(model, opt, micro_batch_size=2)
    before = copy.deepcopy(model.state_dict())

    def nan_grad(model, mb, *, num_tokens, num_seqs, packing=None):  # finite loss, NaN gradient (sqrt at 0)
        return torch.sqrt(model.lm_head.weight[0, 0] * 0.0), {}

    with pytest.raises(NaNLossError, match="gradient norm"):
        engine.update(make_batch([2, 2], [2, 2]), nan_grad, mini_batch_size=2)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])


def test_the_optimizer_is_fused_adamw_with_the_default_update():
    """Plain CPU parameters get torch's fused AdamW, whose steps equal the per-parameter loop's
    within float rounding (weight decay on matrices only, as before)."""
    fused_model, loop_model = tiny_model(), tiny_model()
    fused = build_optimizer(fused_model, lr=1e-2, weight_decay=0.1)
    assert all(group["fused"] for group in fused.param_groups)
    loop = torch.optim.AdamW([{"params": [p for n, p in loop_model.named_parameters() if p.ndim >= 2
                                          and not n.endswith(".bias")], "weight_decay": 0.1},
                              {"params": [p for n, p in loop_model.named_parameters() if p.ndim < 2
                                          or n.endswith(".bias")], "weight_decay": 0.0}], lr=1e-2)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    for _ in range(3):
        for model, opt in ((fused_model, fused), (loop_model, loop)):
            opt.zero_grad()
            model(ids, labels=ids).loss.backward()
            opt.step()
    for a, b in zip(fused_model.parameters(), loop_model.parameters()):
        assert torch.allclose(a, b, atol=1e-5)  # 3 steps of 1e-2 each: rounding only
