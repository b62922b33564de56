"""The multi-turn keys (posttrain.config.multi_turn and the seed's rule 21): each bad input fails
before training with a message that names the key or the file; the shipped configs plan."""

from __future__ import annotations

import copy

import pytest

from posttrain.commands.plan import format_plan, model_arch
from posttrain.config.check import check_run_config
from posttrain.config.plan import resolve_plan
from posttrain.config.run import load_run_config, run_config_from_dict
from posttrain.errors import ConfigError

BASE = {
    "megatron_training": {"stage": "ray_dapo", "global_batch_size": 8, "seq_length": 1024, "micro_batch_size": 2,
                          "prompt_type": "qwen_retool"},
    "actor_config": {"micro_batch_size": 2},
    "rl_config": {"n_samples_per_prompt": 4, "mini_batch_size": 4, "verifier_function": ["retool_reward"],
                  "verifier_weight": [1.0], "filter_groups_metric": "retool_reward",
                  "multi_turn_enable": True, "async_engine": True, "tool_config_path": "configs/tools/retool.yaml",
                  "max_tool_calls": 4, "max_total_response_length": 768},
    "generate_config": {"infer_tensor_parallel_size": 1, "max_model_len": 2048, "sampling_config": {"max_tokens": 512}},
}


def check(overrides=(), base=BASE):
    return check_run_config(run_config_from_dict(copy.deepcopy(base), overrides=list(overrides)), device_type="cpu")


def refusal(overrides, base=BASE) -> str:
    with pytest.raises(ConfigError) as err:
        check(overrides, base)
    return str(err.value)


def test_the_multi_turn_keys_are_honoured():
    _, warnings = check(["rl_config.tool_parser_format=hermes", "rl_config.max_parallel_calls=2",
                         "rl_config.max_tool_response_length=512", "rl_config.tool_response_truncate_side=middle"])
    assert not any("tool" in w or "multi_turn" in w or "async_engine" in w for w in warnings)


def test_rule_21_has_the_seeds_messages():
    assert refusal(["rl_config.max_total_response_length=100"]) == \
        "max_total_response_length must greater than max_tokens:100 vs 512"
    assert refusal(["rl_config.async_engine=false"]) == "async_engine must be True when multi_turn_enable is True"


@pytest.mark.parametrize("overrides, words", [
    (["rl_config.tool_config_path=null"], "rl_config.tool_config_path is not set"),
    (["rl_config.tool_config_path=configs/tools/nope.yaml"], "rl_config.tool_config_path=configs/tools/nope.yaml: no such"),
    (["rl_config.max_tool_calls=0"], "rl_config.max_tool_calls=0: must be >= 1"),
    (["rl_config.max_parallel_calls=-1"], "rl_config.max_parallel_calls=-1"),
    (["rl_config.tool_response_truncate_side=top"], "tool_response_truncate_side='top'"),
    (["rl_config.tool_parser_format=xml"], "rl_config.tool_parser_format"),
    (["rl_config.rollout_engine=mine"], "rollout_engine"),  # native and vllm run it; another engine does not
    (["megatron_training.prompt_type=hf_chat_template"], "format_observation"),
    (["megatron_training.prompt_type=null"], "actor_config.prompt_type=None"),
    (["rl_config.partial_rollout_max_split=2", "rl_config.guarantee_order=false"], "partial_rollout_max_split"),
    (["generate_config.num_speculative_tokens=4"], "generate_config.num_speculative_tokens with "
                                                   "rl_config.async_engine / multi_turn_enable"),
])
def test_bad_multi_turn_settings_are_refused_by_key(overrides, words):
    assert words in refusal(overrides)


def test_ppo_is_refused_with_tools():
    base = copy.deepcopy(BASE)
    base["megatron_training"]["stage"] = "ray_ppo"
    base["rl_config"].update(adv_estimator="gae")
    base["critic_config"] = {"micro_batch_size": 2}
    assert "GRPO and DAPO" in refusal([], base)


def test_a_bad_tools_file_is_named_with_its_key(tmp_path):
    bad = tmp_path / "tools.yaml"
    bad.write_text("tools:\n  - class_name: no_such_tool\n    tool_schema: {type: function, function: {name: x, "
                   "description: d, parameters: {type: object, properties: {}}}}\n")
    msg = refusal([f"rl_config.tool_config_path={bad}"])
    assert str(bad) in msg and "tools[0].class_name" in msg and "code_interpreter" in msg


def test_multi_turn_keys_without_the_switch_are_refused():
    base = copy.deepcopy(BASE)
    base["rl_config"].update(multi_turn_enable=False, async_engine=False, tool_config_path=None,
                             max_total_response_length=0)
    assert "rl_config.max_tool_calls is read only with multi_turn_enable: true" in refusal([], base)
    base["rl_config"]["max_tool_calls"] = 0
    check([], base)
    check(["rl_config.async_engine=true"], base)  # alone: the per-request loop without tools
    assert "async_engine" in refusal(["rl_config.async_engine=true", "rl_config.rollout_engine=mine"], base)


def test_the_shipped_multi_turn_configs_plan():
    tiny = load_run_config("dapo_tiny_multi_turn")
    plan = resolve_plan(tiny, model_arch(tiny))
    assert plan.max_response_tokens == 128  # max_total_response_length: a whole conversation
    assert "multi-turn rollout" in format_plan(plan) and "at most 2 calls per sample" in format_plan(plan)
    seed = load_run_config("dapo_qwen25_7b_multi_turn", overrides=["rl_config.ignore_memory_estimate=true"])
    plan = resolve_plan(seed, model_arch(seed), device="cpu")
    assert plan.name == "dapo" and plan.max_response_tokens == 4096 and plan.multi_turn
