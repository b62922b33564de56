"""The rollout on prepacked oneDNN weights (posttrain.models.packed_linear) against the plain path."""

from __future__ import annotations

import copy

import pytest
import torch

from posttrain.errors import ConfigError
from posttrain.models import packed_linear
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.native import NativeEngine

pytestmark = pytest.mark.skipif(not packed_linear.available(), reason="torch without oneDNN weight packing")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
STOPS = list(range(80, 96))  # rows end at different steps: the packed product sees 12 rows down to 1


def rows(outs):
    return [(o.token_ids, o.logprobs, o.finish_reason) for group in outs for o in group]


def assert_same(got, want):
    assert [t for t, _, _ in got] == [t for t, _, _ in want]
    assert [f for _, _, f in got] == [f for _, _, f in want]
    for (_, a, _), (_, b, _) in zip(got, want):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)


def test_packed_product_equals_the_plain_one():
    torch.manual_seed(0)
    weight, bias = torch.randn(48, 32), torch.randn(48)
    packed = packed_linear.pack(weight)
    for shape in [(64, 32), (5, 32), (1, 32), (3, 2, 32)]:
        x = torch.randn(*shape)
        with torch.inference_mode():
            got = packed_linear.packed_linear(x, packed, bias)
        assert got.shape == (*shape[:-1], 48)
        assert torch.allclose(got, torch.nn.functional.linear(x, weight, bias), rtol=0, atol=1e-5)


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0, max_tokens=12),
                                      SamplingParams(temperature=0.8, top_k=-1, max_tokens=16, seed=3)],
                         ids=["greedy", "sampled"])
def test_packed_rollout_equals_the_plain_rollout(model, sampling):
    plain = NativeEngine(model, pad_token_id=0, eos_token_ids=STOPS, compact_fraction=0.01, packed_weights=False)
    packed = NativeEngine(model, pad_token_id=0, eos_token_ids=STOPS, compact_fraction=0.01, packed_weights=True)
    want = rows(plain.generate(PROMPTS, 4, sampling))
    got = rows(packed.generate(PROMPTS, 4, sampling))
    assert len({len(t) for t, _, _ in want}) > 1, "test needs rows that finish at different steps"
    assert packed._packs.packs and not plain._packs.packs
    assert_same(got, want)
    # turned off (or after the call), every layer has its own forward back: the plain path
    assert not any("forward" in vars(m) for m in model.modules())
    packed.packed_weights = False
    assert_same(rows(packed.generate(PROMPTS, 4, sampling)), want)


def test_packed_bf16_sampling_copy_equals_the_plain_one(model):
    """A bf16 rollout packs its bf16 sampling copy (not the fp32 actor): same tokens and log-probs."""
    sampling = SamplingParams(temperature=0.8, top_k=-1, max_tokens=12, seed=5)
    kw = dict(pad_token_id=0, eos_token_ids=STOPS, compact_fraction=0.01, dtype="bfloat16")
    plain, packed = NativeEngine(model, packed_weights=False, **kw), NativeEngine(model, packed_weights=True, **kw)
    want, got = rows(plain.generate(PROMPTS, 3, sampling)), rows(packed.generate(PROMPTS, 3, sampling))
    assert {w.dtype for w in packed._packs.packs.values()} == {torch.bfloat16}
    assert all(m in dict(packed._copy.named_modules()).values() for m in packed._packs.packs)
    assert_same(got, want)


def test_packs_follow_the_optimizer_step(model):
    """After an optimizer step the engine repacks: it samples from the new weights, as the plain
    engine on the same actor does."""
    actor = copy.deepcopy(model)
    packed = NativeEngine(actor, pad_token_id=0, eos_token_ids=[], packed_weights=True)
    plain = NativeEngine(actor, pad_token_id=0, eos_token_ids=[], packed_weights=False)
    greedy = SamplingParams(temperature=0, max_tokens=6)
    before = packed.generate(PROMPTS[:1], 1, greedy)[0][0]
    actor.train()
    opt = torch.optim.SGD(actor.parameters(), lr=5.0)
    torch.log_softmax(actor(torch.tensor([PROMPTS[0]])).logits[0, -1], -1)[before.token_ids[0]].backward()
    opt.step()
    after = rows(packed.generate(PROMPTS[:1], 1, greedy))
    assert after[0][0] != before.token_ids
    assert_same(after, rows(plain.generate(PROMPTS[:1], 1, greedy)))
    assert actor.training


