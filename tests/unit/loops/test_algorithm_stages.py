"""The loop stages the algorithms add, driven without models: DAPO dynamic sampling, PPO advantages, DPO batches."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from posttrain.algo.kl import build_kl_controller
from posttrain.config.options import DynamicSamplingOptions
from posttrain.config.plan import resolve_plan
from posttrain.config.run import run_config_from_dict
from posttrain.errors import DataError
from posttrain.metrics.reduce import MetricAccumulator
from posttrain.metrics.stats import stat_metrics
from posttrain.metrics.timers import Timers
from posttrain.loops.dynamic_sampling import DynamicSampler, keep_groups, metric_column, score_columns
from posttrain.loops.experience import new_dock
from posttrain.loops.ppo import CriticPhases


# ---- DAPO dynamic sampling -------------------------------------------------------------------------
def test_keep_groups_by_std():
    scores = np.array([1, 1, 1, 0, 1, 0, 0.5, 0.5, 0, 0, 0, 0], dtype=float)
    assert keep_groups(scores, 3).tolist() == [1, 2]  # groups [1,1,1] [0,1,0] [.5,.5,0] [0,0,0]
    assert keep_groups(np.array([0.0, 1.0, 1.0]), 1).tolist() == [0, 1, 2]  # n == 1 keeps everything


class ScriptedGeneration:
    """A ``generate_and_score`` with scripted scores: ``plans[k]`` = group scores of batch k."""

    def __init__(self, n, gbs, plans):
        self.n, self.gbs, self.plans, self.batch, self.seeds = n, gbs, plans, 0, []

    def __call__(self, td, iteration, timers, acc):
        first = self.batch * self.gbs
        td.put_prompts({"prompts": [torch.tensor([first + p]) for p in range(self.gbs)],
                        "prompt_length": [1] * self.gbs, "labels": [torch.tensor([0])] * self.gbs})
        self.seeds.append(iteration)
        rows = list(range(td.max_len))
        td.put(["responses", "response_length", "rollout_logprobs", "policy_version"], rows,
               [[torch.tensor([7, r]) for r in rows], [2] * len(rows), [torch.zeros(2)] * len(rows), [0] * len(rows)])
        per_group = self.plans[self.batch]
        scores = [float(s) for group in per_group for s in group]
        td.put(["scores"], rows, [torch.tensor(scores)])
        names, values = score_columns(td, {"acc": scores, "format": [1.0] * len(scores)})
        assert names == [metric_column("acc")]  # only the filter metric has a column
        td.put(names, rows, values)
        acc.update({"acc_rewards/mean": sum(scores) / len(scores)})
        self.batch += 1


def _sampler(max_batches: int = 0) -> DynamicSampler:
    """n = 2 samples, generation batches of 3 prompts, 3 prompts to fill."""
    return DynamicSampler(DynamicSamplingOptions(metric="acc", max_batches=max_batches), n=2, global_batch_size=3,
                          train_prompts=3, seed=0)


def _main_td(sampler):
    return new_dock(sampler.train_rows, sampler.n, guarantee_order=False, seed=0)


def test_dynamic_sampling_fills_the_batch_from_varying_groups():
    plans = [[(1, 1), (0, 1), (0, 0)],        # batch 1 keeps group 1 (prompt 1)
             [(0, 0), (0, 0), (1, 1)],        # batch 2 keeps nothing
             [(1, 0), (0, 1), (0.5, 1)]]      # batch 3 keeps all three; only two fit
    trainer, sampler = ScriptedGeneration(2, 3, plans), _sampler()
    td, acc = _main_td(sampler), MetricAccumulator()
    sampler.fill(trainer, td, Timers(), acc, iteration=5)
    assert sampler.metrics() == {"train/num_gen_batches": 3.0}
    batch, _ = td.get("metrics", ["prompts", "scores", "responses"], indexes=list(range(6)))
    assert [int(p[0]) for p in batch["prompts"]] == [1, 1, 6, 6, 7, 7]  # prompt ids: batch*gbs + p
    assert [float(s) for s in batch["scores"]] == [0, 1, 1, 0, 0, 1]
    assert [int(r[1]) for r in batch["responses"]] == [2, 3, 0, 1, 2, 3]  # the rows of those groups
    assert acc.reduce()["dapo/num_kept_groups"] == 4.0
    assert trainer.seeds[0] == 5 and len(set(trainer.seeds)) == 3  # a fresh rollout seed per batch


def test_dynamic_sampling_raises_the_seed_error_at_the_cap():
    plans = [[(0, 0), (1, 1), (0, 1)], [(1, 1), (1, 1), (1, 1)]]
    sampler = _sampler(max_batches=2)
    with pytest.raises(DataError, match=r"^Generated too many. Please check your data. \(2 generation batch"):
        sampler.fill(ScriptedGeneration(2, 3, plans), _main_td(sampler), Timers(), MetricAccumulator(), iteration=1)


def test_dynamic_sampling_default_cap_of_one_batch():
    sampler = _sampler(max_batches=1)
    with pytest.raises(DataError, match="Generated too many"):
        sampler.fill(ScriptedGeneration(2, 3, [[(0, 1), (0, 0), (0, 0)]]), _main_td(sampler), Timers(),
                     MetricAccumulator(), iteration=1)


# ---- PPO: token rewards, KL in reward, GAE ---------------------------------------------------------
PPO = {
    "megatron_training": {"stage": "ray_ppo", "global_batch_size": 1, "seq_length": 64, "micro_batch_size": 2},
    "rl_config": {"n_samples_per_prompt": 2, "mini_batch_size": 1, "adv_estimator": "gae", "gamma": 1.0,
                  "lam": 1.0, "use_kl_in_reward": True, "kl_penalty": "kl", "init_kl_coef": 0.5},
    "generate_config": {"infer_tensor_parallel_size": 1, "max_model_len": 64},
}


def _critic_without_model(cfg):
    phases = CriticPhases.__new__(CriticPhases)  # the advantage phase needs no model
    phases.plan = resolve_plan(cfg)
    return phases


def test_ppo_advantages_with_kl_in_reward_by_hand():
    cfg = run_config_from_dict(copy.deepcopy(PPO))
    td = new_dock(2, 2, guarantee_order=False, seed=0)
    td.put(["scores", "response_length", "values", "old_logprobs", "ref_logprobs"], [0, 1], [
        [torch.tensor([1.0]), torch.tensor([0.0])], [3, 2],
        [torch.tensor([0.5, 0.5, 0.5]), torch.tensor([0.0, 0.0])],
        [torch.tensor([-1.0, -1.0, -1.0]), torch.tensor([-1.0, -2.0])],
        [torch.tensor([-1.2, -1.0, -0.8]), torch.tensor([-1.0, -1.0])]])
    acc, kl = MetricAccumulator(), build_kl_controller("fixed", init_kl_coef=0.5)
    _critic_without_model(cfg).advantages(td, acc, kl)
    batch, _ = td.get("actor_update", ["advantages", "returns"], indexes=[0, 1])
    # row 0: kld = old - ref = [0.2, 0, -0.2]; rewards = [-0.1, 0, 0.1 + 1]; returns = reverse cumsum
    assert torch.allclose(batch["returns"][0], torch.tensor([1.0, 1.1, 1.1]), atol=1e-6)
    # row 1: kld = [0, -1]; rewards = [0, 0.5 + 0]
    assert torch.allclose(batch["returns"][1], torch.tensor([0.5, 0.5]), atol=1e-6)
    gae = torch.tensor([0.5, 0.6, 0.6, 0.5, 0.5])  # returns - values, then whitened over the 5 tokens
    whitened = (gae - gae.mean()) / torch.sqrt(gae.var() + 1e-8)
    assert torch.allclose(torch.cat(batch["advantages"]), whitened, atol=1e-4)
    m = acc.reduce()
    assert m["actor/reward_kl_penalty"] == pytest.approx((0.0 + (-0.5)) / 2)  # mean over rows of token means
    assert m["critic/returns/max"] == pytest.approx(1.1) and m["critic/values/mean"] == pytest.approx(0.3)


def test_critic_stats_ignore_padding():
    x = torch.tensor([[1.0, 5.0, 9.0], [-2.0, 0.0, 100.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert stat_metrics("critic/values", x, mask) == {"critic/values/mean": pytest.approx(4 / 3),
                                                      "critic/values/max": 5.0, "critic/values/min": -2.0}


# ---- DPO batches ------------------------------------------------------------------------------------
def test_pair_batch_splits_prompt_and_answers():
    from posttrain.loops.dpo import pair_batch

    item = {"chosen_input_ids": np.array([5, 6, 7, 8]), "chosen_labels": np.array([-100, -100, 7, 8]),
            "rejected_input_ids": np.array([5, 6, 9]), "rejected_labels": np.array([-100, -100, 9])}
    batch = pair_batch([item], pad_token_id=0)
    assert batch["chosen_input_ids"].tolist() == [[5, 6, 7, 8]]
    assert batch["chosen_response_mask"].tolist() == [[1, 1]]
    assert batch["rejected_input_ids"].tolist() == [[5, 6, 9]]
    assert batch["rejected_response_mask"].tolist() == [[1]]
