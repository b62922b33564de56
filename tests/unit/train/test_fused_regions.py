"""The compiled RMSNorm / SiLU-mul / rotary / LM-head log-prob regions equal the eager path within 1e-5
in fp32 (forward, backward, one AdamW step), together and each alone, on a tiny Llama through
posttrain's packed forward, and leaving the block restores the eager forwards."""

import copy
import threading

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from posttrain.training.batch import build_batch
from posttrain.training.engine import TrainEngine
from posttrain.training.forward import response_logprobs
from posttrain.training import compiled_logprob
from posttrain.training.fused_regions import REGIONS, fused_regions, regions
from posttrain.training.options import EngineOptions
from posttrain.training.remove_padding import Packing

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, attn_implementation="sdpa")


def _batch(resp_lens, seed=1):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (3, 5, 2, 4)]
    resps = [torch.randint(1, 64, (n,), generator=g).tolist() for n in resp_lens]
    return build_batch(prompts, resps, pad_token_id=0)


def _step(model, batch, optimizer):
    """Log-probs and entropies, the gradients of a loss on the log-probs, and the weights after one AdamW step
    (at the actor loss's temperature and entropy settings of the engine tests: the compiled graphs are shared)."""
    lp, ent = response_logprobs(model, batch, temperature=0.7, with_entropy=True, entropy_grad=False,
                                packing=Packing(share_prompts=True))
    (lp * torch.linspace(-1, 1, lp.numel()).reshape(lp.shape)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return torch.stack([lp.detach(), ent]), grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _loss_fn():
    from posttrain.training.options import ActorLossOptions
    from posttrain.training.loss_fns import make_actor_loss_fn

    return make_actor_loss_fn(ActorLossOptions(temperature=0.7))


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    eager = LlamaForCausalLM(LlamaConfig(**SMALL)).train()
    return eager, copy.deepcopy(eager)


def _assert_close(got, want):
    assert torch.allclose(got[0], want[0], atol=1e-5, rtol=0)
    for name in want[1]:
        assert torch.allclose(got[1][name], want[1][name], atol=1e-5, rtol=1e-5), name
        assert torch.allclose(got[2][name], want[2][name], atol=1e-5, rtol=0), name


def test_compiled_regions_equal_eager_forward_backward_and_step(models):
    eager, fused = models
    assert [len(m) for m in regions(fused).values()] == [5, 2, 2]  # 2 x 2 layer norms + the final one; 2 MLPs
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2, fused=True)
    opt_f = torch.optim.AdamW(fused.parameters(), lr=1e-2, fused=True)
    for resp_lens in ((4, 1, 6, 3), (2, 7, 5, 1)):  # two packed lengths (the regions compile with dynamic shapes)
        batch = _batch(resp_lens)
        want = _step(eager, batch, opt_e)
        with fused_regions(fused) as swapped:
            assert swapped == 10  # 5 norms, 2 MLPs, 2 attentions' rotary, the LM head's log-probs
            assert compiled_logprob.active()
            got = _step(fused, batch, opt_f)
        _assert_close(got, want)


@pytest.mark.parametrize("name", REGIONS)
def test_each_region_alone_equals_eager(models, name, monkeypatch):
    """One region at a time (compiled already by the test above: milliseconds each), and it is the one used."""
    from posttrain.training import fused_regions as module

    calls, compiled, head = [], module.compiled, compiled_logprob.compiled_logprobs_and_entropy
    monkeypatch.setattr(module, "compiled", lambda region: calls.append(region) or compiled(region))
    monkeypatch.setattr(compiled_logprob, "compiled_logprobs_and_entropy", lambda: calls.append("logprob") or head())
    batch = _batch((3, 5, 2, 6), seed=4)
    steps = []
    for on in (False, True):
        model = copy.deepcopy(models[0])
        with fused_regions(model, enabled=on, names=(name,)) as swapped:
            assert (swapped > 0) is on
            steps.append(_step(model, batch, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)))
    assert set(calls) == {name}
    _assert_close(steps[1], steps[0])


