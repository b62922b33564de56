"""Every vectorised advantage estimator against a slow, loop-by-loop reference written from the paper.

The references use plain Python floats over the valid tokens of each row (the mask may have holes,
as multi-turn tool output does), so they share no code with ``posttrain.algo.advantages``.
"""

import math
import random

import pytest
import torch

from posttrain.algo.advantages import ADVANTAGE_ESTIMATORS, scores_to_token_level_rewards
from posttrain.algo.aggregation import aggregate_loss
from posttrain.algo.policy_loss import actor_loss


def _random_batch(seed, groups=3, group_size=4, width=7, holes=True):
    rng = random.Random(seed)
    rows = groups * group_size
    mask = torch.zeros(rows, width)
    for i in range(rows):
        length = rng.randint(1, width)
        mask[i, :length] = 1
        if holes and length > 3 and rng.random() < 0.5:
            mask[i, rng.randint(1, length - 2)] = 0  # a masked token inside the response
    scores = torch.tensor([float(rng.choice([0, 0, 1, 0.5, 2])) for _ in range(rows)])
    rewards = scores_to_token_level_rewards(scores, mask)
    values = torch.tensor([[rng.uniform(-1, 1) for _ in range(width)] for _ in range(rows)]) * mask
    return rewards, mask, values


def _valid(mask, i):
    return [t for t in range(mask.shape[1]) if mask[i, t] > 0]


def _row_scores(rewards, mask):
    return [sum(float(rewards[i, t]) for t in _valid(mask, i)) for i in range(mask.shape[0])]


def _whiten_ref(values_by_pos):
    """(x - mean) / sqrt(unbiased var + 1e-8) over all valid tokens of the batch."""
    xs = list(values_by_pos.values())
    mean = sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)
    return {k: (x - mean) / math.sqrt(var + 1e-8) for k, x in values_by_pos.items()}


def _broadcast_ref(per_row, mask):
    out = torch.zeros(mask.shape)
    for i, a in enumerate(per_row):
        for t in _valid(mask, i):
            out[i, t] = a
    return out


def ref_group_norm(rewards, mask, group_size, std=True):
    r = _row_scores(rewards, mask)
    out = []
    for g in range(0, len(r), group_size):
        grp = r[g:g + group_size]
        mean = sum(grp) / len(grp)
        sd = math.sqrt(sum((x - mean) ** 2 for x in grp) / (len(grp) - 1))
        out += [(x - mean) / (sd + 1e-6) if std else x - mean for x in grp]
    return _broadcast_ref(out, mask)


def ref_rloo(rewards, mask, group_size):
    r = _row_scores(rewards, mask)
    out = []
    for g in range(0, len(r), group_size):
        grp = r[g:g + group_size]
        out += [x - (sum(grp) - x) / (len(grp) - 1) for x in grp]
    return _broadcast_ref(out, mask)


def _returns_ref(rewards, mask, gamma):
    out = {}
    for i in range(mask.shape[0]):
        running = 0.0
        for t in reversed(_valid(mask, i)):
            running = float(rewards[i, t]) + gamma * running
            out[(i, t)] = running
    return out


def ref_reinforce_pp(rewards, mask, gamma):
    whitened = _whiten_ref(_returns_ref(rewards, mask, gamma))
    adv = torch.zeros(mask.shape)
    for (i, t), x in whitened.items():
        adv[i, t] = x
    return adv


def ref_reinforce_pp_baseline(rewards, mask, group_size, gamma):
    r = _row_scores(rewards, mask)
    shaped = rewards.clone()
    for g in range(0, len(r), group_size):
        mean = sum(r[g:g + group_size]) / group_size
        for i in range(g, g + group_size):
            shaped[i, _valid(mask, i)[-1]] -= mean
    return ref_reinforce_pp(shaped, mask, gamma)


def ref_gae(rewards, mask, values, gamma, lam):
    gae, returns = {}, {}
    for i in range(mask.shape[0]):
        valid = _valid(mask, i)
        running, next_value = 0.0, 0.0
        for t in reversed(valid):
            delta = float(rewards[i, t]) + gamma * next_value - float(values[i, t])
            running = delta + gamma * lam * running
            gae[(i, t)], returns[(i, t)] = running, running + float(values[i, t])
            next_value = float(values[i, t])
    adv, ret = torch.zeros(mask.shape), torch.zeros(mask.shape)
    for (i, t), x in _whiten_ref(gae).items():
        adv[i, t] = x
        ret[i, t] = returns[(i, t)]
    return adv, ret


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_group_estimators_match_references(seed):
    rewards, mask, _ = _random_batch(seed)
    adv, _ = ADVANTAGE_ESTIMATORS.get("group_norm")(rewards, mask, group_size=4)
    assert torch.allclose(adv, ref_group_norm(rewards, mask, 4), atol=1e-5)
    adv, _ = ADVANTAGE_ESTIMATORS.get("dr_grpo")(rewards, mask, group_size=4)
    assert torch.allclose(adv, ref_group_norm(rewards, mask, 4, std=False), atol=1e-6)
    adv, _ = ADVANTAGE_ESTIMATORS.get("rloo")(rewards, mask, group_size=4)
    assert torch.allclose(adv, ref_rloo(rewards, mask, 4), atol=1e-6)


