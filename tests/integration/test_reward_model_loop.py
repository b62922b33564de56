"""GRPO whose only reward is a reward model (reward_config, rl_config.rule_reward: false) learns.

The reward model (tests/conftest.py ``build_lowercase_reward_model``) scores prompt + response by
its share of lowercase-word tokens, so the policy can raise its score by writing such tokens. A
2-layer random-init Qwen2 raises the score within a dozen iterations.
"""

from __future__ import annotations

import pytest

from tests.helpers.configs import OMIT, run_config
from tests.helpers.runs import read_metrics


def rm_only_config(model_dir, rm_dir, data, out, iters):
    return run_config(model_dir, data, out, name="grpo_reward_model", iters=iters,
                      megatron_training={"micro_batch_size": 32, "lr": 1e-2, "prompt_type": "default"},
                      reward_config={"load": str(rm_dir), "micro_batch_size": 16},
                      rl_config={"mini_batch_size": 4, "rule_reward": False, "verifier_function": OMIT,
                                 "verifier_weight": OMIT, "verifier_modules": OMIT, "verifier_parallel": OMIT})


def test_grpo_raises_the_reward_model_score(mini_qwen2_dir, lowercase_rm_dir, tiny_prompt_data, tmp_path,
                                            one_thread):
    from posttrain.commands.train import train_config as train

    iters = 12
    last = train(rm_only_config(mini_qwen2_dir, lowercase_rm_dir, tiny_prompt_data, tmp_path / "run", iters))
    rows = read_metrics(tmp_path / "run")
    scores = [r["reward_model/score/mean"] for r in rows if "reward_model/score/mean" in r]
    assert len(scores) == iters
    assert sum(scores[-3:]) / 3 > sum(scores[:3]) / 3 + 0.5, scores  # learning, not just running
    for key in ("timing/reward_model", "reward_model/score/max", "reward_model/score/min", "actor/pg_loss"):
        assert key in last, key
    assert "timing/rule_reward" not in last and not any(k.endswith("_rewards/mean") for k in last)  # no verifier ran
    assert last["grpo/score/mean"] == pytest.approx(last["reward_model/score/mean"], rel=1e-6)  # weight 1, no rule
    assert last["reward_model/score/min"] <= last["reward_model/score/mean"] <= last["reward_model/score/max"]