def test_resolve_packed_is_pinned_by_the_environment(monkeypatch):
    """Outside a run (no run's choice installed: it would rule, see below)."""
    monkeypatch.setattr(packed_linear, "_run_choice", None)  # whatever an earlier test's session left
    monkeypatch.setenv(packed_linear.ENV, "on")
    assert packed_linear.resolve_packed("cpu") is True
    assert packed_linear.resolve_packed("cuda:0") is False  # CPU weights only
    monkeypatch.setenv(packed_linear.ENV, "off")
    assert packed_linear.resolve_packed("cpu") is False
    assert NativeEngine(torch.nn.Linear(2, 2), pad_token_id=0, eos_token_ids=[]).packed_weights is False
    monkeypatch.setenv(packed_linear.ENV, "yes")
    with pytest.raises(ConfigError, match=r"POSTTRAIN_ROLLOUT_PACKED='yes': use one of on, off"):
        packed_linear.resolve_packed("cpu")


def test_run_json_records_what_the_native_rollout_does(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setenv(packed_linear.ENV, "on")
    plan = SimpleNamespace(rollout=SimpleNamespace(engine="native"), rollout_dtype="float32", device="cpu")

    def choice(stored=None, **changes):
        return packed_linear.rollout_packed_weights(SimpleNamespace(**{**vars(plan), **changes}), "blas", stored)

    assert choice() is True and choice(rollout_dtype="bfloat16") is True
    assert choice(rollout_dtype="float16") is False and choice(device="cuda:0") is False
    assert choice(rollout=None) is False  # SFT, DPO
    assert choice(rollout=SimpleNamespace(engine="vllm")) is False
    assert choice(stored=False) is True  # the environment pins it over the checkpoint's choice
    with packed_linear.use_rollout_packed(False):  # an earlier run's choice, installed in this process
        assert choice() is True
    monkeypatch.delenv(packed_linear.ENV)
    assert choice(stored=False) is False and choice(stored=True) is True  # a resumed run keeps its choice
    with packed_linear.use_rollout_packed(True):
        assert choice(stored=False) is False
    assert choice(stored=True, device="cuda:0") is False


def test_the_runs_choice_rules_every_engine_of_the_process_and_of_its_workers(monkeypatch):
    """Session installs the run's choice (and Ray workers the driver's: install_run_kernels), so no
    engine of the run times the products for itself (packed and plain round differently), nor follows
    its own process's environment (a worker's may differ from the driver's, whose choice read it)."""
    monkeypatch.delenv(packed_linear.ENV, raising=False)
    monkeypatch.setattr(packed_linear, "_run_choice", None)  # whatever an earlier test's session left
    monkeypatch.setattr(packed_linear, "speedup", lambda *a: pytest.fail("timed despite the run's choice"))
    for choice in (True, False):
        with packed_linear.use_rollout_packed(choice):
            assert packed_linear.resolve_packed("cpu") is choice
            assert packed_linear.resolve_packed("cpu", "float16") is False
            assert NativeEngine(torch.nn.Linear(2, 2), pad_token_id=0, eos_token_ids=[]).packed_weights is choice
    assert packed_linear._run_choice is None  # restored
    monkeypatch.setenv(packed_linear.ENV, "off")
    assert packed_linear.resolve_packed("cpu") is False  # no run's choice: the environment pins it
    packed_linear.install_run_kernels({"cpu_linear": "blas", "rollout_packed": True})
    assert packed_linear.resolve_packed("cpu") is True