@pytest.mark.parametrize("seed,gamma", [(0, 1.0), (1, 0.9), (2, 0.5)])
def test_reinforce_plus_plus_matches_reference(seed, gamma):
    rewards, mask, _ = _random_batch(seed)
    rewards = rewards + 0.1 * mask * torch.arange(mask.shape[1])  # per-token rewards (e.g. a KL penalty)
    adv, _ = ADVANTAGE_ESTIMATORS.get("reinforce_plus_plus")(rewards, mask, gamma=gamma)
    assert torch.allclose(adv, ref_reinforce_pp(rewards, mask, gamma), atol=1e-4)
    adv, _ = ADVANTAGE_ESTIMATORS.get("reinforce_plus_plus_baseline")(rewards, mask, group_size=4, gamma=gamma)
    assert torch.allclose(adv, ref_reinforce_pp_baseline(rewards, mask, 4, gamma), atol=1e-4)


@pytest.mark.parametrize("seed,gamma,lam", [(0, 1.0, 1.0), (1, 1.0, 0.95), (2, 0.9, 0.8)])
def test_gae_matches_reference(seed, gamma, lam):
    rewards, mask, values = _random_batch(seed)
    adv, ret = ADVANTAGE_ESTIMATORS.get("gae")(rewards, mask, values=values, gamma=gamma, lam=lam)
    ref_adv, ref_ret = ref_gae(rewards, mask, values, gamma, lam)
    assert torch.allclose(ret, ref_ret, atol=1e-5)
    assert torch.allclose(adv, ref_adv, atol=1e-4)


def test_gae_seed_values():
    mask = torch.ones(1, 3)
    adv, ret = ADVANTAGE_ESTIMATORS.get("gae")(torch.tensor([[1.0, 2.0, 3.0]]), mask,
                                              values=torch.tensor([[0.5, 1.0, 1.5]]), gamma=0.0, lam=1.0)
    assert torch.allclose(adv, torch.tensor([[-1.0, 0.0, 1.0]]), atol=1e-4)
    assert torch.allclose(ret, torch.tensor([[1.0, 2.0, 3.0]]))


def test_seq_mean_token_sum_norm_by_hand():
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # (1 + 2 + 4) / 2 rows / 3 columns (default length: the padded width)
    assert aggregate_loss(loss_mat, mask, mode="seq-mean-token-sum-norm").item() == pytest.approx(7 / 6)
    # a constant length (the generation budget) instead, here 10
    assert aggregate_loss(loss_mat, mask, mode="seq-mean-token-sum-norm", norm_length=10).item() == pytest.approx(0.35)
    # micro-batches with the mini-batch row count sum to the whole
    parts = [aggregate_loss(loss_mat[i:i + 1], mask[i:i + 1], mode="seq-mean-token-sum-norm", num_seqs=2,
                            norm_length=10) for i in range(2)]
    assert sum(parts).item() == pytest.approx(0.35)


def test_actor_loss_threads_norm_length_into_every_term():
    logp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    entropy = torch.ones(2, 3)
    loss, metrics = actor_loss(logp, logp.detach(), adv, mask, entropy=entropy, entropy_coeff=0.1,
                               loss_agg_mode="seq-mean-token-sum-norm", norm_length=4.0)
    # ratio 1: pg = sum(-A * M) / (2 rows * 4) = (-1 - 1 + 2) / 8 = 0; entropy = 3 / 8
    assert metrics["actor/pg_loss"].item() == pytest.approx(0.0)
    assert metrics["actor/entropy"].item() == pytest.approx(3 / 8)
    assert loss.item() == pytest.approx(-0.1 * 3 / 8)
    loss.backward()
    assert torch.allclose(logp.grad, -adv * mask / 8)


def test_outcome_score_lands_on_the_last_valid_token_of_a_mask_with_holes():
    mask = torch.tensor([[1, 1, 1, 0, 1, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    rewards = scores_to_token_level_rewards(torch.tensor([2.0, 3.0, 4.0]), mask)
    assert rewards.tolist() == [[0, 0, 0, 0, 2, 0], [3, 0, 0, 0, 0, 0], [0] * 6]
