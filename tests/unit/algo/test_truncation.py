"""rl_config.truncated_sampling_logprobs: log-probs under the truncated, renormalised sampling
distribution (posttrain.algo.truncation), in the sampler and in the trainer's forward."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from posttrain.algo.logprob import logprobs_from_logits, truncated_logprobs_and_entropy
from posttrain.algo.rollout_correction import rollout_correction
from posttrain.algo.truncation import Truncation, kept_mask, truncated_scaled_logprobs
from posttrain.config.check import check_run_config
from posttrain.config.plan import build_plan
from posttrain.config.run import run_config_from_dict
from posttrain.errors import ConfigError
from posttrain.models.arch import ModelArch
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.native import NativeEngine
from posttrain.training.batch import build_batch, per_token
from posttrain.training.forward import response_logprobs
from posttrain.training.loss_fns import make_actor_loss_fn
from posttrain.training.options import ActorLossOptions
from posttrain.training.remove_padding import Packing

TEMPERATURE = 0.7
CASES = [Truncation(top_k=20, top_p=0.9), Truncation(top_p=0.9), Truncation(top_k=20),
         Truncation(min_p=0.05), Truncation(top_k=30, top_p=0.8, min_p=0.02)]


def reference_logprob(z: np.ndarray, label: int, t: Truncation) -> tuple[float, set[int]]:
    """``log(p_y / mass(S + {y}))`` for one row of scaled logits, in float64, by the rule's words."""
    p = np.exp(z - z.max())
    p /= p.sum()
    order = sorted(range(len(z)), key=lambda v: -z[v])
    kept = order[:t.top_k] if t.top_k > 0 else order
    if t.top_p < 1.0:
        q = p[kept] / p[kept].sum()
        kept = [v for i, v in enumerate(kept) if q[:i].sum() < t.top_p]
    if t.min_p > 0.0:
        q = p[kept] / p[kept].sum()
        kept = [v for i, v in enumerate(kept) if q[i] >= t.min_p * q.max()]
    support = set(kept) | {label}
    return math.log(p[label] / sum(p[v] for v in support)), set(kept)


@pytest.mark.parametrize("truncation", CASES)
def test_truncated_logprob_equals_a_float64_reference(truncation):
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(24, 96, generator=gen) * 3
    labels = torch.randint(0, 96, (24,), generator=gen)  # some outside the kept set: the label joins it
    got = truncated_scaled_logprobs(z, labels, truncation)
    mask = kept_mask(z, truncation)
    for row in range(z.shape[0]):
        want, kept = reference_logprob(z[row].double().numpy(), int(labels[row]), truncation)
        assert got[row].item() == pytest.approx(want, abs=2e-5)
        assert set(torch.nonzero(mask[row]).flatten().tolist()) == kept
    # the chunked logits path agrees, with the temperature applied inside
    again = logprobs_from_logits(z[None] * TEMPERATURE, labels[None], TEMPERATURE, chunk_tokens=5, truncation=truncation)
    torch.testing.assert_close(again[0], got, rtol=0, atol=1e-5)


@pytest.mark.parametrize("fn", [truncated_scaled_logprobs, lambda z, y, t: truncated_logprobs_and_entropy(z, y, t)[0]],
                         ids=["autograd", "label_logprob"])  # the lm-head path's custom backward
