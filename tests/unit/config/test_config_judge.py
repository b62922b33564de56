"""rl_config.judge_*: the judge in the plan, and the settings refused with the keys named."""

from __future__ import annotations

import re

import pytest

from posttrain.config.check import check_run_config
from posttrain.config.plan import resolve_plan
from posttrain.errors import ConfigError
from tests.unit.config.test_config_reward_model import config, refusal

JUDGE = ["rl_config.judge_path=/models/judge"]


def test_the_plan_holds_the_judge(tmp_path):
    from posttrain.commands.plan import format_plan
    from posttrain.reward.judge_template import DEFAULT_TEMPLATE

    template = tmp_path / "judge.txt"
    template.write_text("Grade {response} against {reference}: \\boxed{N}")
    cfg = config([*JUDGE, "rl_config.rule_reward=false", f"rl_config.judge_template={template}",
                  "rl_config.judge_parser=boxed", "rl_config.judge_weight=0.5", "rl_config.judge_max_tokens=8",
                  "rl_config.judge_timeout=30", "rl_config.judge_failure_value=-1", "rl_config.judge_temperature=0.7",
                  "rl_config.judge_max_score=5"])
    check_run_config(cfg)
    judge = resolve_plan(cfg, device="cpu").judge
    assert (judge.path, judge.parser, judge.weight, judge.max_tokens, judge.timeout_s, judge.failure_value,
            judge.temperature, judge.max_score, judge.self_judge) == ("/models/judge", "boxed", 0.5, 8, 30.0, -1.0,
                                                                       0.7, 5.0, False)
    assert judge.template == template.read_text()  # the file's text
    plan = resolve_plan(config([*JUDGE[:0], "rl_config.judge_path=policy"]), device="cpu")
    assert plan.judge.self_judge and plan.judge.template == DEFAULT_TEMPLATE and plan.judge.parser == "score"
    assert "LLM judge (in the training process)" in format_plan(plan) and "self-judge" in format_plan(plan)
    assert resolve_plan(config(), device="cpu").judge is None


@pytest.mark.parametrize("overrides,message", [
    (["rl_config.judge_weight=2"], r"^rl_config.judge_weight=2.0: there is no judge \(rl_config.judge_path is not "
                                   r"set\); remove the key, or set judge_path"),
    ([*JUDGE, "rl_config.judge_parser=Score (\\d+) of (\\d+)"],
     r"^rl_config.judge_parser=.*: the regex needs exactly one capture group around the score \(it has 2\)"),
    ([*JUDGE, "rl_config.judge_parser='([0-9'"], r"^rl_config.judge_parser=.*not a valid regex .*; or use one "
                                                       r"of score, boxed"),
    ([*JUDGE, "rl_config.judge_template=/no/such/template.txt"],
     r"^rl_config.judge_template='/no/such/template.txt': neither a template \(it lacks \{response\}\) nor an "
     r"existing file"),
    ([*JUDGE, "rl_config.rule_reward=false", "rl_config.judge_weight=0"],
     r"^rl_config.judge_weight=0 with rule_reward=false and no reward_config: every score would be 0"),
    ([*JUDGE, "rl_config.judge_timeout=0"], r"^rl_config.judge_timeout=0: must be a finite number > 0"),
    ([*JUDGE, "rl_config.actor_resource.num_npus=2"],
     r"rl_config.judge_path=/models/judge: a judge in Ray actor workers is not built \(the judge runs in the "
     r"training process on the hf backend, docs/rewards.md\); remove rl_config.judge_path or run in one process"),
    ([*JUDGE, "rl_config.async_staleness=1"], r"rl_config.judge_path=/models/judge with rl_config.async_staleness: the "
                                              r"judge scores in the loop that generates.*; remove rl_config.judge_path "
                                              r"or rl_config.async_staleness$"),
    (["rl_config.judge_path=policy", "rl_config.rollout_engine=vllm"],
     r"rl_config.judge_path=policy with rollout_engine 'vllm': the self-judge samples the actor's HF model with the "
     r"native engine"),
])
def test_refusals_name_the_keys(overrides, message):
    got = refusal(overrides)
    assert re.search(message, got, re.MULTILINE), got


def test_offline_stages_refuse_a_judge():
    from tests.unit.config.test_config_reward_model import BASE
    import copy

    base = copy.deepcopy(BASE)
    base["megatron_training"].update(stage="dpo", is_pairwise_dataset=True)
    assert "rl_config.judge_path=/models/judge: stage dpo scores no responses" in refusal(JUDGE, base)


def test_a_judge_alone_may_score():
    """rule_reward: false with neither a reward model nor a judge is refused; with a judge it runs."""
    check_run_config(config([*JUDGE, "rl_config.rule_reward=false"]))
    with pytest.raises(ConfigError, match="set rl_config.judge_path"):
        check_run_config(config(["rl_config.rule_reward=false"]))
