"""Partial rollout's rounds in one call, over engines that are called round by round: the Ray workers'.

In one process the native engine decodes every unfinished sample of a partial rollout in one wave
that keeps its KV cache and asks ``stop_when(finished)`` every ``stop_every`` decode steps
(:meth:`posttrain.rollout.native.NativeEngine.generate`, :mod:`posttrain.loops.partial_rollout`).
The check needs every sample's state, and on Ray the samples are spread over the workers, so
:func:`decode_rounds` makes each round a call of its own (each worker decodes its share of the
rows ``stop_every`` tokens further) and asks the check here, between the calls.
"""

from __future__ import annotations

from dataclasses import replace

from posttrain.errors import ConfigError
from posttrain.rollout.base import RolloutOutput


def decode_rounds(generate, prompts, n, sampling, stop_token_ids, keys, sample_offsets, position_offsets,
                  max_new_tokens, stop_when, stop_every, images=None, max_model_len=None) -> list[list[RolloutOutput]]:
    """The native engine's ``generate(stop_when=..., stop_every=...)`` by calls of ``generate`` (an
    engine's, without ``stop_when``): every sample row (prompt-major) decodes ``stop_every`` tokens a
    call (up to its cap: ``max_new_tokens`` and ``sampling.max_tokens``), continued from where it
    stopped with the same keyed streams, until every row is finished or ``stop_when(finished)``
    holds after a call; rows not finished then return the tokens they have (``"length"``). The
    samples are those of one decode in one process (each token is keyed by its position); each call
    re-prefills the rows it continues (one wave in one process keeps its KV cache: float noise).
    ``images``: each prompt's (a multimodal run's), passed with every call's rows of that prompt.
    ``max_model_len``: the engines' (a row whose prompt and tokens fill it is finished, ``"length"``,
    as in one decode; another call would be refused for want of room)."""
    if stop_every < 1:
        raise ConfigError(f"generate(stop_when=...) needs stop_every >= 1 (got {stop_every})")
    samples = [0] * len(prompts) if sample_offsets is None else list(sample_offsets)
    positions = [0] * len(prompts) if position_offsets is None else list(position_offsets)
    caps = [sampling.max_tokens] * len(prompts) if max_new_tokens is None else [
        min(int(c), sampling.max_tokens) for c in max_new_tokens]
    rows = [(i, j) for i in range(len(prompts)) for j in range(n)]  # (prompt, sample) of each row
    tokens, logprobs = [[] for _ in rows], [[] for _ in rows]
    stopped, done = [False] * len(rows), [False] * len(rows)
    while not all(done):
        live = [r for r in range(len(rows)) if not done[r]]
        outs = generate([prompts[rows[r][0]] + tokens[r] for r in live], 1, replace(sampling, max_tokens=stop_every),
                        stop_token_ids, prompt_keys=[keys[rows[r][0]] for r in live],
                        sample_offsets=[samples[rows[r][0]] + rows[r][1] for r in live],
                        position_offsets=[positions[rows[r][0]] + len(tokens[r]) for r in live],
                        max_new_tokens=[min(stop_every, caps[rows[r][0]] - len(tokens[r])) for r in live],
                        **({} if images is None else {"images": [images[rows[r][0]] for r in live]}))
        for r, (out,) in zip(live, outs):
            tokens[r] += list(out.token_ids)
            logprobs[r] += list(out.logprobs)
            stopped[r] = out.finish_reason == "stop"
            full = max_model_len is not None and len(prompts[rows[r][0]]) + len(tokens[r]) >= max_model_len
            done[r] = stopped[r] or full or len(tokens[r]) >= caps[rows[r][0]]
        if not all(done) and stop_when(list(done)):
            break
    results: list[list[RolloutOutput]] = [[] for _ in prompts]
    for r, (i, _) in enumerate(rows):
        results[i].append(RolloutOutput(token_ids=tokens[r], logprobs=logprobs[r],
                                        finish_reason="stop" if stopped[r] else "length"))
    return results
