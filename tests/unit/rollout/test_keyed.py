"""The keyed random stream (rollout/keyed.py) and the inverse-CDF draw (rollout/sampling.py)."""

from __future__ import annotations

import random

import pytest
import torch

from posttrain.rollout import keyed, sampling
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.sampling import inverse_cdf, sample_next


def test_mix_is_splitmix64_bit_for_bit():
    # Vigna's splitmix64.c seeded with 1234567 returns 6457827717110365317 first
    assert keyed.splitmix_mix(1234567 + keyed.GAMMA) == 6457827717110365317
    rng = random.Random(0)
    words = [rng.randrange(0, 1 << 64) for _ in range(2000)] + [0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]
    got = keyed.mix(torch.tensor([keyed.to_int64(w) for w in words])).tolist()
    assert [g & keyed.MASK64 for g in got] == [keyed.splitmix_mix(w) for w in words]


def test_row_states_and_uniforms_match_the_python_reference():
    rng = random.Random(1)
    rows = [(rng.randrange(-(1 << 70), 1 << 70), rng.randrange(0, 1 << 40), rng.randrange(0, 64)) for _ in range(200)]
    for seed in (0, 7, (1 << 64) + 7, -3):
        keys, samples = [k for _, k, _ in rows], [j for _, _, j in rows]
        states = keyed.row_states(seed, keys, samples)
        positions = torch.tensor([rng.randrange(0, 1 << 20) for _ in rows])
        got = keyed.uniforms(states, positions).tolist()
        want = [keyed.uniform_int(keyed.row_state_int(seed, k, j), int(p))
                for k, j, p in zip(keys, samples, positions.tolist())]
        assert got == want
    # seeds equal modulo 2**64 give the same stream
    assert torch.equal(keyed.row_states(7, [1], [0]), keyed.row_states((1 << 64) + 7, [1], [0]))


def grid(seed: int) -> torch.Tensor:
    """Uniforms of 64 prompt keys x 8 samples x 32 positions: [64 * 8, 32]."""
    keys = torch.arange(64).repeat_interleave(8)
    samples = torch.arange(8).repeat(64)
    states = keyed.row_states(seed, keys, samples)
    return torch.stack([keyed.uniforms(states, t) for t in range(32)], dim=1)


def test_uniforms_are_well_spread_and_never_collide_on_a_grid():
    u = torch.cat([grid(s).reshape(-1) for s in range(4)])  # 65536 draws
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.006  # std of the mean: 0.0011
    assert abs(u.var().item() - 1 / 12) < 0.002
    counts = torch.histc(u.float(), bins=32, min=0, max=1)
    expected = u.numel() / 32
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 80  # 31 degrees of freedom: mean 31, sd 7.9
    assert torch.unique(u).numel() == u.numel()  # 53-bit draws: no two equal on the grid
    # neighbouring positions and samples are uncorrelated
    g = grid(0)
    assert abs(torch.corrcoef(torch.stack([g[:, :-1].reshape(-1), g[:, 1:].reshape(-1)]))[0, 1]) < 0.03
    assert abs(torch.corrcoef(torch.stack([g[:-1].reshape(-1), g[1:].reshape(-1)]))[0, 1]) < 0.03


def test_every_key_component_changes_the_draws():
    base = keyed.uniforms(keyed.row_states(5, [3] * 100, [2] * 100), torch.arange(100))
    variants = {
        "seed": keyed.uniforms(keyed.row_states(6, [3] * 100, [2] * 100), torch.arange(100)),
        "prompt key": keyed.uniforms(keyed.row_states(5, [4] * 100, [2] * 100), torch.arange(100)),
        "sample index": keyed.uniforms(keyed.row_states(5, [3] * 100, [3] * 100), torch.arange(100)),
        "position": keyed.uniforms(keyed.row_states(5, [3] * 100, [2] * 100), torch.arange(1, 101)),
    }
    for name, other in variants.items():
        assert (other != base).all(), name
    # the components are not interchangeable: (key a, sample b) differs from (key b, sample a)
    swapped = keyed.row_states(5, [2, 3], [3, 2])
    assert swapped[0] != swapped[1]


def test_inverse_cdf_numbers_and_zero_probability_entries():
    probs = torch.tensor([[0.2, 0.0, 0.5, 0.3, 0.0]]).repeat(7, 1)
    u = torch.tensor([0.0, 0.1999, 0.2, 0.6999, 0.7, 1 - 2.0 ** -53, 1.0], dtype=torch.float64)
    assert inverse_cdf(probs, u).tolist() == [0, 0, 2, 2, 3, 3, 3]  # u = 1.0 clamps to the last valid index
    # an unnormalised row is scaled by its total
    assert inverse_cdf(torch.tensor([[2.0, 0.0, 6.0]]), torch.tensor([0.25], dtype=torch.float64)).tolist() == [2]


