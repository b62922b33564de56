"""Sampling semantics of the native engine on a stub model whose logits we control."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from posttrain.errors import ConfigError
from posttrain.rollout.base import ROLLOUT_ENGINES, RolloutOutput, SamplingParams
from posttrain.rollout.native import NativeEngine
from posttrain.algo.truncation import filter_candidates
from posttrain.rollout.scheduling import plan_waves, prefill_chunks

V = 8


class BigramStub(torch.nn.Module):
    """Next-token logits = ``table[last token]``; records the training flag it ran under."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = torch.nn.Parameter(table.clone())
        self.seen_training: list[bool] = []

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=True,
                logits_to_keep=0):
        self.seen_training.append(self.training)
        logits = self.table[input_ids]
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


def chain_table() -> torch.Tensor:
    """After token t the argmax is (t + 1) % V, with margin 3 over the rest."""
    table = torch.zeros(V, V)
    for t in range(V):
        table[t, (t + 1) % V] = 3.0
    return table


def fixed_dist_table(probs: list[float]) -> torch.Tensor:
    """Every row has the same next-token distribution ``probs``."""
    return torch.log(torch.tensor(probs)).repeat(V, 1)


def engine(table, **kw) -> NativeEngine:
    return NativeEngine(BigramStub(table), pad_token_id=0, eos_token_ids=kw.pop("eos", []), **kw)


def sampled_ids(outs: list[list[RolloutOutput]]) -> set[int]:
    return {t for group in outs for o in group for t in o.token_ids}


def test_sampling_params_defaults_are_the_seed():
    sp = SamplingParams()
    assert (sp.logprobs, sp.max_tokens, sp.top_p, sp.top_k, sp.min_p, sp.temperature, sp.seed, sp.detokenize) == \
        (1, 128, 1.0, 50, 0.0, 0.2, None, False)
    assert SamplingParams.from_config({"temperature": 1.0, "top_k": -1}).top_k == -1


