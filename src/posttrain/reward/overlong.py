"""DAPO's overlong reward shaping (Yu et al. 2025, "soft overlong punishment"; seed_system.md 2.3).

With ``L`` the response length in tokens, ``L_max = max_tokens``, ``B = overlong_buffer`` and
``f = penalty_factor``::

    expected = L_max - B
    exceed   = min(L - expected, B)
    penalty  = min(-exceed / B * f, 0)

so the penalty is 0 up to ``expected`` tokens, falls linearly to ``-f`` at ``L_max`` and stays
at ``-f`` beyond. It is added to the weighted verifier score.
"""

from __future__ import annotations

from posttrain.errors import ConfigError


def check_overlong(max_tokens: int, overlong_buffer: int) -> None:
    """The seed's validation: ``0 < overlong_buffer < max_tokens``."""
    if overlong_buffer <= 0:
        raise ConfigError(f"rl_config.overlong_buffer must be > 0 when overlong_buffer_enable is true, "
                          f"got {overlong_buffer}")
    if overlong_buffer >= max_tokens:
        raise ConfigError(f"rl_config.overlong_buffer ({overlong_buffer}) must be smaller than "
                          f"rl_config.rollout_max_tokens ({max_tokens})")


def overlong_penalty(response_lengths, max_tokens: int, overlong_buffer: int, penalty_factor: float = 1.0):
    """Penalty per response (<= 0). A list (or any sequence) gives a list of floats; a torch
    tensor gives a float tensor of the same shape."""
    check_overlong(max_tokens, overlong_buffer)
    expected = max_tokens - overlong_buffer
    if hasattr(response_lengths, "clamp"):  # torch tensor: stay on its device
        exceed = (response_lengths.float() - expected).clamp(max=overlong_buffer)
        return (-exceed / overlong_buffer * penalty_factor).clamp(max=0.0)
    out = []
    for length in response_lengths:
        exceed = min(float(length) - expected, overlong_buffer)
        out.append(min(-exceed / overlong_buffer * penalty_factor, 0.0))
    return out
