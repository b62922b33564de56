"""GRPO whose only reward is a reward model (reward_config, rl_config.rule_reward: false) learns.

The reward model (tests/conftest.py ``build_lowercase_reward_model``) scores prompt + response by
its share of lowercase-word tokens, so the policy can raise its score by writing such tokens. A
2-layer random-init Qwen2 raises the score within a dozen iterations.
"""

from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture()
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def rm_only_config(model_dir, rm_dir, data, out, iters):
    from posttrain.config.run import run_config_from_dict

    return run_config_from_dict({
        "megatron_training": {"stage": "ray_grpo", "global_batch_size": 4, "micro_batch_size": 32, "seq_length": 64,
                              "train_iters": iters, "lr": 1e-2, "lr_decay_style": "constant", "weight_decay": 0.0,
                              "tokenizer_name_or_path": str(model_dir), "data_path": data, "seed": 1, "bf16": False,
                              "dataset_additional_keys": ["labels"], "prompt_type": "default"},
        "reward_config": {"load": str(rm_dir), "micro_batch_size": 16},
        "rl_config": {"n_samples_per_prompt": 8, "mini_batch_size": 4, "rule_reward": False, "init_kl_coef": 0.0,
                      "max_prompt_length": 64, "output_dir": str(out), "device": "cpu"},
        "generate_config": {"max_model_len": 64, "max_num_seqs": 256, "infer_tensor_parallel_size": 1,
                            "sampling_config": {"max_tokens": 12, "temperature": 1.0, "top_k": -1, "top_p": 1.0}},
    }, name="grpo_reward_model")


def test_grpo_raises_the_reward_model_score(mini_qwen2_dir, lowercase_rm_dir, tiny_prompt_data, tmp_path,
                                            one_thread):
    from posttrain.commands.train import train_config as train

    iters = 12
    last = train(rm_only_config(mini_qwen2_dir, lowercase_rm_dir, tiny_prompt_data, tmp_path / "run", iters))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    scores = [r["reward_model/score/mean"] for r in rows if "reward_model/score/mean" in r]
    assert len(scores) == iters
    assert sum(scores[-3:]) / 3 > sum(scores[:3]) / 3 + 0.5, scores  # learning, not just running
    for key in ("timing/reward_model", "reward_model/score/max", "reward_model/score/min", "actor/pg_loss"):
        assert key in last, key
    assert "timing/rule_reward" not in last and not any(k.endswith("_rewards/mean") for k in last)  # no verifier ran
    assert last["grpo/score/mean"] == pytest.approx(last["reward_model/score/mean"], rel=1e-6)  # weight 1, no rule
    assert last["reward_model/score/min"] <= last["reward_model/score/mean"] <= last["reward_model/score/max"]