def test_sampling_params_errors_name_the_key():
    with pytest.raises(ConfigError, match="unknown key.*'topk'"):
        SamplingParams.from_config({"topk": 3})
    with pytest.raises(ConfigError, match="sampling_config.top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ConfigError, match="Unknown rollout engine 'sglang'; known: native, vllm. Check rl_config"):
        ROLLOUT_ENGINES.get("sglang")


def test_stop_token_ends_sample_and_logprobs_are_exact():
    outs = engine(chain_table(), eos=[5]).generate([[1]], 1, SamplingParams(temperature=0, max_tokens=10))
    out = outs[0][0]
    assert out.token_ids == [2, 3, 4, 5] and out.finish_reason == "stop"
    expected = 3.0 - math.log(math.exp(3.0) + V - 1)  # log_softmax of the chain row at its argmax
    assert out.logprobs == pytest.approx([expected] * 4, abs=1e-6)


def test_stop_token_ids_argument_and_max_tokens():
    eng = engine(chain_table())
    stopped = eng.generate([[1]], 2, SamplingParams(temperature=0, max_tokens=10), stop_token_ids=[4])
    assert [o.token_ids for o in stopped[0]] == [[2, 3, 4]] * 2
    capped = eng.generate([[1], [6]], 1, SamplingParams(temperature=0, max_tokens=3))
    assert [capped[0][0].token_ids, capped[1][0].token_ids] == [[2, 3, 4], [7, 0, 1]]
    assert capped[0][0].finish_reason == "length"


def test_temperature_scales_the_reported_logprob():
    probs = [0.4, 0.3, 0.2, 0.1, 0, 0, 0, 0]
    table = fixed_dist_table([p if p else 1e-9 for p in probs])
    out = engine(table).generate([[1]], 1, SamplingParams(temperature=0.5, top_k=-1, max_tokens=6, seed=0))[0][0]
    ref = torch.log_softmax(table[0] / 0.5, -1)
    assert out.logprobs == pytest.approx([ref[t].item() for t in out.token_ids], abs=1e-5)


@pytest.mark.parametrize("kw, allowed", [
    ({"top_k": 2}, {0, 1}),
    ({"top_p": 0.7}, {0, 1}),            # mass before token 1 is 0.5 < 0.7, before token 2 is 0.8
    ({"min_p": 0.2}, {0, 1, 2}),         # cutoff 0.2 * 0.5 = 0.1 drops token 3 (0.05)
    # top-p acts on the top-k renormalised probabilities 0.526, 0.316, 0.158: the mass before token 2
    # is 0.842 >= 0.83, so it is dropped (on the raw probabilities it would be 0.8 and kept)
    ({"top_k": 3, "top_p": 0.83}, {0, 1}),
])
def test_truncation_keeps_exactly_the_allowed_tokens(kw, allowed):
    table = fixed_dist_table([0.5, 0.3, 0.15, 0.05, 1e-9, 1e-9, 1e-9, 1e-9])
    sp = SamplingParams(temperature=1.0, max_tokens=50, seed=0, **{"top_k": -1, **kw})
    outs = engine(table).generate([[1]], 8, sp)
    assert sampled_ids(outs) == allowed


def test_filter_candidates_numbers():
    cand = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(filter_candidates(cand, top_p=0.8, min_p=0.0))[0].tolist()
    assert kept == [True, True, False, False]  # mass before token 2 is exactly 0.8 -> dropped
    kept = torch.isfinite(filter_candidates(cand, top_p=1.0, min_p=0.35))[0].tolist()
    assert kept == [True, True, False, False]  # cutoff 0.175


def test_greedy_is_argmax_even_with_sampling_knobs():
    table = torch.randn(V, V, generator=torch.Generator().manual_seed(0))
    outs = engine(table).generate([[3]], 4, SamplingParams(temperature=0, top_k=2, max_tokens=5, seed=1))
    expected, tok = [], 3
    for _ in range(5):
        tok = int(table[tok].argmax())
        expected.append(tok)
    assert all(o.token_ids == expected for o in outs[0])


def test_seed_determinism_and_seed_sensitivity():
    table = torch.zeros(V, V)  # uniform: every draw is pure generator randomness
    eng = engine(table)
    sp = SamplingParams(temperature=1.0, top_k=-1, max_tokens=12, seed=7)
    a = eng.generate([[1], [2, 3]], 3, sp)
    b = eng.generate([[1], [2, 3]], 3, sp)
    c = eng.generate([[1], [2, 3]], 3, SamplingParams(temperature=1.0, top_k=-1, max_tokens=12, seed=8))
    ids = lambda outs: [o.token_ids for g in outs for o in g]  # noqa: E731
    assert ids(a) == ids(b) and ids(a) != ids(c)


def test_training_mode_is_restored_and_eval_used_during_generation():
    eng = engine(chain_table())
    eng.model.train()
    eng.generate([[1]], 1, SamplingParams(temperature=0, max_tokens=3))
    assert eng.model.training and not any(eng.model.seen_training)


def test_plan_waves_respects_max_num_seqs():
    waves = plan_waves([5, 1, 3], n=4, max_num_seqs=8)
    assert waves == [[(1, 4), (2, 4)], [(0, 4)]]  # sorted by length, groups kept whole
    assert plan_waves([2], n=5, max_num_seqs=2) == [[(0, 2)], [(0, 2)], [(0, 1)]]
    assert [list(r) for r in prefill_chunks(5, 10, 25)] == [[0, 1], [2, 3], [4]]


def random_table() -> torch.Tensor:
    return torch.randn(V, V, generator=torch.Generator().manual_seed(3)) * 1.5


def by_prompt(outs):
    return [[o.token_ids for o in group] for group in outs]


KEYED_PROMPTS = [[1], [2, 3], [4], [5, 6, 7], [0], [3, 3]]


def test_keyed_samples_do_not_depend_on_the_split_or_the_waves():
    """Same (seed, keys): the same tokens in one call, in two calls split anywhere, and with any
    wave size (max_num_seqs below n splits a prompt's samples over waves) or compaction."""
    sp = SamplingParams(temperature=1.0, top_k=-1, max_tokens=10, seed=21)
    eos = [7]  # rows finish at different steps, so compaction drops rows mid-decode
    whole = by_prompt(engine(random_table(), eos=eos).generate(KEYED_PROMPTS, 4, sp))
    assert len({len(t) for g in whole for t in g}) > 1 and len({tuple(t) for g in whole for t in g}) > 12
    for cut in range(1, len(KEYED_PROMPTS)):
        eng = engine(random_table(), eos=eos)
        head = eng.generate(KEYED_PROMPTS[:cut], 4, sp, prompt_keys=list(range(cut)))
        tail = eng.generate(KEYED_PROMPTS[cut:], 4, sp, prompt_keys=list(range(cut, len(KEYED_PROMPTS))))
        assert by_prompt(head) + by_prompt(tail) == whole, cut
    for max_num_seqs in (1, 3, 5, 8):
        for compact in (0.01, 1.0):
            eng = engine(random_table(), eos=eos, max_num_seqs=max_num_seqs, compact_fraction=compact)
            assert by_prompt(eng.generate(KEYED_PROMPTS, 4, sp)) == whole, (max_num_seqs, compact)
    # the keys, not the positions in the call, name the streams: reversed prompts with their keys
    order = list(reversed(range(len(KEYED_PROMPTS))))
    reordered = engine(random_table(), eos=eos).generate([KEYED_PROMPTS[i] for i in order], 4, sp, prompt_keys=order)
    assert list(reversed(by_prompt(reordered))) == whole
    # a prompt with another key draws other samples
    other = engine(random_table(), eos=eos).generate(KEYED_PROMPTS[:1], 4, sp, prompt_keys=[99])
    assert by_prompt(other)[0] != whole[0]


def test_a_continued_sample_draws_the_rest_of_its_stream():
    """Sample j of a prompt, cut after k tokens and continued (prompt + those k tokens, sample
    offset j, position offset k), ends exactly as the uninterrupted sample."""
    sp = SamplingParams(temperature=1.0, top_k=-1, max_tokens=12, seed=5)
    eng = engine(random_table())
    full = eng.generate([[2]], 3, sp, prompt_keys=[40])[0]
    k = 5
    for j, sample in enumerate(full):
        head = sample.token_ids[:k]
        rest = eng.generate([[2] + head], 1, replace_max(sp, 12 - k), prompt_keys=[40], sample_offsets=[j],
                            position_offsets=[k])[0][0]
        assert head + rest.token_ids == sample.token_ids
        assert sample.logprobs[k:] == pytest.approx(rest.logprobs, abs=1e-6)


def replace_max(sp: SamplingParams, max_tokens: int) -> SamplingParams:
    from dataclasses import replace

    return replace(sp, max_tokens=max_tokens)


def test_unseeded_sampling_draws_its_seed_from_torch():
    sp = SamplingParams(temperature=1.0, top_k=-1, max_tokens=12, seed=None)
    eng = engine(torch.zeros(V, V))
    torch.manual_seed(0)
    a = by_prompt(eng.generate([[1], [2]], 2, sp))
    b = by_prompt(eng.generate([[1], [2]], 2, sp))
    torch.manual_seed(0)
    assert a != b and by_prompt(eng.generate([[1], [2]], 2, sp)) == a


def test_key_lists_must_have_one_entry_per_prompt():
    with pytest.raises(ConfigError, match="prompt_keys has 1 entries for 2 prompts"):
        engine(chain_table()).generate([[1], [2]], 1, SamplingParams(seed=0), prompt_keys=[0])
    with pytest.raises(ConfigError, match="position_offsets has 3 entries for 2 prompts"):
        engine(chain_table()).generate([[1], [2]], 1, SamplingParams(seed=0), position_offsets=[0, 0, 0])
