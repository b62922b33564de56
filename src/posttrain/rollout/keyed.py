"""Counter-based random numbers keyed by (seed, prompt key, sample index, token position).

The native engine draws one uniform per row and token from a stateless hash instead of a
``torch.Generator`` stream, so a sample's tokens do not depend on which other prompts share its
batch, on the wave size, or on how many workers split the prompts (docs/rollout.md).

The hash is splitmix64 (Steele, Lea & Flood 2014, "Fast splittable pseudorandom number
generators"): the finaliser

    mix(z) = m3(m2(m1(z)))  with  m1(z) = (z ^ z>>>30) * 0xBF58476D1CE4E5B9,
                                  m2(z) = (z ^ z>>>27) * 0x94D049BB133111EB,  m3(z) = z ^ z>>>31

is a bijection of 64-bit words. A row's stream state absorbs each key component with one
splitmix step, ``absorb(h, c) = mix(h + (c + 1) * GAMMA)`` (``GAMMA = 0x9E3779B97F4A7C15``, odd), so
for a fixed prefix distinct components give distinct states:

    row    = absorb(absorb(absorb(0, seed), prompt_key), sample_index)
    u(pos) = (absorb(row, position) >>> 11) * 2**-53          in [0, 1), 53 random bits

The tensor functions emulate unsigned 64-bit arithmetic with torch int64: multiplication wraps
modulo 2**64 (two's complement), and ``>>`` on a negative int64 is arithmetic, so every shift is
masked to a logical one. :func:`splitmix_mix` is the plain-Python reference the tests compare with.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
M1 = 0xBF58476D1CE4E5B9
M2 = 0x94D049BB133111EB


def to_int64(value: int) -> int:
    """The signed int64 with the same low 64 bits as ``value`` (any Python int)."""
    value &= MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


# ---- plain Python (reference; also the vLLM adapter's per-request seeds) -------------------------
def splitmix_mix(z: int) -> int:
    """The splitmix64 finaliser on an unsigned 64-bit Python int."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * M1) & MASK64
    z = ((z ^ (z >> 27)) * M2) & MASK64
    return z ^ (z >> 31)


def absorb_int(state: int, component: int) -> int:
    """One splitmix step of ``state`` keyed by ``component`` (unsigned 64-bit Python ints)."""
    return splitmix_mix(state + ((component + 1) & MASK64) * GAMMA)


def row_state_int(seed: int, prompt_key: int, sample_index: int) -> int:
    """The stream state of one row, as :func:`row_states` computes it, in plain Python."""
    return absorb_int(absorb_int(absorb_int(0, seed), prompt_key), sample_index)


def uniform_int(state: int, position: int) -> float:
    """The uniform of ``position`` in the stream ``state``, as :func:`uniforms` computes it."""
    return (absorb_int(state, position) >> 11) * 2.0 ** -53


# ---- torch int64 (the engine's path) ------------------------------------------------------------
def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 words (``>>`` is arithmetic on negative int64)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def mix(z: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser on int64 tensors (bit-identical to :func:`splitmix_mix`)."""
    z = (z ^ _shr(z, 30)) * to_int64(M1)
    z = (z ^ _shr(z, 27)) * to_int64(M2)
    return z ^ _shr(z, 31)


def absorb(state: torch.Tensor, component: torch.Tensor | int) -> torch.Tensor:
    """``mix(state + (component + 1) * GAMMA)`` elementwise, wrapping modulo 2**64."""
    if isinstance(component, int):
        step = to_int64((component + 1) * GAMMA)
    else:
        step = (component + 1) * to_int64(GAMMA)
    return mix(state + step)


def _as_int64(values: Sequence[int] | torch.Tensor, device) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.to(device=device, dtype=torch.long)
    return torch.tensor([to_int64(int(v)) for v in values], dtype=torch.long, device=device)


def row_states(seed: int, prompt_keys: Sequence[int] | torch.Tensor, sample_indices: Sequence[int] | torch.Tensor,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """The stream state of each row [B] int64, from the call's ``seed`` and each row's prompt key
    and sample index (both [B])."""
    keys = _as_int64(prompt_keys, device)
    samples = _as_int64(sample_indices, device)
    if keys.shape != samples.shape:
        raise ValueError(f"prompt_keys {tuple(keys.shape)} and sample_indices {tuple(samples.shape)} differ in shape")
    start = absorb(torch.zeros_like(keys), to_int64(seed))
    return absorb(absorb(start, keys), samples)


def uniforms(states: torch.Tensor, positions: torch.Tensor | int) -> torch.Tensor:
    """One uniform in [0, 1) per row [B] float64: row ``b``'s draw at token ``positions[b]``."""
    bits = _shr(absorb(states, positions), 11)  # the top 53 bits
    return bits.double() * 2.0 ** -53


def random_seed(generator: torch.Generator | None = None) -> int:
    """A fresh 63-bit seed from ``generator`` (default: torch's global generator)."""
    return int(torch.randint(0, 2 ** 63 - 1, (1,), generator=generator).item())