def test_inverse_cdf_equals_the_clamp_on_every_row():
    """The clamp runs only for rows whose target passed the end; the draw equals the formula that
    clamps every row (the sampler before the cut), on rows with runs of zeros and u up to 1."""
    gen = torch.Generator().manual_seed(5)
    probs = torch.rand(400, 300, generator=gen)
    probs[probs < 0.6] = 0.0  # many zero entries, trailing ones included
    probs[::7, 200:] = 0.0
    u = torch.rand(400, generator=gen, dtype=torch.float64)
    u[::5] = 1.0  # the target at the total: past the end before the clamp
    u[1::5] = 0.0
    cdf = probs.double().cumsum(-1)
    index = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True).squeeze(-1)
    want = torch.minimum(index, (probs > 0).cumsum(-1).argmax(-1))
    assert torch.equal(inverse_cdf(probs, u), want)
    assert bool((index >= 300).any()) and bool((index < 300).any())


@pytest.mark.parametrize("kw, expected", [
    ({"top_k": -1}, [0.5, 0.3, 0.15, 0.05]),
    ({"top_k": 2}, [0.625, 0.375, 0, 0]),
    ({"top_k": -1, "top_p": 0.9}, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
    ({"top_k": -1, "min_p": 0.2}, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
    ({"top_k": -1, "temperature": 2.0}, None),  # p ~ sqrt(q), computed below
])
def test_keyed_draws_follow_the_filtered_distribution(kw, expected):
    q = torch.tensor([0.5, 0.3, 0.15, 0.05])
    vocab = torch.cat([q, torch.full((4,), 1e-12)])  # 4 tokens that every filter drops or that never win
    logits = torch.log(vocab).repeat(40000, 1)[:, torch.tensor([2, 6, 0, 4, 3, 7, 1, 5])]  # scrambled vocab order
    sp = SamplingParams(**{"temperature": 1.0, **kw})
    states = keyed.row_states(11, torch.arange(40000), torch.zeros(40000, dtype=torch.long))
    tokens, _ = sample_next(logits, sp, keyed.uniforms(states, 0))
    freq = torch.bincount(tokens, minlength=8).double() / tokens.numel()
    want = torch.zeros(8, dtype=torch.float64)
    if expected is None:
        expected = (vocab.double().sqrt() / vocab.double().sqrt().sum())[:4].tolist()
    for token, p in zip([2, 6, 0, 4], expected):  # where q's entries landed in the scrambled order
        want[token] = p
    assert (freq - want).abs().max().item() < 0.01, (freq.tolist(), want.tolist())  # 4 sd at p = 0.5 is 0.01
    if kw.get("top_k", -1) > 0 or "top_p" in kw or "min_p" in kw:
        assert freq[want == 0].sum() == 0  # filtered tokens never drawn


def test_sample_next_needs_one_uniform_per_row_unless_greedy():
    logits = torch.randn(3, 8)
    with pytest.raises(ValueError, match="one uniform per row: 3 rows"):
        sample_next(logits, SamplingParams(temperature=1.0), torch.rand(2, dtype=torch.float64))
    tokens, _ = sample_next(logits, SamplingParams(temperature=0.0), None)
    assert tokens.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("width", [sampling.BLOCKED_FROM, sampling.BLOCKED_FROM + 3 * sampling.CDF_BLOCK + 17])
def test_blocked_inverse_cdf_draws_as_the_whole_row_cumulative_sum(width, monkeypatch):
    """Rows wide enough to be drawn by blocks: the same index as the whole row's float64 cumulative
    sum, on rows with zero runs (whole zero blocks, trailing zeros), one positive entry, u up to 1."""
    gen = torch.Generator().manual_seed(3)
    probs = torch.rand(96, width, generator=gen) ** 8
    probs[probs < 0.3] = 0.0
    probs[::5, : 2 * sampling.CDF_BLOCK] = 0.0  # whole blocks without mass
    probs[1::5, width // 2:] = 0.0  # trailing zeros
    probs[2::5] = 0.0
    probs[2::5, width - 1] = 0.5  # a single positive entry, the row's last
    u = torch.rand(96, generator=gen, dtype=torch.float64)
    u[::6] = 1.0
    u[1::6] = 0.0
    u[2::6] = 1 - 2.0 ** -53
    flat = sampling._inverse_cdf_flat
    drawn_flat = []
    monkeypatch.setattr(sampling, "_inverse_cdf_flat", lambda p, v: drawn_flat.append(len(p)) or flat(p, v))
    assert torch.equal(sampling.inverse_cdf(probs, u), flat(probs, u))
    assert sum(drawn_flat) <= 96 // 6 * 2  # only rows whose target rounding put at a block's end (u near 1)


def test_untruncated_sampling_equals_softmax_then_cumulative_sum():
    """The one-exp-pass draw: the tokens of a softmax + whole-row inverse CDF, the log-probs of a
    log-softmax within 1e-6, at a temperature and on a vocabulary drawn by blocks."""
    gen = torch.Generator().manual_seed(4)
    logits = 4 * torch.randn(64, 49152, generator=gen)
    logits[:8, 100:] = float("-inf")  # rows with few tokens allowed
    u = torch.rand(64, generator=gen, dtype=torch.float64)
    tokens, logprobs = sample_next(logits, SamplingParams(temperature=0.5, top_k=-1), u)
    scaled = logits / 0.5
    assert torch.equal(tokens, sampling._inverse_cdf_flat(torch.softmax(scaled, -1), u))
    want = torch.log_softmax(scaled.double(), -1).gather(-1, tokens[:, None]).squeeze(-1)
    assert (logprobs.double() - want).abs().max() < 1e-6
    assert logprobs.dtype == torch.float32
