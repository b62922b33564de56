"""Split a rollout request into waves that respect ``max_num_seqs`` and ``max_num_batched_tokens``.

A wave is a list of ``(prompt_index, num_samples)``: its prompts are prefilled once (in chunks of at
most ``max_num_batched_tokens`` padded tokens), the cache is expanded to ``num_samples`` rows per
prompt, and the rows decode together until all are finished. A wave holds at most ``max_num_seqs``
rows. Prompts are grouped by length so that left padding stays small.
"""

from __future__ import annotations

from posttrain.errors import ConfigError, DataError

Wave = list[tuple[int, int]]


def plan_waves(prompt_lengths: list[int], n: int, max_num_seqs: int) -> list[Wave]:
    """Group prompts (sorted by length) into waves of at most ``max_num_seqs`` sample rows.

    When ``n > max_num_seqs`` a prompt's samples are split over several waves (its prefill is then
    repeated once per wave).
    """
    if max_num_seqs < 1:
        raise ConfigError(f"generate_config.max_num_seqs={max_num_seqs}: must be >= 1.")
    order = sorted(range(len(prompt_lengths)), key=lambda i: prompt_lengths[i])
    waves: list[Wave] = []
    current: Wave = []
    rows = 0
    for idx in order:
        if rows + n > max_num_seqs and current:  # keep a prompt's samples together
            waves.append(current)
            current, rows = [], 0
        left = n
        while left > max_num_seqs:  # only when n > max_num_seqs: one wave per chunk
            waves.append([(idx, max_num_seqs)])
            left -= max_num_seqs
        current.append((idx, left))
        rows += left
    if current:
        waves.append(current)
    return waves


def prefill_chunks(num_prompts: int, padded_len: int, max_num_batched_tokens: int) -> list[range]:
    """Split ``num_prompts`` prompts of padded length ``padded_len`` into chunks of at most
    ``max_num_batched_tokens`` tokens (at least one prompt per chunk)."""
    if max_num_batched_tokens < 1:
        raise ConfigError(f"generate_config.max_num_batched_tokens={max_num_batched_tokens}: must be >= 1.")
    per_chunk = max(1, max_num_batched_tokens // max(1, padded_len))
    return [range(s, min(s + per_chunk, num_prompts)) for s in range(0, num_prompts, per_chunk)]


MIN_SHARED_PREFIX = 16  # a prefix common to a wave's prompts is prefilled once from this many tokens


def shared_prefix(prompts: list[list[int]]) -> int:
    """How many first tokens every prompt has in common, to prefill once (0 below
    ``MIN_SHARED_PREFIX``); every prompt keeps at least one token of its own, whose logits start its
    sampling."""
    first, common = prompts[0], min(len(p) for p in prompts) - 1
    for prompt in prompts[1:]:
        common = next((i for i, (a, b) in enumerate(zip(first[:common], prompt)) if a != b), common)
    return common if common >= MIN_SHARED_PREFIX else 0


def model_len_caps(max_model_len: int | None, prompts: list[list[int]], max_tokens: int,
                   caps: list[int] | None) -> list[int] | None:
    """Each prompt's cap on new tokens: ``caps`` (or ``max_tokens``) within the room that
    ``max_model_len`` leaves after the prompt; None where no prompt needs one (the default decode
    path). A prompt that leaves no room is refused, as vLLM refuses it."""
    if max_model_len is None:
        return caps
    room = [max_model_len - len(p) for p in prompts]
    for i, left in enumerate(room):
        if left < 1:
            raise DataError(f"prompt {i} holds {len(prompts[i])} tokens: no room for a response within "
                            f"generate_config.max_model_len={max_model_len}; raise max_model_len or lower "
                            "rl_config.max_prompt_length")
    if caps is None and min(room) >= max_tokens:
        return None
    return [min(left, max_tokens if caps is None else int(cap))
            for left, cap in zip(room, caps or [max_tokens] * len(room))]
