"""GRPO whose only reward is an LLM judge (rl_config.judge_path, rule_reward: false) learns.

The judge (tests/helpers/judge.py) is a tiny causal LM fine-tuned to reply "10" after a response that
ends with a lowercase word and "0" otherwise; it generates through its own native engine, and its
reply is read by a custom parser (``^(\\d+)``) and normalised by ``judge_max_score`` 10. A 2-layer
random-init Qwen2 policy raises the judge's score within a few iterations.
"""

from __future__ import annotations

import pytest

from tests.helpers.configs import OMIT, run_config
from tests.helpers.judge import PARSER, TEMPLATE
from tests.helpers.runs import read_metrics


def judge_only_config(model_dir, judge_dir, data, out, iters):
    return run_config(model_dir, data, out, name="grpo_judge", iters=iters,
                      megatron_training={"micro_batch_size": 32, "lr": 1e-2, "prompt_type": "default"},
                      rl_config={"mini_batch_size": 4, "rule_reward": False, "verifier_function": OMIT,
                                 "verifier_weight": OMIT, "verifier_modules": OMIT, "verifier_parallel": OMIT,
                                 "judge_path": str(judge_dir), "judge_template": TEMPLATE, "judge_parser": PARSER,
                                 "judge_max_tokens": 3, "judge_weight": 2.0},
                      generate_config={"sampling_config": {"max_tokens": 3, "temperature": 1.0, "top_k": -1,
                                                           "top_p": 1.0}})


def test_grpo_raises_the_judge_score(mini_qwen2_dir, lowercase_judge_dir, tiny_prompt_data, tmp_path, one_thread):
    from posttrain.commands.train import train_config as train

    iters = 16
    last = train(judge_only_config(mini_qwen2_dir, lowercase_judge_dir, tiny_prompt_data, tmp_path / "run", iters))
    rows = read_metrics(tmp_path / "run")
    scores = [r["judge/score/mean"] for r in rows if "judge/score/mean" in r]
    assert len(scores) == iters
    assert sum(scores[-3:]) / 3 > sum(scores[:3]) / 3 + 0.3, scores  # learning, not just running
    for key in ("timing/judge", "judge/score/max", "judge/score/min", "judge/parse_failures", "judge/timeouts",
                "judge/latency_s", "actor/pg_loss"):
        assert key in last, key
    assert last["judge/timeouts"] == 0 and last["judge/parse_failures"] < 0.2
    assert "timing/rule_reward" not in last and not any(k.endswith("_rewards/mean") for k in last)  # no verifier ran
    assert last["grpo/score/mean"] == pytest.approx(2.0 * last["judge/score/mean"], rel=1e-6)  # judge_weight 2
