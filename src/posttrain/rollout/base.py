"""The rollout interface: sampling parameters, per-sample outputs, the engine protocol, the registry
(``ROLLOUT_ENGINES``).

Engines take prompt token ids and return response token ids; they never re-tokenise text.
``generate`` returns, for each prompt, its ``n`` samples::

    engine.generate([[1, 2, 3], [4, 5]], n=8, sampling=SamplingParams(seed=0))
    # -> [[RolloutOutput x 8], [RolloutOutput x 8]]
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from posttrain.errors import ConfigError
from posttrain.registry import Registry

FinishReason = Literal["stop", "length"]


@dataclass
class SamplingParams:
    """The seed's ``generate_config.sampling_config`` (defaults identical to the seed).

    - ``temperature``: logits are divided by it; ``0`` means greedy (argmax).
    - ``top_k``: keep the k most likely tokens; ``-1`` (or ``0``) turns it off.
    - ``top_p``: keep the smallest set of tokens whose probability reaches ``top_p``; ``1.0`` is off.
    - ``min_p``: drop tokens with ``p < min_p * max_p``; ``0.0`` is off.
    - ``max_tokens``: the most response tokens per sample (finish reason ``"length"``).
    - ``seed``: keys the sampler's random stream (with each sample's prompt key, sample index and
      token position, see ``rollout/keyed.py``); ``None`` draws a seed per call from torch's
      global generator.
    - ``logprobs``: kept for compatibility with the seed; the engines always return the logprob of
      the sampled token (``logprobs >= 1``); top-N alternatives are not returned.
    - ``detokenize``: kept for compatibility; engines return token ids only.
    - ``truncated_logprobs`` (not a ``sampling_config`` key: ``rl_config.truncated_sampling_logprobs``):
      report each token's log-prob under the truncated, renormalised distribution it was drawn from
      (:mod:`posttrain.algo.truncation`) rather than the full one.
    """

    logprobs: int = 1
    max_tokens: int = 128
    top_p: float = 1.0
    top_k: int = 50
    min_p: float = 0.0
    temperature: float = 0.2
    seed: int | None = None
    detokenize: bool = False
    truncated_logprobs: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError naming the ``sampling_config`` key that is out of range."""
        checks = [
            ("max_tokens", self.max_tokens >= 1, "an integer >= 1"),
            ("temperature", self.temperature >= 0, "a number >= 0 (0 means greedy)"),
            ("top_p", 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("top_k", self.top_k == -1 or self.top_k >= 0, "-1 (off) or an integer >= 0"),
            ("min_p", 0 <= self.min_p <= 1, "a number in [0, 1]"),
            ("logprobs", self.logprobs is None or self.logprobs >= 0, "an integer >= 0"),
        ]
        for key, ok, want in checks:
            if not ok:
                raise ConfigError(f"generate_config.sampling_config.{key}={getattr(self, key)!r}: must be {want}.")

    @classmethod
    def from_config(cls, config: dict[str, Any] | None) -> "SamplingParams":
        """Build from a ``sampling_config`` dict; unknown keys raise ConfigError listing the known ones."""
        config = dict(config or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ConfigError(f"generate_config.sampling_config: unknown key(s) {unknown}; "
                              f"known keys are {sorted(known)}.")
        return cls(**config)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RolloutOutput:
    """One sample: response token ids (stop token included when it ended the sample), the logprob
    of each token under the sampling distribution after temperature, and why it ended.

    A multi-turn sample (``rollout/multi_turn.py``) also carries ``response_mask`` (1 on sampled
    tokens, 0 on tool tokens, whose logprob is 0.0) and ``tool_call_num``; a single-turn sample
    leaves ``response_mask`` None (every token is sampled)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason = "length"
    response_mask: list[int] | None = None
    tool_call_num: int = 0


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer calls. Outer list: prompts, in order; inner list: that prompt's n samples.

    ``prompt_keys[i]`` (default ``i``) names prompt i's random stream: callers that split one
    batch of prompts over several calls or workers pass each prompt's index in the whole batch, so
    the samples do not depend on the split.

    The loop calls ``sync_weights`` after every update and ``pop_metrics`` once per batch of
    experience, on every engine. An engine that subclasses this protocol inherits their no-op
    defaults (an engine that samples from the trained model object itself has nothing to sync).
    ``tests/unit/train/test_engine_protocol.py`` checks the engines' signatures against these.
    """

    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams,
                 stop_token_ids: list[int] | None = None,
                 prompt_keys: list[int] | None = None) -> list[list[RolloutOutput]]:
        ...

    def sync_weights(self, model: Any) -> int | None:
        """Sample from ``model``'s current weights from now on: an engine with its own copy of the
        weights (vLLM) loads them and returns how many tensors it loaded (the loop times that as
        ``timing/resharding_to_infer``). Default: None, nothing to load."""
        return None

    def pop_metrics(self) -> dict[str, float]:
        """The engine's metrics since the last call, which starts the count again. Default: none."""
        return {}


# name -> engine class or factory; "module:attr" targets are imported on first use, so vllm stays lazy.
# Build one with ROLLOUT_ENGINES.get(name)(**kwargs); register one with ROLLOUT_ENGINES.add(name, factory).
ROLLOUT_ENGINES = Registry("rollout engine", key="rl_config.rollout_engine")
ROLLOUT_ENGINES.add("native", "posttrain.rollout.native:NativeEngine")
ROLLOUT_ENGINES.add("vllm", "posttrain.rollout.vllm_engine:VLLMEngine")


