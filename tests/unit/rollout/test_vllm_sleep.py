"""The vLLM adapter's sleep mode (CUDA only: vLLM has none on a CPU, so tests/vllm cannot run it):
the order of its sleep, wake, load and generate calls, against a recorder of those calls."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from posttrain.rollout import vllm_engine
from posttrain.rollout.base import SamplingParams


class Recorder:
    def __init__(self, tags: bool = True):
        self.events, self.asleep = [], set()
        if not tags:
            self.wake_up = self._wake_all

    def sleep(self, level=1):
        assert not self.asleep
        self.events.append("sleep")
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags=None):
        assert set(tags) <= self.asleep
        self.events.append("wake:" + ",".join(tags))
        self.asleep -= set(tags)

    def _wake_all(self):
        self.events.append("wake:all")
        self.asleep.clear()

    def collective_rpc(self, method, kwargs):
        assert "weights" not in self.asleep and method == "reload_weights"
        self.events.append("load")

    def reset_prefix_cache(self):
        self.events.append("reset")

    def generate(self, prompts, params, use_tqdm=False):
        assert not self.asleep
        self.events.append("generate")
        done = SimpleNamespace(token_ids=[1], logprobs=[{1: SimpleNamespace(logprob=-0.5)}], finish_reason="stop")
        return [SimpleNamespace(outputs=[done] * p.n) for p in params]


@pytest.fixture
def engine(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **kw: SimpleNamespace(**kw)))
    engine = object.__new__(vllm_engine.VLLMEngine)
    engine.llm, engine.eos_token_ids, engine.on_cpu = Recorder(), [], False
    engine.sleep_mode, engine._asleep, engine._wake_tags, engine._metrics = True, set(), True, {}
    engine.check_probe = lambda *args: None  # the probe runs in tests/vllm
    return engine


def test_sleep_and_wake_order(engine):
    sp = SamplingParams(temperature=1.0, max_tokens=2, seed=0)
    weights = [("model.layers.0.a", None), ("model.layers.0.b", None), ("model.norm.weight", None)]
    engine.generate([[1, 2]], 2, sp)
    engine.load_weights(weights)
    engine.generate([[1, 2]], 2, sp)
    engine.generate([[1, 2]], 2, sp)  # no sync in between (a second DAPO batch, an evaluation)
    engine.load_weights(weights)
    engine.load_weights(weights)  # twice: the weights are already awake
    assert engine.llm.events == [
        "generate", "sleep",                                   # generate -> sleep(1)
        "wake:weights", "load", "load", "reset",               # sync -> the weights alone, one call per layer
        "wake:kv_cache", "generate", "sleep",                  # generate -> the KV cache too
        "wake:weights", "wake:kv_cache", "generate", "sleep",  # both, weights first
        "wake:weights", "load", "load", "reset", "load", "load", "reset"]


def test_a_vllm_without_wake_tags_wakes_everything_once(engine):
    engine.llm, engine._wake_tags = Recorder(tags=False), False
    sp = SamplingParams(temperature=1.0, max_tokens=2, seed=0)
    engine.generate([[1, 2]], 1, sp)
    engine.load_weights([("model.norm.weight", None)])
    engine.generate([[1, 2]], 1, sp)
    assert engine.llm.events == ["generate", "sleep", "wake:all", "load", "reset", "generate", "sleep"]


def test_without_sleep_mode_nothing_sleeps(engine):
    engine.sleep_mode, engine._asleep, engine.llm = False, set(), Recorder()  # an engine without sleep mode
    engine.generate([[1, 2]], 1, SamplingParams(max_tokens=2, seed=0))
    engine.load_weights([("model.norm.weight", None)])
    assert engine.llm.events == ["generate", "load", "reset"]


def test_the_sleep_after_a_rollout_is_timed_as_resharding_to_train(engine):
    """The device goes back to the trainer when the engine sleeps: ``timing/resharding_to_train``
    (summed since the last pop); no sleep, no metric."""
    sp = SamplingParams(temperature=1.0, max_tokens=2, seed=0)
    engine.generate([[1, 2]], 2, sp)
    engine.generate([[1, 2]], 2, sp)
    metrics = engine.pop_metrics()
    assert engine.llm.events.count("sleep") == 2 and metrics["timing/resharding_to_train"] >= 0
    assert engine.pop_metrics() == {}
    engine.sleep_mode, engine._asleep, engine.llm = False, set(), Recorder()  # an engine without sleep mode
    engine.generate([[1, 2]], 2, sp)
    assert "timing/resharding_to_train" not in engine.pop_metrics()