def _rotary_compiles(apply_rotary_pos_emb) -> bool:
    """Whether a call of ``apply_rotary_pos_emb`` in this thread goes through the compiled region."""
    from posttrain.training import fused_regions as module

    calls, compiled = [], module.compiled
    module.compiled = lambda name: calls.append(name) or module.rotary  # counted, not compiled
    try:
        q, cos = torch.randn(1, 2, 3, 4), torch.randn(1, 3, 4)
        apply_rotary_pos_emb(q, q, cos, cos)
    finally:
        module.compiled = compiled
    return calls == ["rotary"]


def test_leaving_the_block_restores_eager(models):
    _, model = models
    from transformers.models.llama import modeling_llama

    norms, mlps, _ = regions(model).values()
    eager_rotary = modeling_llama.apply_rotary_pos_emb
    with fused_regions(model):
        assert "forward" in norms[0].__dict__ and "forward" in mlps[0].__dict__
        assert modeling_llama.apply_rotary_pos_emb is not eager_rotary and compiled_logprob.active()
        seen = []  # another thread (an asynchronous rollout's) keeps the eager rotary and log-probs
        worker = threading.Thread(target=lambda: seen.append((compiled_logprob.active(), _rotary_compiles(
            modeling_llama.apply_rotary_pos_emb))))
        worker.start()
        worker.join()
        assert seen == [(False, False)] and _rotary_compiles(modeling_llama.apply_rotary_pos_emb)
        with fused_regions(model) as inner:  # nested: nothing swapped twice, the outer block restores
            assert inner == 0
        assert "forward" in norms[0].__dict__
        assert modeling_llama.apply_rotary_pos_emb is not eager_rotary and compiled_logprob.active()
    assert all("forward" not in m.__dict__ for m in norms + mlps)
    assert modeling_llama.apply_rotary_pos_emb is eager_rotary and not compiled_logprob.active()
    assert type(norms[0]).forward is norms[0].forward.__func__  # the class's eager forward again
    with fused_regions(model, enabled=False) as swapped:
        assert swapped == 0 and "forward" not in norms[0].__dict__
        assert modeling_llama.apply_rotary_pos_emb is eager_rotary and not compiled_logprob.active()
    with pytest.raises(ValueError, match="unknown compiled regions"):
        with fused_regions(model, names=("rope",)):
            pass


def test_the_engine_updates_through_the_regions_only_when_asked(models, monkeypatch):
    from posttrain.training import fused_regions as module

    calls, compiled = [], module.compiled
    monkeypatch.setattr(module, "compiled", lambda name: calls.append(name) or compiled(name))
    batch = _batch((4, 1, 6, 3))
    batch["advantages"] = torch.randn(batch["response_mask"].shape, generator=torch.Generator().manual_seed(3))
    weights = []
    for asked in (False, True):
        model = copy.deepcopy(models[0])
        engine = TrainEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=4,
                             options=EngineOptions(use_remove_padding=True, compile_regions=asked))
        before = len(calls)
        engine.compute_logprobs(batch)  # the log-prob passes stay eager
        assert len(calls) == before
        engine.update(batch, _loss_fn(), mini_batch_size=4)
        assert (len(calls) > before) is asked
        assert all("forward" not in m.__dict__ for m in model.modules())  # restored after the update
        weights.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    assert not torch.equal(weights[0], torch.cat([p.detach().reshape(-1) for p in models[0].parameters()]))
    assert torch.allclose(weights[0], weights[1], atol=1e-5, rtol=0)



