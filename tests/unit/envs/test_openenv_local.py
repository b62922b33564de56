"""posttrain.envs.openenv_local and posttrain.loops.env_turns: an OpenEnv-style environment
(tests/unit/envs/guess_env.py) drives the turns of posttrain's rollout.

The reference of the episode test is the environment itself: what it received is exactly the
decoded text of each sampled turn, what the response holds between the turns is exactly its
answer in the template's observation format (mask 0, log-prob 0), and the row's reward is the
sum of its step rewards."""

from __future__ import annotations

import pytest

from posttrain.envs.config import env_options
from posttrain.errors import ConfigError
from tests.helpers.configs import OMIT, run_config

ENV = "tests.unit.envs.guess_env:GuessEnv"


def local(**raw):
    from posttrain.envs.openenv_local import LocalEnvironment

    return LocalEnvironment(env_options({"type": "openenv", "id": ENV, **raw}))


def test_tasks_are_the_resets_and_the_prompt_is_the_reset_observation():
    from tests.unit.envs.guess_env import GuessAction

    env = local(args={"hint": "Which letter?"}, resets=[{"secret": "x"}, {"secret": "y"}])
    assert len(env.tasks) == 2 and env.messages(1) == [{"role": "user", "content": "Which letter?"}]
    assert (env.action_type, env.action_field) == (GuessAction, "guess")  # from Environment[GuessAction, ...]
    episode = env.start(1)
    assert env.step(episode, "is it x") == "no; guess 2" and not episode.done
    assert env.step(episode, "y!") == "yes" and episode.done and episode.reward == 1.0 and episode.turns == 2
    assert episode.env.guesses == ["is it x", "y!"]


@pytest.mark.parametrize("raw, match", [
    ({"id": "tests.unit.envs.guess_env"}, "module:ClassName"),
    ({"id": "tests.unit.envs.guess_env:Nope"}, "cannot import"),
    ({"id": "tests.unit.envs.guess_env:GuessAction"}, "env_config.args: .* cannot be built"),
    ({"id": "tests.unit.envs.guess_env:GuessObservation", "args": {"feedback": "x"}}, "no reset"),
    ({"id": ENV, "args": {"colour": 1}}, "env_config.args"),
    ({"id": ENV, "resets": [{"colour": "red"}]}, r"resets\[0\]"),
    ({"id": ENV, "max_turns": 0}, "max_turns must be"),
])
def test_bad_openenv_config_names_the_key(raw, match):
    from posttrain.envs.openenv_local import LocalEnvironment

    with pytest.raises(ConfigError, match=match):
        LocalEnvironment(env_options({"type": "openenv", **raw}))


def test_verifiers_type_refuses_openenv_keys():
    with pytest.raises(ConfigError, match="resets belong to type: openenv"):
        env_options({"type": "verifiers", "id": "x", "resets": [{}]})


def test_the_environment_answers_each_turn_in_the_rollout(mini_qwen2_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    from posttrain.data.templates import get_template
    from posttrain.loops.env_turns import Episodes
    from posttrain.paths import shipped_file
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.multi_turn import ObservationFormat
    from posttrain.rollout.native import NativeEngine

    tok = tiny_tokenizer
    model = AutoModelForCausalLM.from_pretrained(mini_qwen2_dir).eval()
    engine = NativeEngine(model, pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id])
    template = get_template("tiny_tool", shipped_file("configs/tiny_templates.json"))
    observation = ObservationFormat(template, tok)
    env = local(resets=[{"secret": "\x00never"}])  # never guessed: every episode runs its max_turns
    stops = list(range(0, tok.vocab_size, 3))  # a third of the vocabulary ends a turn, so turns are short
    episodes = Episodes(env, tok, observation, max_turns=2, max_tokens=200, stop_token_ids=stops)
    prompt = tok.encode(template.render_prompt(env.messages(0), tokenizer=tok), add_special_tokens=False)
    rows = episodes.rows([prompt] * 3, [0] * 3, [0] * 3, [0, 1, 2])
    episodes.run(rows, engine, SamplingParams(temperature=1.0, max_tokens=200, seed=5))
    for row in rows:
        assert row.episode.turns == 2 and not row.live and row.episode.reward == 0.0
        first = row.mask.index(0)  # the first turn, then the environment's answer, then the second turn
        answer = observation.encode(["no; guess 2"], closed=True)
        assert row.tokens[first:first + len(answer)] == answer and row.mask[first:first + len(answer)] == [0] * len(answer)
        assert row.logprobs[first:first + len(answer)] == [0.0] * len(answer)
        second = row.tokens[first + len(answer):]
        assert second and row.mask[first + len(answer):] == [1] * len(second)
        decoded = [tok.decode(part, skip_special_tokens=True) for part in (row.tokens[:first], second)]
        assert row.episode.env.guesses == decoded  # the environment saw exactly the sampled turns
        ends = {*stops, tok.eos_token_id}
        assert row.tokens[first - 1] in ends and second[-1] in ends  # each turn ended at a stop token


@pytest.mark.slow
def test_grpo_on_an_openenv_environment_learns_from_its_episode_rewards(tmp_path, mini_qwen2_dir, one_thread):
    from posttrain.commands.train import train_config as train
    from tests.helpers.runs import read_metrics

    iters = 10
    cfg = run_config(mini_qwen2_dir, None, tmp_path / "out", name="grpo_openenv", iters=iters,
                     megatron_training={"micro_batch_size": 32, "lr": 1e-2, "data_path": OMIT,
                                        "prompt_type": "tiny_tool", "prompt_type_path": "configs/tiny_templates.json"},
                     rl_config={"mini_batch_size": 4, "verifier_function": OMIT, "verifier_weight": OMIT,
                                "verifier_modules": OMIT, "verifier_parallel": OMIT,
                                "env_config": {"type": "openenv", "id": ENV, "max_turns": 3,
                                               "resets": [{"secret": "e"}] * 4}},
                     generate_config={"sampling_config": {"max_tokens": 12, "temperature": 1.0, "top_k": -1,
                                                          "top_p": 1.0}})
    last = train(cfg)
    rows = [r for r in read_metrics(tmp_path / "out") if "grpo/score/mean" in r]
    scores = [r["grpo/score/mean"] for r in rows]
    assert len(scores) == iters
    assert sum(scores[-3:]) / 3 > sum(scores[:3]) / 3 + 0.3, scores  # learning to guess, not just running
    for row in rows:  # the score is the episode's reward: 1 exactly where the environment ended it (a hit)
        assert row["grpo/score/mean"] == pytest.approx(row["env/done/mean"])
        assert 1.0 <= row["env/turns/mean"] <= 3.0
    assert "timing/rule_reward" not in last


def test_openenv_needs_a_template_with_an_observation_format(tmp_path, mini_qwen2_dir):
    from posttrain.config.plan import resolve_plan

    cfg = run_config(mini_qwen2_dir, None, tmp_path / "out", name="grpo_openenv", iters=1,
                     megatron_training={"data_path": OMIT, "prompt_type": "hf_chat_template"},
                     rl_config={"verifier_function": OMIT, "verifier_weight": OMIT, "verifier_modules": OMIT,
                                "verifier_parallel": OMIT, "env_config": {"type": "openenv", "id": ENV}})
    with pytest.raises(ConfigError, match="format_observation"):
        resolve_plan(cfg)
