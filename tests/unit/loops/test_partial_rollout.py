"""Partial rollout's dock and rounds on the tiny model with the native engine: a sample continued
over rounds is the sample generated whole, N = 1 is plain rollout, the oldest groups finish first
and no group outlives N - 1 iterations, and the dock's state round-trips."""

from __future__ import annotations

import pytest
import torch

from posttrain.rollout.base import SamplingParams
from posttrain.loops.partial_rollout import PartialRollout

N_SAMPLES, GBS, MAX_TOKENS = 2, 2, 12


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from posttrain.rollout.native import NativeEngine

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    stops = list(range(1, model.config.vocab_size, 8))  # one token in 8 ends a sample: lengths vary
    return NativeEngine(model, pad_token_id=0, eos_token_ids=stops)


PROMPTS = [[11, 12, 13], [14, 15], [16, 17, 18, 19], [20, 21], [22, 23, 24], [25]]
SAMPLING = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_k=-1, seed=7)


def pool(split: int, require: bool = True) -> PartialRollout:
    return PartialRollout(n=N_SAMPLES, global_batch_size=GBS, max_split=split, max_tokens=MAX_TOKENS,
                          max_model_len=None, require_max_age_all_finished=require)


def feed(p: PartialRollout, batches: list) -> None:
    while len(p.free_groups()) >= GBS:
        prompts = batches.pop(0)
        p.add_prompts(prompts, [torch.tensor([0])] * len(prompts))


def whole(engine, prompts, keys):
    return engine.generate(prompts, N_SAMPLES, SAMPLING, [], prompt_keys=keys)


def test_split_one_is_plain_rollout(engine):
    p = pool(1)
    feed(p, [PROMPTS[0:2], PROMPTS[2:4]])
    p.fill(engine, SAMPLING, [], version=0)
    batch, metrics = p.take()
    want = whole(engine, PROMPTS[0:2], [0, 1])
    assert [r.tolist() for r in batch["responses"]] == [o.token_ids for group in want for o in group]
    got_lp = torch.cat(batch["rollout_logprobs"])
    assert torch.allclose(got_lp, torch.tensor([x for g in want for o in g for x in o.logprobs]), atol=1e-5)
    assert metrics["rollout/rounds"] == 1 and metrics["rollout/age_max"] == 0


def test_a_sample_continued_over_rounds_is_the_sample_generated_whole(engine):
    p = pool(4)
    feed(p, [PROMPTS[0:2], PROMPTS[2:4]])
    rounds = 0
    while len(p._complete()) < 2 * GBS:  # every group of the dock to completion, the weights unchanged
        p.round(engine, SAMPLING, [], version=0)
        rounds += 1
    assert rounds > 1  # some samples did span rounds
    want = whole(engine, PROMPTS[0:4], [0, 1, 2, 3])
    got = [p.dock.cell("responses", r).tolist() for r in range(2 * GBS * N_SAMPLES)]
    assert got == [o.token_ids for group in want for o in group]
    lengths = {len(t) for t in got}
    assert len(lengths) > 1 and max(lengths) <= MAX_TOKENS


def test_the_oldest_groups_go_first_and_none_outlives_the_split(engine):
    p, batches = pool(4), [PROMPTS[i:i + 2] * 1 for i in range(0, 6, 2)] * 4
    seen_ages, carried, spanned = [], 0, 0
    for iteration in range(1, 7):
        feed(p, batches)
        p.fill(engine, SamplingParams(**{**SAMPLING.__dict__, "seed": iteration}), [], version=iteration - 1)
        batch, metrics = p.take()
        assert len(batch["responses"]) == GBS * N_SAMPLES
        assert all(0 < r.numel() <= MAX_TOKENS for r in batch["responses"])
        seen_ages.append(metrics["rollout/age_max"])
        assert all(age <= 3 for age in p._ages().values())  # the next iteration finishes any group at age N - 1
        spanned += sum(int(v) < iteration - 1 for v in batch["policy_version"])  # begun in an earlier iteration
        carried += sum(1 for r in range(p.dock.max_len) if p.dock.cell("responses", r) is not None
                       and p.dock.cell("responses", r).numel() and not int(p.dock.cell("finished", r)))
    assert max(seen_ages) >= 1  # groups did wait
    assert carried > 0 and spanned > 0  # unfinished samples were kept, and trained on in a later iteration


def test_the_dock_state_round_trips(engine):
    p = pool(4)
    feed(p, [PROMPTS[0:2], PROMPTS[2:4]])
    p.round(engine, SAMPLING, [], version=3)
    q = pool(4)
    q.load_state_dict(p.state_dict())
    for r in range(2 * GBS * N_SAMPLES):
        assert torch.equal(q.dock.cell("responses", r), p.dock.cell("responses", r))
        assert int(q.dock.cell("policy_version", r)) == 3
    assert q._complete() == p._complete() and q.free_groups() == p.free_groups() == []


class RoundsOnly:
    """The same engine without the one-decode path: partial rollout falls back to its rounds."""

    def __init__(self, engine):
        self.engine, self.max_num_seqs = engine, engine.max_num_seqs

    def generate(self, *args, **kwargs):
        return self.engine.generate(*args, **kwargs)


def test_one_decode_with_round_checks_samples_what_the_rounds_sample(engine):
    got, sampling = {}, SamplingParams(**{**SAMPLING.__dict__, "max_tokens": 40, "seed": 3})
    for name, eng in (("decode", engine), ("rounds", RoundsOnly(engine))):
        p = PartialRollout(n=N_SAMPLES, global_batch_size=GBS, max_split=8, max_tokens=40, max_model_len=None)
        feed(p, [PROMPTS[0:2], PROMPTS[2:4]])
        p.fill(eng, sampling, [], version=0)
        got[name] = ([p.dock.cell("responses", r).tolist() for r in range(p.dock.max_len)],
                     [int(p.dock.cell("finished", r)) for r in range(p.dock.max_len)], p.rounds)
    assert got["decode"] == got["rounds"]
    assert 0 < sum(got["rounds"][1]) < len(got["rounds"][1])  # the update was ready before every sample ended