def test_gradient_reaches_only_the_kept_logits(fn):
    gen = torch.Generator().manual_seed(2)
    z = (torch.randn(16, 96, generator=gen) * 3).requires_grad_()
    t = Truncation(top_k=20, top_p=0.9)
    labels = torch.multinomial(torch.softmax(z.detach(), -1) * kept_mask(z.detach(), t), 1, generator=gen)[:, 0]
    fn(z, labels, t).sum().backward()
    kept = kept_mask(z.detach(), t)
    assert torch.equal(z.grad != 0, kept)  # nonzero exactly on the kept set (here every label is kept)
    mu = torch.softmax(z.detach().double().masked_fill(~kept, -math.inf), -1)
    want = torch.nn.functional.one_hot(labels, 96).double() - mu  # d log mu(y) / dz over the kept set
    torch.testing.assert_close(z.grad.double(), want, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return Qwen2ForCausalLM(cfg).float().eval()


def _rollout(model, truncated: bool):
    sampling = SamplingParams(temperature=TEMPERATURE, top_k=20, top_p=0.9, max_tokens=8, seed=3,
                              truncated_logprobs=truncated)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    outs = [o for group in NativeEngine(model, pad_token_id=0, eos_token_ids=None).generate(prompts, 2, sampling)
            for o in group]
    batch = build_batch([p for p in prompts for _ in range(2)], [o.token_ids for o in outs], pad_token_id=0)
    rollout = per_token([torch.tensor(o.logprobs) for o in outs], batch["response_mask"].shape[1])
    return batch, rollout


def test_on_policy_ratio_is_one_with_truncated_logprobs(model):
    """On-policy (same weights), top_k 20 and top_p 0.9 at temperature 0.7. With the key on, the
    rollout reports log mu(y) and the trainer renormalises over the same kept set: the rollout
    correction's ratio pi_old / mu is 1 to float precision. Without it the trainer's log-probs are
    the full distribution's; against the behaviour policy mu (what vLLM reports, and the native
    engine with the key) the ratio is today the kept mass of each step, p(y) / mu(y) < 1: here
    below 0.99 on some token. (Without the key the native engine reports log p(y), so its ratio is 1,
    but it is not the ratio to the policy that sampled.)"""
    batch, rollout_mu = _rollout(model, truncated=True)
    plain_batch, rollout_full = _rollout(model, truncated=False)
    assert torch.equal(plain_batch["input_ids"], batch["input_ids"])  # the key changes the reports, not the draws
    mask = batch["response_mask"]
    with torch.no_grad():
        old_trunc, _ = response_logprobs(model, batch, temperature=TEMPERATURE, truncation=Truncation(20, 0.9))
        old_full, _ = response_logprobs(model, batch, temperature=TEMPERATURE)
        packed, _ = response_logprobs(model, batch, temperature=TEMPERATURE, truncation=Truncation(20, 0.9),
                                      packing=Packing(share_prompts=True))  # use_remove_padding (the default)
    torch.testing.assert_close(packed, old_trunc, rtol=0, atol=2e-5)
    _, _, on = rollout_correction(old_trunc, rollout_mu, mask, mode="tis")
    assert on["rollout/logprob_diff_max"] < 2e-5
    _, _, today = rollout_correction(old_full, rollout_mu, mask, mode="tis")
    assert today["rollout/ratio_max"] <= 1 + 2e-5 and today["rollout/logprob_diff_max"] > 0.01
    _, _, native_today = rollout_correction(old_full, rollout_full, mask, mode="tis")
    assert native_today["rollout/logprob_diff_max"] < 2e-5
    assert bool(((rollout_mu - rollout_full) * mask >= -1e-6).all())  # log mu(y) >= log p(y)

    # the update's forward (with a gradient) takes the same truncated log-probs: the PPO ratio is 1 on-policy
    batch.update(old_logprobs=old_trunc, advantages=torch.ones_like(old_trunc))
    options = ActorLossOptions(temperature=TEMPERATURE, truncation=Truncation(20, 0.9))
    loss, metrics = make_actor_loss_fn(options)(model, batch)
    loss.backward()
    assert abs(float(metrics["actor/ppo_kl"])) < 1e-6 and float(metrics["actor/pg_clipfrac"]) == 0.0
    model.zero_grad(set_to_none=True)


BASE = {
    "megatron_training": {"stage": "ray_grpo", "global_batch_size": 4, "seq_length": 256, "micro_batch_size": 2,
                          "train_iters": 4},
    "rl_config": {"n_samples_per_prompt": 4, "mini_batch_size": 4, "verifier_function": ["base_acc"],
                  "verifier_weight": [1.0], "truncated_sampling_logprobs": True},
    "generate_config": {"infer_tensor_parallel_size": 1, "max_model_len": 256,
                        "sampling_config": {"max_tokens": 64, "top_k": 20, "top_p": 0.9}},
}


ARCH = ModelArch(model_type="qwen2", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                 num_kv_heads=2, head_dim=16, vocab_size=96, tie_embeddings=True)


def _config(overrides=()):
    return run_config_from_dict(copy.deepcopy(BASE), overrides=list(overrides))


def test_the_key_reaches_the_rollout_and_the_actor_only():
    want = Truncation(top_k=20, top_p=0.9, min_p=0.0)
    for on in (True, False):
        cfg = _config([f"rl_config.truncated_sampling_logprobs={str(on).lower()}"])
        layout, _ = check_run_config(cfg, device_type="cpu", arch=ARCH)
        plan = build_plan(cfg, layout, ARCH, device="cpu")
        assert plan.rollout.sampling.truncated_logprobs is on
        assert plan.actor_engine.truncation == plan.actor_loss.truncation == (want if on else None)
        assert plan.ref_engine.truncation is None  # the reference keeps its full distribution


@pytest.mark.parametrize("overrides, words", [
    (["generate_config.sampling_config.temperature=0"], "greedy"),
    (["generate_config.sampling_config.top_k=-1", "generate_config.sampling_config.top_p=1.0"], "whole vocabulary"),
    (["rl_config.rollout_engine=vllm", "generate_config.sampling_config.min_p=0.1"], "min_p before"),
])
def test_what_is_not_built_is_refused_by_key(overrides, words):
    with pytest.raises(ConfigError) as err:
        check_run_config(_config(overrides), device_type="cpu")
    assert "rl_config.truncated_sampling_logprobs" in str(err.value) and words in str(err.value)
