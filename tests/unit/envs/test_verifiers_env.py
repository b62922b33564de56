"""posttrain.envs: a verifiers (0.4.0) taskset as the prompts and the reward of a run.

* the reward of a response is the taskset's own weighted score (checked against the reward
  functions called by hand: tests/unit/envs/letters_taskset.py);
* the prompts are the tasks' messages rendered with the run's template; the labels name the task;
* the config key is checked, and the combinations that are not built are refused;
* a tiny GRPO run on the taskset raises its reward (learning, not just running).
"""

from __future__ import annotations

import pytest

pytest.importorskip("verifiers.v1")

from posttrain.envs.config import env_options  # noqa: E402
from posttrain.errors import ConfigError  # noqa: E402
from tests.helpers.configs import OMIT, run_config  # noqa: E402
from tests.unit.envs import letters_taskset as letters  # noqa: E402

TASKSET = "tests.unit.envs.letters_taskset"


def env(ident=TASKSET, **args):
    from posttrain.envs.verifiers_tasks import load_tasks

    return load_tasks(env_options({"type": "verifiers", "id": ident, "args": args}))


def test_reward_is_the_tasksets_own_weighted_score():
    from posttrain.envs.reward import EnvReward

    tasks = env(num_tasks=4)
    replies = ["apple pie", "RIVER", "a stone!", "", "cloud", "Maple"]
    labels = ["0", "1", "2", "3", "3", "0"]
    batch = EnvReward(tasks).score_detailed(replies, labels)
    words = [letters.WORDS[int(i)] for i in labels]
    expected = [letters.LOWERCASE_WEIGHT * letters.lowercase_fraction(r) + letters.ECHO_WEIGHT * letters.echoes(r, w)
                for r, w in zip(replies, words)]
    assert batch.scores == pytest.approx(expected, abs=1e-12)
    assert batch.per_verifier["echo"] == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert batch.metrics["lowercase_rewards/mean"] == pytest.approx(
        sum(map(letters.lowercase_fraction, replies)) / len(replies))
    named = env(TASKSET + ":LettersTaskset", num_tasks=4)  # module:Class names the same taskset
    assert EnvReward(named).score_detailed(replies, labels).scores == batch.scores
    with pytest.raises(ConfigError, match="not a task index"):
        EnvReward(tasks).score_detailed(["x"], ["9"])


def test_prompts_are_the_tasks_messages_in_the_run_template(tiny_tokenizer):
    from posttrain.data.templates import get_template
    from posttrain.envs.dataset import EnvPromptDataset
    from posttrain.reward.decoding import decode_labels

    tasks = env(num_tasks=3, system="Answer in lowercase.")
    template = get_template("trl")
    ds = EnvPromptDataset(tasks, tiny_tokenizer, template, max_prompt_length=512)
    assert len(ds) == 3
    for i in range(3):
        messages = [{"role": "user", "content": f"Write the word {letters.WORDS[i]}."}]
        text = template.render_prompt(messages, system="Answer in lowercase.", tokenizer=tiny_tokenizer)
        assert "Answer in lowercase." in text
        assert ds[i]["prompts"].tolist() == tiny_tokenizer.encode(text, add_special_tokens=False)
    assert decode_labels(tiny_tokenizer, [ds[i]["labels"].tolist() for i in range(3)]) == ["0", "1", "2"]
    short = EnvPromptDataset(tasks, tiny_tokenizer, template, max_prompt_length=len(ds[0]["prompts"]))
    assert short.num_filtered == 3 - len(short)  # prompts of max_prompt_length tokens or more are dropped


@pytest.mark.parametrize("raw, match", [
    ({"type": "verifiers", "id": TASKSET, "max_turns": 2}, "max_turns belong to type: openenv"),
    ({"type": "gym", "id": "x"}, "not an environment type"),
    ({"type": "verifiers"}, r"env_config.id: give"),
    ({"type": "verifiers", "id": "x", "tools": 1}, "unknown key"),
    ({"type": "verifiers", "id": "x", "limit": 0}, "limit must be"),
    ({"type": "verifiers", "id": "no_such_taskset_module"}, "cannot load the verifiers taskset"),
    ({"type": "verifiers", "id": TASKSET, "args": {"num_taskz": 2}}, "env_config.args: not a valid LettersConfig"),
])
def test_bad_env_config_names_the_key(raw, match):
    from posttrain.envs.verifiers_tasks import load_tasks

    with pytest.raises(ConfigError, match=match):
        load_tasks(env_options(raw))


def test_the_docs_check_knows_the_keys_of_env_config():
    from posttrain.envs.config import KEYS
    from tests.unit.docs.test_docs_keys import DICT_KEYS

    assert DICT_KEYS["env_config"] == KEYS


def env_config(root, model_dir, iters=1, **rl):
    return run_config(model_dir, None, root / "out", name="grpo_env", iters=iters,
                      megatron_training={"micro_batch_size": 32, "lr": 1e-2, "data_path": OMIT},
                      rl_config={"mini_batch_size": 4, "verifier_function": OMIT, "verifier_weight": OMIT,
                                 "verifier_modules": OMIT, "verifier_parallel": OMIT,
                                 "env_config": {"type": "verifiers", "id": TASKSET, "args": {"num_tasks": 8}}, **rl})


@pytest.mark.parametrize("rl, match", [
    ({"multi_turn_enable": True, "tool_config_path": "x.yaml", "max_tool_calls": 1}, "with rl_config.multi_turn_enable"),
    ({"filter_groups_enable": True}, "filter_groups_enable"),
    ({"verifier_function": ["acc"]}, "the reward is the environment's own"),
    ({"overlong_buffer_enable": True, "verifier_timeout": 3}, "verifier_timeout, rl_config.overlong_buffer_enable: "),
    ({"rule_reward": False}, "rule_reward: false: with rl_config.env_config"),
    ({"eval_data_path": "some/prefix"}, "held-out evaluation"),
])
def test_combinations_not_built_are_refused(tmp_path, mini_qwen2_dir, rl, match):
    from posttrain.config.plan import resolve_plan

    with pytest.raises(ConfigError, match=match):
        resolve_plan(env_config(tmp_path, mini_qwen2_dir, **rl))


@pytest.mark.slow
def test_grpo_on_a_verifiers_taskset_raises_its_reward(tmp_path, mini_qwen2_dir, one_thread):
    from posttrain.commands.train import train_config as train
    from tests.helpers.runs import read_metrics

    iters = 10
    last = train(env_config(tmp_path, mini_qwen2_dir, iters=iters))
    rows = [r for r in read_metrics(tmp_path / "out") if "grpo/score/mean" in r]
    scores = [r["grpo/score/mean"] for r in rows]
    assert len(scores) == iters
    print("env GRPO scores", [round(s, 3) for s in scores])
    assert sum(scores[-3:]) / 3 > sum(scores[:3]) / 3 + 0.2, scores  # learning, not just running
    assert {"lowercase_rewards/mean", "echo_rewards/mean", "timing/rule_reward"} <= set(last)
