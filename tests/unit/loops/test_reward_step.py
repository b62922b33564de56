"""The on-policy reward step with a reward model (reward_config): score = rule score + weight x model score,
exactly, with the reward model's own timing and metrics."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from posttrain.reward.verifiers import register_verifier


@register_verifier("test_rm_digit_share", overwrite=True)
def digit_share(response: str, label: str, **_) -> float:
    """A dense rule score: the share of digits in the response."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def _config(model_dir, rm_dir, weight):
    from posttrain.config.run import run_config_from_dict

    return run_config_from_dict({
        "megatron_training": {"stage": "ray_grpo", "global_batch_size": 2, "micro_batch_size": 4, "seq_length": 64,
                              "train_iters": 1, "tokenizer_name_or_path": str(model_dir), "bf16": False},
        "reward_config": {"load": str(rm_dir), "micro_batch_size": 4},
        "rl_config": {"n_samples_per_prompt": 4, "mini_batch_size": 2, "verifier_function": ["test_rm_digit_share"],
                      "verifier_weight": [2.0], "verifier_parallel": 0, "reward_model_weight": weight,
                      "guarantee_order": True, "device": "cpu"},
        "generate_config": {"max_model_len": 64, "infer_tensor_parallel_size": 1,
                            "sampling_config": {"max_tokens": 8}},
    }, name="reward_step")



def dock_of_responses(prompts: list[list[int]], responses: list[list[int]]):
    """A dock of two prompts (token lists) with 4 samples each, holding ``responses`` (8 token lists)."""
    from posttrain.loops.experience import new_dock

    td = new_dock(8, 4, guarantee_order=True, seed=0)
    td.put_prompts({"prompts": [torch.tensor(p) for p in prompts], "prompt_length": [len(p) for p in prompts],
                    "labels": [torch.tensor([0]), torch.tensor([0])]})
    td.put(["responses", "response_length"], list(range(8)),
           [[torch.tensor(r) for r in responses], [len(r) for r in responses]])
    return td

def test_reward_step_adds_the_weighted_reward_model_score_to_the_rule_score(tiny_model_dir, tiny_tokenizer,
                                                                             lowercase_rm_dir):
    from posttrain.config.plan import resolve_plan
    from posttrain.metrics.reduce import MetricAccumulator
    from posttrain.metrics.timers import Timers
    from posttrain.reward.reward_model import RewardModelScorer
    from posttrain.reward.rule_reward import RuleReward
    from posttrain.roles.reward_model import build_reward_scorer
    from posttrain.loops.produce import Producer

    tok, weight = tiny_tokenizer, 0.375
    cfg = _config(tiny_model_dir, lowercase_rm_dir, weight)
    plan = resolve_plan(cfg, device="cpu")
    assert plan.reward_model.weight == weight and plan.reward_model.micro_batch_size == 4
    assert plan.reward_model.dtype == "float32" and plan.reward_model.path == str(lowercase_rm_dir)
    rule = RuleReward(["test_rm_digit_share"], [2.0], verifier_parallel=0)
    session = SimpleNamespace(trainer_state={}, policy=SimpleNamespace(tokenizer=tok), rule_reward=rule,
                              reward_model=build_reward_scorer(plan.reward_model, tok, "cpu"))
    producer = Producer(plan, session)

    rng = random.Random(0)
    words = ["the answer is", "7", "12 + 30", "think", "x y z", "42"]
    prompts = [tok("What is 3 + 4?")["input_ids"], tok("Sum 9 and 1")["input_ids"]]
    responses = [tok(" ".join(rng.choice(words) for _ in range(3)))["input_ids"] for _ in range(8)]
    td = dock_of_responses(prompts, responses)
    acc, timers = MetricAccumulator(), Timers()
    producer.reward(td, acc, timers)

    got, _ = td.get("metrics", ["scores"], indexes=list(range(8)))
    got = torch.cat([s.reshape(-1) for s in got["scores"]])
    row_prompts = [prompts[i // 4] for i in range(8)]
    rule_scores = rule.score([tok.decode(r, skip_special_tokens=True) for r in responses], [""] * 8)[0]
    direct = RewardModelScorer(str(lowercase_rm_dir), batch_size=4).score_sequences(row_prompts, responses)
    want = torch.tensor([r + weight * m for r, m in zip(rule_scores, direct)], dtype=torch.float32)
    assert torch.equal(got, want)
    assert len(set(direct)) > 1 and len(set(rule_scores)) > 1  # both parts vary, so the sum is a real check
    metrics = acc.reduce()
    assert metrics["reward_model/score/mean"] == pytest.approx(sum(direct) / 8)
    assert metrics["reward_model/score/max"] == pytest.approx(max(direct))
    assert metrics["reward_model/score/min"] == pytest.approx(min(direct))
    assert metrics["test_rm_digit_share_rewards/mean"] == pytest.approx(sum(rule_scores) / 2 / 8)
    assert {"timing/rule_reward", "timing/reward_model"} <= set(timers.metrics())
