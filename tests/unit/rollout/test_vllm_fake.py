"""The vLLM adapter (posttrain.rollout.vllm_engine) against a fake ``vllm`` module, on the CPU.

The fake ``vllm.LLM`` records every call posttrain makes (constructor arguments, sleep and wake,
each ``load_weights`` call with the tensors it carried, each ``generate`` with its sampling
parameters) and enforces vLLM's state rules: no generation while anything is asleep, no weight load
while the weights are asleep, no doubled sleep or wake. Its model is a real tiny Qwen2 built from
the config the adapter writes, with random ("dummy") weights until the adapter loads the actor's;
``generate`` samples from whatever weights were loaded (argmax at temperature 0, else a draw seeded
by the request's seed), so a missing or stale weight sync shows in the rollouts.

What this does not check: vLLM itself (its argument names and defaults in a given version, its
kernels, its memory behaviour, whether ``load_weights`` accepts every name). docs/rollout.md.
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from posttrain.reward.verifiers import register_verifier
from posttrain.rollout.base import SamplingParams
from tests.helpers.runs import read_metrics

ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


@register_verifier("test_vllm_digit_share", overwrite=True)
def digit_share(response: str, label: str, **_) -> float:
    """A dense reward that random models already vary on: the share of digits."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


# ---- the fake vllm module --------------------------------------------------------------------
class FakeSamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class FakeVllmModel:
    """vLLM's model object as the adapter reaches it: ``load_weights(weights=[(hf_name, tensor), ...])``."""

    def __init__(self, llm, hf_model):
        self.llm, self.params = llm, hf_model.state_dict(keep_vars=True)

    def load_weights(self, weights):
        weights = list(weights)
        assert "weights" not in self.llm.asleep, "load_weights while the weights are asleep"
        self.llm.load_calls.append(len(weights))
        with torch.no_grad():
            for name, tensor in weights:
                self.llm.events.append(("load", name))
                self.llm.loaded.append((name, tensor.detach().clone()))
                self.params[name].copy_(tensor)
        return {name for name, _ in weights}


class FakeLLM:
    built: list = []

    def __init__(self, **kwargs):
        from transformers import AutoConfig, AutoModelForCausalLM

        self.kwargs, self.events, self.loaded, self.load_calls, self.params = kwargs, [], [], [], []
        self.generated_weights: list[dict[str, torch.Tensor]] = []
        self.asleep: set[str] = set()
        torch.manual_seed(12345)  # load_format="dummy": random weights, not the actor's
        self.hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(kwargs["model"])).eval()
        runner = SimpleNamespace(model=FakeVllmModel(self, self.hf))
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(
            driver_worker=SimpleNamespace(worker=SimpleNamespace(model_runner=runner))))
        FakeLLM.built.append(self)

    def sleep(self, level=1):
        assert not self.asleep, f"sleep while {self.asleep} already asleep"
        self.events.append(("sleep", level))
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags=None):
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        assert set(tags) <= self.asleep, f"wake_up({tags}) while only {self.asleep} is asleep"
        self.events.append(("wake_up", tuple(tags)))
        self.asleep -= set(tags)

    def reset_prefix_cache(self):
        self.events.append(("reset_prefix_cache",))

    def generate(self, prompts, params, use_tqdm=True):
        assert not self.asleep, f"generate while {self.asleep} is asleep"
        self.events.append(("generate", len(prompts)))
        self.params.append(params)
        self.generated_weights.append({k: v.detach().clone() for k, v in self.hf.state_dict().items()})
        return [SimpleNamespace(outputs=[self._sample(p["prompt_token_ids"], sp, j) for j in range(sp.n)])
                for p, sp in zip(prompts, params)]

    @torch.no_grad()
    def _sample(self, prompt, sp, j):
        gen = torch.Generator().manual_seed((sp.seed * 8 + j) % 2 ** 62)
        ids, logprobs, reason = list(prompt), [], "length"
        for _ in range(sp.max_tokens):
            logits = self.hf(torch.tensor([ids])).logits[0, -1].float()
            if sp.temperature == 0:
                token, lp = int(logits.argmax()), torch.log_softmax(logits, -1)
            else:
                lp = torch.log_softmax(logits / sp.temperature, -1)
                token = int(torch.multinomial(lp.exp(), 1, generator=gen))
            ids.append(token)
            logprobs.append({token: SimpleNamespace(logprob=float(lp[token]))})
            if token in sp.stop_token_ids:
                reason = "stop"
                break
        return SimpleNamespace(token_ids=ids[len(prompt):], logprobs=logprobs, finish_reason=reason)


