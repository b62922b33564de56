"""n-gram speculative decoding in the native engine: the drafts, and that speculation leaves the
sampled tokens (greedy and keyed sampling) and their distribution unchanged."""

from __future__ import annotations

import itertools

import pytest
import torch

from posttrain.errors import ConfigError
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.native import NativeEngine
from posttrain.rollout.ngram import propose

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 9], [12, 13, 12, 13], [14, 15, 16, 17, 14]]


def test_propose_prefers_siblings_and_longest_ngram():
    assert propose([1, 2, 3], [[9, 2, 3, 4, 5]], 3) == [4, 5]  # sibling, bigram (2, 3)
    assert propose([1, 2, 3], [[2, 3, 7], [1, 2, 3, 8]], 2) == [8]  # the longest match wins over source order
    assert propose([1, 2, 3], [[2, 3, 7], [0, 2, 3, 8]], 2) == [7]  # then the first sibling
    assert propose([4, 2, 3, 1, 2, 3], [], 2) == [1, 2]  # itself: the bigram (2, 3), its last earlier match
    assert propose([2, 3, 9, 2, 3], [[5, 3, 6]], 4) == [9, 2, 3]  # the bigram in itself beats a sibling's unigram
    assert propose([1, 2, 3], [[3]], 4) == []  # a match needs a token after it
    assert propose([7], [[7, 8, 9]], 0) == []


def counting(engine: NativeEngine) -> list[int]:
    """Record the tokens fed per row by each decode forward of ``engine`` (the prefill excluded)."""
    fed: list[int] = []
    forward = engine._forward

    def wrapped(ids, mask, positions, cache, keep=0):
        if keep:
            fed.append(ids.shape[1])
        return forward(ids, mask, positions, cache, keep)

    engine._forward = wrapped
    return fed


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=0, max_tokens=24),
    SamplingParams(temperature=1.0, top_k=-1, max_tokens=24, seed=3),
    SamplingParams(temperature=0.7, top_k=6, top_p=0.9, max_tokens=24, seed=4),
], ids=["greedy", "sampled", "top_k_top_p"])
def test_speculation_emits_the_same_tokens(model, sampling):
    stops = list(range(88, 96))  # rows end at different steps: compaction, and rows left alone to speculate
    plain = NativeEngine(model, pad_token_id=0, eos_token_ids=stops)
    spec = NativeEngine(model, pad_token_id=0, eos_token_ids=stops, speculative_tokens=4, speculative_budget=64)
    fed_plain, fed_spec = counting(plain), counting(spec)
    want = plain.generate(PROMPTS, 4, sampling)
    got = spec.generate(PROMPTS, 4, sampling)
    for a, b in zip(itertools.chain(*want), itertools.chain(*got)):
        assert a.token_ids == b.token_ids
        assert a.finish_reason == b.finish_reason
        assert torch.allclose(torch.tensor(a.logprobs),
                              torch.tensor(b.logprobs), atol=1e-5)
    assert max(fed_spec) > 1 and spec.pop_metrics()["rollout/draft_accept_rate"] > 0, "the test needs accepted drafts"
    assert plain.pop_metrics() == {}


def test_speculation_keeps_the_sampling_distribution():
    """The fourth token's frequencies over 3,000 speculative samples against its exact marginal,
    summed over the first three tokens from the model's own probabilities. A 6-token vocabulary, so
    that drafts looked up in the prompt are often accepted."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    vocab, prompt = 6, [1, 2, 3, 4, 5, 1, 2, 3]
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    prefixes = torch.tensor(list(itertools.product(range(vocab), repeat=3)))
    with torch.no_grad():
        logits = model(torch.cat([torch.tensor(prompt).expand(len(prefixes), -1), prefixes], 1)).logits
    probs = torch.softmax(logits[:, -4:].double(), -1)  # the next token after prompt, t1, t2 and t3
    path = probs[:, 0].gather(1, prefixes[:, :1]) * probs[:, 1].gather(1, prefixes[:, 1:2]) \
        * probs[:, 2].gather(1, prefixes[:, 2:3])  # p(t1, t2, t3)
    expected = (path * probs[:, 3]).sum(0)

    spec = NativeEngine(model, pad_token_id=0, eos_token_ids=[], speculative_tokens=3, speculative_budget=10 ** 6)
    fed = counting(spec)
    counts = torch.zeros(vocab, dtype=torch.float64)
    for seed in range(60):
        outs = spec.generate([prompt], 50, SamplingParams(temperature=1.0, top_k=-1, max_tokens=4, seed=seed))
        for out in outs[0]:
            counts[out.token_ids[3]] += 1
    metrics = spec.pop_metrics()
    accepted = metrics["rollout/draft_accept_rate"] * metrics["rollout/draft_tokens"]
    assert max(fed) > 1 and accepted > 500, "the test needs many accepted drafts"
    expected = expected * counts.sum()
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    dof = vocab - 1
    assert chi2 < dof + 5 * (2 * dof) ** 0.5, (chi2, counts, expected)  # mean dof, sd sqrt(2 dof): 5 sd


def test_speculation_needs_the_dynamic_cache(model):
    with pytest.raises(ConfigError, match="dynamic KV cache"):
        NativeEngine(model, pad_token_id=0, eos_token_ids=[], speculative_tokens=2, static_cache=True)
    with pytest.raises(ConfigError, match="speculative_tokens must be >= 0"):
        NativeEngine(model, pad_token_id=0, eos_token_ids=[], speculative_tokens=-1)


def test_the_config_key_reaches_the_engine(mini_qwen2_dir, tmp_path):
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from posttrain.config.plan import resolve_plan
    from posttrain.config.run import run_config_from_dict
    from posttrain.roles.policy import build_rollout

    cfg = run_config_from_dict({
        "megatron_training": {"stage": "ray_grpo", "global_batch_size": 2, "micro_batch_size": 4, "seq_length": 48,
                              "train_iters": 1, "tokenizer_name_or_path": str(mini_qwen2_dir)},
        "rl_config": {"n_samples_per_prompt": 2, "mini_batch_size": 2, "verifier_function": ["base_acc"],
                      "verifier_weight": [1.0], "device": "cpu", "output_dir": str(tmp_path / "run")},
        "generate_config": {"infer_tensor_parallel_size": 1, "max_model_len": 96, "num_speculative_tokens": 3,
                            "sampling_config": {"max_tokens": 4}}}, name="speculation")
    plan = resolve_plan(cfg, device="cpu")
    engine = build_rollout(plan.rollout, plan.policy, AutoModelForCausalLM.from_pretrained(mini_qwen2_dir),
                           SimpleNamespace(pad_token_id=0), [7])
    assert engine.speculative_tokens == 3 and not engine.static_cache