def test_auto_compiles_only_what_can_pay_back_and_uses_what_wins(models, monkeypatch, tmp_path):
    """compile_regions auto: a region whose eager time over the run's updates is below the compile's estimate
    is not compiled (its compiled function is never called); otherwise its first compiled call is timed and
    recorded for the next process, and it is used where it wins by the margin."""
    from posttrain.training import compile_auto

    monkeypatch.setattr(compile_auto, "_record_path", lambda: tmp_path / compile_auto.RECORD)
    model = models[0]
    probes = compile_auto.probes(model, tokens=40, response_tokens=24)
    assert set(probes) == set(REGIONS)
    assert probes["rms_norm"][3] == 5 and probes["rotary"][3] == 2  # calls per update: modules x tokens / probe
    calls = []
    for region, (eager, fused, args, per_update) in probes.items():
        # the "compiled" call: the eager function, counted (the decision's logic, without a compile here)
        counted = (lambda f: lambda *a: calls.append(region) or f(*a))(eager)
        short = compile_auto.choose(region, (eager, counted, args, per_update), updates_left=1)
        assert not short.on and short.compiled_s is None and calls == []  # milliseconds < seconds of compile
        assert short.compile_s == compile_auto.COLD_COMPILE_S[region] and "less than the compile" in short.reason
        long = compile_auto.choose(region, (eager, counted, args, per_update), updates_left=10**9)
        assert calls and long.compiled_s is not None and long.compile_s >= 0
        assert long.on == (long.compiled_s < (1 - compile_auto.MARGIN) * long.eager_s)
        assert compile_auto._recorded()[region] == round(long.compile_s, 2)  # the next process's estimate
        calls.clear()


def test_the_engine_with_auto_records_its_choices_and_updates_through_them(models):
    from posttrain.training.compile_auto import Choice

    batch = _batch((4, 1, 6, 3))
    batch["advantages"] = torch.randn(batch["response_mask"].shape, generator=torch.Generator().manual_seed(3))
    model = copy.deepcopy(models[0])
    engine = TrainEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=4,
                         options=EngineOptions(use_remove_padding=True, compile_regions="auto", compile_updates=1))
    engine.update(batch, _loss_fn(), mini_batch_size=4)
    assert set(engine.region_choices) == set(REGIONS) and not any(c.on for c in engine.region_choices.values())
    with engine.compiled_regions() as swapped:
        assert swapped == 0  # nothing chosen: the eager path
    engine.region_choices = {"rotary": Choice(True, 1.0, 0.5, 0.1, "test"), "rms_norm": Choice(False, 1, None, 9, "")}
    with engine.compiled_regions() as swapped:
        assert swapped == 2 and not compiled_logprob.active()  # the 2 attentions' rotary only


def test_the_config_takes_true_false_or_auto_and_names_the_key_otherwise():
    from posttrain.config.run import run_config_from_dict
    from posttrain.errors import ConfigError

    base = {"rl_config": {}}
    assert run_config_from_dict(base, overrides=["rl_config.compile_regions=auto"]).rl.compile_regions == "auto"
    assert run_config_from_dict(base, overrides=["rl_config.compile_regions=true"]).rl.compile_regions is True
    with pytest.raises(ConfigError, match="rl_config.compile_regions"):
        run_config_from_dict(base, overrides=["rl_config.compile_regions=fast"])


def test_checkpointed_head_chunks_stay_eager_in_the_block(monkeypatch):
    """Above RECOMPUTE_ABOVE the head's chunks are checkpointed; their recomputation (without the entropy) would
    select another compiled graph than the forward's, so the region leaves them eager: same values, no call."""
    from posttrain.training import lm_head

    monkeypatch.setattr(lm_head, "RECOMPUTE_ABOVE", 0)
    monkeypatch.setattr(compiled_logprob, "compiled_logprobs_and_entropy", lambda: pytest.fail("compiled"))
    head, h = torch.nn.Linear(8, 20, bias=False), torch.randn(6, 8, requires_grad=True)
    with compiled_logprob.logprob_region():
        lp, ent = lm_head.head_logprobs(head, h, torch.randint(0, 20, (6,)), 0.7, with_entropy=True,
                                        entropy_grad=False, chunk_tokens=4)
        lp.sum().backward()
    assert h.grad is not None and ent.shape == lp.shape