class FakeLLMWithoutTags(FakeLLM):
    """An older vLLM: ``wake_up()`` wakes everything."""

    def wake_up(self):  # noqa: D102 - no tags
        super().wake_up()


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams, module.__version__ = FakeLLM, FakeSamplingParams, "0.0-fake"
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setattr(FakeLLM, "built", [])
    monkeypatch.setenv(ENV, "unset-by-the-test")  # recorded, so the test's environment comes back
    monkeypatch.delenv(ENV)
    return module


@pytest.fixture
def actor(mini_qwen2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(mini_qwen2_dir, dtype=torch.float32)


def perturb(model, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)


def unique_weights(model) -> dict[str, torch.Tensor]:
    """The state dict without the names that share a tensor with an earlier one (tied embeddings)."""
    seen, out = set(), {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t.detach().clone()
    return out


def compress(events):
    """Events with runs of weight loads folded into one "load*"."""
    out = []
    for e in events:
        label = "load*" if e[0] == "load" else ":".join(str(x) if not isinstance(x, tuple) else ",".join(x) for x in e)
        if not (label == "load*" and out and out[-1] == "load*"):
            out.append(label)
    return out


def syncs(llm) -> list[dict[str, torch.Tensor]]:
    """The weights the fake received, one dict per sync (a sync ends with the prefix-cache reset)."""
    groups, current, loaded = [], {}, iter(llm.loaded)
    for event in llm.events:
        if event[0] == "load":
            name, tensor = next(loaded)
            assert name not in current, f"{name} loaded twice in one sync"
            current[name] = tensor
        elif event[0] == "reset_prefix_cache":
            groups.append(current)
            current = {}
    assert current == {}
    return groups


# ---- the adapter ------------------------------------------------------------------------------
def test_build_rollout_passes_the_generate_config_keys_and_sampling_params(fake_vllm, mini_qwen2_dir, tmp_path,
                                                                           monkeypatch, actor):
    from posttrain.config import vllm as config_vllm
    from posttrain.config.plan import resolve_plan
    from posttrain.config.run import run_config_from_dict
    from posttrain.roles.policy import build_rollout
    from posttrain.rollout.vllm_engine import LOGPROBS_MODE, derive_seed

    monkeypatch.setattr(config_vllm, "on_cuda", lambda device_type: True)
    cfg = run_config_from_dict({
        "megatron_training": {"stage": "ray_grpo", "global_batch_size": 2, "micro_batch_size": 4, "seq_length": 48,
                              "train_iters": 1, "tokenizer_name_or_path": str(mini_qwen2_dir)},
        "rl_config": {"n_samples_per_prompt": 2, "mini_batch_size": 2, "verifier_function": ["base_acc"],
                      "verifier_weight": [1.0], "rollout_engine": "vllm", "device": "cpu",
                      "output_dir": str(tmp_path / "run")},
        "generate_config": {"infer_tensor_parallel_size": 1, "max_model_len": 96, "max_num_seqs": 16,
                            "max_num_batched_tokens": 512, "dtype": "float32", "gpu_memory_utilization": 0.7,
                            "enforce_eager": False, "enable_prefix_caching": True, "trust_remote_code": True,
                            "enable_expert_parallel": True, "sampling_config": {"max_tokens": 4}}}, name="vllm_keys")
    plan = resolve_plan(cfg, device="cpu")
    assert not any("no effect" in w for w in plan.warnings), plan.warnings
    tok = SimpleNamespace(pad_token_id=0)
    engine = build_rollout(plan.rollout, plan.policy, actor, tok, [7])
    [llm] = FakeLLM.built
    assert os.environ[ENV] == "0"  # the model stays in this process, where sync_weights reaches it
    kwargs = {k: v for k, v in llm.kwargs.items() if k != "model"}
    assert kwargs == {"load_format": "dummy", "skip_tokenizer_init": True, "dtype": "float32", "max_num_seqs": 16,
                      "max_num_batched_tokens": 512, "max_model_len": 96, "gpu_memory_utilization": 0.7,
                      "tensor_parallel_size": 1, "enforce_eager": False, "enable_prefix_caching": True,
                      "trust_remote_code": True, "enable_sleep_mode": True, "logprobs_mode": LOGPROBS_MODE,
                      "enable_expert_parallel": True}
    assert LOGPROBS_MODE == "processed_logprobs"
    assert json.loads((Path(llm.kwargs["model"]) / "config.json").read_text())["model_type"] == "qwen2"
    assert not list(Path(llm.kwargs["model"]).glob("*.safetensors"))  # config only: weights come from the actor

    sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, max_tokens=3, seed=11)
    out = engine.generate([[1, 2, 3], [4, 5]], 2, sampling, stop_token_ids=[3, 9], prompt_keys=[4, 6])
    [params] = llm.params
    for key, p in zip([4, 6], params):
        assert vars(p) == {"n": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "max_tokens": 3,
                           "seed": derive_seed(11, key), "logprobs": 0, "detokenize": False,
                           "stop_token_ids": [3, 7, 9]}
    assert [len(g) for g in out] == [2, 2]
    assert all(len(o.logprobs) == len(o.token_ids) for g in out for o in g)
    engine.generate([[1, 2]], 1, SamplingParams(top_k=-1, max_tokens=2, seed=0))
    assert llm.params[-1][0].top_k == -1  # off: vLLM's -1


def test_sync_weights_loads_every_weight_one_tensor_per_call(fake_vllm, actor):
    from posttrain.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(actor, eos_token_ids=[], dtype="float32", max_model_len=64)
    [llm] = FakeLLM.built
    assert actor.config.tie_word_embeddings and "lm_head.weight" in actor.state_dict()
    perturb(actor, seed=1)
    llm.events.clear()
    llm.loaded.clear()
    llm.load_calls.clear()
    assert engine.sync_weights(actor) == len(unique_weights(actor))
    [received] = syncs(llm)
    want = unique_weights(actor)
    assert list(received) == list(want)  # every weight, in the actor's order, the tied lm_head not again
    assert "lm_head.weight" not in received and "model.embed_tokens.weight" in received
    assert all(torch.equal(received[k], want[k]) for k in want)
    assert llm.load_calls == [1] * len(want)  # one tensor per load_weights call: no second full copy
    fake_state, actor_state = llm.hf.state_dict(), actor.state_dict()
    assert all(torch.equal(fake_state[k], actor_state[k]) for k in actor_state)  # lm_head follows its tie


def test_rollouts_come_from_the_synced_weights(fake_vllm, actor):
    from posttrain.rollout.native import NativeEngine
    from posttrain.rollout.vllm_engine import VLLMEngine

    greedy = SamplingParams(temperature=0.0, max_tokens=6, seed=0)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    native = NativeEngine(actor, pad_token_id=0, eos_token_ids=[])
    engine = VLLMEngine(actor, eos_token_ids=[], dtype="float32", max_model_len=64)

    def tokens(e):
        return [[o.token_ids for o in g] for g in e.generate(prompts, 1, greedy)]

    assert tokens(engine) == tokens(native)
    perturb(actor, seed=2)
    assert tokens(engine) != tokens(native)  # not synced yet: the old weights
    engine.sync_weights(actor)
    assert tokens(engine) == tokens(native)
    out = engine.generate(prompts, 1, greedy)
    want = native.generate(prompts, 1, greedy)
    for g, h in zip(out, want):
        assert g[0].logprobs == pytest.approx(h[0].logprobs, abs=1e-4)


def test_sleep_and_wake_order(fake_vllm, actor):
    from posttrain.rollout.vllm_engine import VLLMEngine

    sp = SamplingParams(temperature=1.0, max_tokens=2, seed=0)
    engine = VLLMEngine(actor, eos_token_ids=[], dtype="float32", max_model_len=64)
    [llm] = FakeLLM.built
    assert llm.kwargs["enable_sleep_mode"] is True
    engine.generate([[1, 2]], 2, sp)
    engine.sync_weights(actor)
    engine.generate([[1, 2]], 2, sp)
    engine.generate([[1, 2]], 2, sp)  # no sync in between (a second DAPO batch, an evaluation)
    engine.sync_weights(actor)
    engine.sync_weights(actor)  # twice: the weights are already awake
    assert compress(llm.events) == [
        "load*", "reset_prefix_cache",                                     # built: awake, the actor's weights
        "generate:1", "sleep:1",                                           # generate -> sleep(1)
        "wake_up:weights", "load*", "reset_prefix_cache",                  # sync -> the weights alone
        "wake_up:kv_cache", "generate:1", "sleep:1",                       # generate -> the KV cache first
        "wake_up:weights", "wake_up:kv_cache", "generate:1", "sleep:1",    # both, weights first
        "wake_up:weights", "load*", "reset_prefix_cache", "load*", "reset_prefix_cache"]


def test_a_vllm_without_wake_tags_wakes_everything_once(fake_vllm, actor):
    from posttrain.rollout.vllm_engine import VLLMEngine

    fake_vllm.LLM = FakeLLMWithoutTags
    sp = SamplingParams(temperature=1.0, max_tokens=2, seed=0)
    engine = VLLMEngine(actor, eos_token_ids=[], dtype="float32", max_model_len=64)
    [llm] = FakeLLM.built
    engine.generate([[1, 2]], 1, sp)
    engine.sync_weights(actor)
    engine.generate([[1, 2]], 1, sp)
    assert compress(llm.events)[2:] == ["generate:1", "sleep:1", "wake_up:weights,kv_cache", "load*",
                                        "reset_prefix_cache", "generate:1", "sleep:1"]


def test_without_sleep_mode_nothing_sleeps(fake_vllm, actor):
    from posttrain.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(actor, eos_token_ids=[], dtype="float32", max_model_len=64, sleep_mode=False)
    [llm] = FakeLLM.built
    engine.generate([[1, 2]], 1, SamplingParams(max_tokens=2, seed=0))
    engine.sync_weights(actor)
    assert llm.kwargs["enable_sleep_mode"] is False
    assert not any(e[0] in ("sleep", "wake_up") for e in llm.events)


def test_out_of_memory_names_the_keys_to_lower(fake_vllm, actor, monkeypatch):
    from posttrain.errors import ConfigError
    from posttrain.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(actor, eos_token_ids=[], dtype="float32", max_model_len=64, max_num_seqs=32,
                        gpu_memory_utilization=0.6)

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(engine.llm, "generate", oom)
    with pytest.raises(ConfigError, match=r"generate_config.max_num_seqs \(sequences decoded at once: 32\) or "
                                          r"generate_config.gpu_memory_utilization .*0.6"):
        engine.generate([[1, 2]], 1, SamplingParams(max_tokens=2, seed=0))

    class NoKvCache(FakeLLM):
        def __init__(self, **kwargs):
            raise ValueError("No available memory for the cache blocks. Try increasing `gpu_memory_utilization`")

    fake_vllm.LLM = NoKvCache
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization \(now 0.5\).*max_num_seqs"):
        VLLMEngine(actor, eos_token_ids=[], dtype="float32", max_model_len=64)

    class Old(FakeLLM):
        def __init__(self, logprobs_mode=None, **kwargs):
            if logprobs_mode is not None:
                raise TypeError("__init__() got an unexpected keyword argument 'logprobs_mode'")

    fake_vllm.LLM = Old
    with pytest.raises(ConfigError, match="no logprobs_mode argument"):
        VLLMEngine(actor, eos_token_ids=[], dtype="float32", max_model_len=64)


# ---- the trainer ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prompt_data(tmp_path_factory, mini_qwen2_dir, sum_prompts):
    return sum_prompts(tmp_path_factory.mktemp("vllm_fake_data"), mini_qwen2_dir)


def test_the_trainer_syncs_the_weights_after_every_update(fake_vllm, mini_qwen2_dir, prompt_data, tmp_path,
                                                          monkeypatch):
    from posttrain.config import vllm as config_vllm
    from posttrain.config.plan import resolve_plan
    from posttrain.config.run import run_config_from_dict
    from posttrain.loops.build import build_trainer

    torch.set_num_threads(1)
    monkeypatch.setattr(config_vllm, "on_cuda", lambda device_type: True)  # the fake runs on the CPU
    cfg = run_config_from_dict({
        "megatron_training": {"stage": "ray_grpo", "global_batch_size": 2, "micro_batch_size": 8, "seq_length": 48,
                              "train_iters": 3, "lr": 1e-2, "lr_decay_style": "constant", "weight_decay": 0.0,
                              "tokenizer_name_or_path": str(mini_qwen2_dir), "data_path": prompt_data, "seed": 3,
                              "dataset_additional_keys": ["labels"], "prompt_type": "default"},
        "rl_config": {"n_samples_per_prompt": 4, "mini_batch_size": 2, "verifier_function": ["test_vllm_digit_share"],
                      "verifier_weight": [1.0], "verifier_parallel": 0, "init_kl_coef": 0.0,
                      "max_prompt_length": 48, "output_dir": str(tmp_path / "run"), "device": "cpu",
                      "rollout_engine": "vllm"},
        "generate_config": {"max_model_len": 64, "max_num_seqs": 64, "infer_tensor_parallel_size": 1,
                            "sampling_config": {"max_tokens": 8, "temperature": 1.0, "top_k": -1}},
    }, name="vllm_fake_grpo")
    trainer = build_trainer(resolve_plan(cfg, device="cpu"))
    [llm] = FakeLLM.built
    actor = trainer.s.policy.model
    after_update = [unique_weights(actor)]  # the initial load
    learn = trainer.learn

    def recording_learn(*args, **kwargs):
        learn(*args, **kwargs)
        after_update.append(unique_weights(actor))

    trainer.learn = recording_learn
    trainer.fit()

    received = syncs(llm)
    assert len(received) == len(after_update) == 4  # the initial load, then one full sync per update
    for got, want in zip(received, after_update):
        assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert all(not torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])
               for a, b in zip(after_update, after_update[1:]))  # every update moved the weights
    # each iteration's rollout sampled from the weights of the update before it
    assert len(llm.generated_weights) == 3
    for it, weights in enumerate(llm.generated_weights):
        assert all(torch.equal(weights[k], after_update[it][k]) for k in after_update[it])
    per_iteration = ["wake_up:kv_cache", "generate:2", "sleep:1", "wake_up:weights", "load*", "reset_prefix_cache"]
    assert compress(llm.events) == ["load*", "reset_prefix_cache", *per_iteration[1:], *per_iteration * 2]
    lines = read_metrics(tmp_path / "run")
    metrics = [r for r in lines if "actor/pg_loss" in r]
    assert [r["iteration"] for r in metrics] == [1, 2, 3]
    assert all(r["timing/resharding_to_infer"] >= 0 for r in metrics)
