"""The LLM judge: the score parsers on hand examples, templates, a real tiny judge whose preferences
are known (tests/helpers/judge.py: "10" after a response ending with a lowercase word, else "0"),
its failure and timeout values, the self-judge, and the pairwise judge's both-order logic."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from posttrain.config.judge import JudgeOptions
from posttrain.errors import ConfigError
from posttrain.reward.judge_pairwise import (PairwiseJudge, combine_orders, label_pairs,
                                             write_preference_jsonl)
from posttrain.reward.judge_parse import compile_parser, parse_choice, parse_score
from posttrain.reward.judge_template import DEFAULT_TEMPLATE, fill, load_template
from tests.helpers.judge import PARSER, TEMPLATE, lowercase_verdict, random_responses


@pytest.mark.parametrize("spec,text,expected", [
    ("score", "Score: 7", 0.7),
    ("score", "The response is right.\nscore = 10", 1.0),
    ("score", "Score: **8**", 0.8),
    ("score", "Reply with Score: N ... Score: 3", 0.3),  # the last score counts
    ("score", "Score: 2.5", 0.25),
    ("score", "Score: 11", None),  # outside [0, max_score]
    ("score", "Score: -1", None),
    ("score", "I cannot grade this.", None),
    ("score", "", None),
    ("boxed", "so the grade is \\boxed{ 6 }", 0.6),
    ("boxed", "Score: 6", None),
    ("Rating (\\d+)/10", "Rating 9/10", 0.9),
])
def test_parsers_read_scores_and_fail_clearly(spec, text, expected):
    got = parse_score(text, compile_parser(spec), 10.0)
    assert got == (pytest.approx(expected) if expected is not None else None)


def test_choices_and_bad_parsers():
    assert [parse_choice(t) for t in ("Better: A", "better: B", "Better: (B)", "A is better", "Better: C")] == \
        ["A", None, "B", None, None]
    with pytest.raises(ConfigError, match=r"rl_config.judge_parser='x\(': not a valid regex .* or use one of score"):
        compile_parser("x(")
    with pytest.raises(ConfigError, match="exactly one capture group"):
        compile_parser("Score: \\d+")


def test_templates_inline_file_and_fill(tmp_path):
    assert load_template(None) == DEFAULT_TEMPLATE
    assert load_template("Rate {response}") == "Rate {response}"
    path = tmp_path / "t.txt"
    path.write_text("Q {prompt} R {response} \\boxed{N} {reference}")
    assert fill(load_template(str(path)), prompt="p", response="r", reference="4") == "Q p R r \\boxed{N} 4"
    path.write_text("no field here")
    with pytest.raises(ConfigError, match="lacks \\{response\\}"):
        load_template(str(path))


def judge_options(path, **changes) -> JudgeOptions:
    values = dict(path=str(path), template=TEMPLATE, parser=PARSER, max_score=10.0, weight=1.0, max_tokens=3,
                  temperature=0.0, timeout_s=60.0, failure_value=-1.0, dtype="float32", seed=0)
    values.update(changes)
    return JudgeOptions(**values)


@pytest.fixture(scope="module")
def held_out(tiny_tokenizer):
    texts = random_responses(tiny_tokenizer, 48, seed=99)  # the judge trained on seed 0's
    return texts, [lowercase_verdict(tiny_tokenizer, t) for t in texts]


def test_a_trained_judge_scores_as_it_was_taught(lowercase_judge_dir, held_out, one_thread):
    from posttrain.roles.judge import build_judge

    texts, expected = held_out
    judge = build_judge(judge_options(lowercase_judge_dir), None, "cpu")
    result = judge.score([""] * len(texts), texts)
    agree = sum(a == b for a, b in zip(result.scores, expected)) / len(texts)
    assert agree >= 0.85 and 0.2 < sum(expected) / len(texts) < 0.8, (agree, result.texts)
    assert sum(result.metrics["judge/parse_failures"]) <= 2 and not any(result.metrics["judge/timeouts"])
    assert result.metrics["judge/latency_s"] > 0
    # the self-judge: the same model, as the policy's own (its model, tokenizer and stop tokens)
    own = judge.generator
    policy = SimpleNamespace(model=own.engine.model, tokenizer=own.tokenizer, stop_token_ids=own.stop_token_ids)
    self_judge = build_judge(judge_options("policy"), policy, "cpu")
    assert self_judge.generator.engine.model is own.engine.model
    assert self_judge.score([""] * len(texts), texts).scores == result.scores


def test_failures_and_timeouts_score_the_failure_value(lowercase_judge_dir, held_out, one_thread):
    from posttrain.roles.judge import build_judge

    texts = held_out[0][:8]
    unread = build_judge(judge_options(lowercase_judge_dir, parser="^(X\\d+)"), None, "cpu").score([""] * 8, texts)
    assert unread.scores == [-1.0] * 8 and unread.metrics["judge/parse_failures"] == [1.0] * 8
    late = build_judge(judge_options(lowercase_judge_dir, timeout_s=1e-9), None, "cpu").score([""] * 8, texts)
    assert late.scores == [-1.0] * 8 and late.texts == [None] * 8
    assert late.metrics["judge/timeouts"] == [1.0] * 8 and late.metrics["judge/parse_failures"] == [0.0] * 8


def test_combine_orders():
    assert combine_orders("A", "B") == "x" and combine_orders("B", "A") == "y"
    assert [combine_orders(a, b) for a, b in (("A", "A"), ("B", "B"), (None, "B"), ("A", None))] == [None] * 4


class ScriptedGenerator:
    """A fake judge generator for the pairwise logic: replies by a rule, records what it was asked."""

    def __init__(self, reply):
        self.reply, self.asked = reply, []

    def generate(self, texts):
        self.asked.append(list(texts))
        return [self.reply(t) for t in texts], 0.0


def test_pairwise_judge_asks_both_orders_and_drops_position_bias(tmp_path):
    template = "{prompt}|{response_a}|{response_b}"
    prompts, xs, ys = ["p1", "p2", "p3"], ["good", "bad", "same"], ["bad", "good", "same"]
    # prefers the response holding "good"; "same" vs "same" it calls A both times (a position bias)
    judge = PairwiseJudge(ScriptedGenerator(lambda t: "Better: B" if t.split("|")[2] == "good" else "Better: A"),
                          template)
    result = judge.compare(prompts, xs, ys)
    assert judge.generator.asked == [["p1|good|bad", "p1|bad|good", "p2|bad|good", "p2|good|bad",
                                      "p3|same|same", "p3|same|same"]]  # one call, both orders
    assert result.verdicts == ["x", "y", None]
    assert result.metrics == {"judge/pairs_decided": pytest.approx(2 / 3), "judge/parse_failures": 0.0}
    always_a = PairwiseJudge(ScriptedGenerator(lambda t: "Better: A"), template).compare(prompts, xs, ys)
    assert always_a.verdicts == [None, None, None]
    rows = label_pairs(prompts, xs, ys, result.verdicts)
    assert rows == [{"instruction": "p1", "chosen": "good", "rejected": "bad"},
                    {"instruction": "p2", "chosen": "good", "rejected": "bad"}]
    out = write_preference_jsonl(tmp_path / "pairs.jsonl", rows)
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows


def test_the_reward_step_adds_rule_reward_model_and_judge_by_weight(tiny_model_dir, tiny_tokenizer, lowercase_rm_dir,
                                                                     lowercase_judge_dir, held_out, one_thread):
    """score = rule score + reward_model_weight x reward model + judge_weight x judge, exactly."""
    import torch

    from posttrain.config.plan import resolve_plan
    from posttrain.config.run import run_config_from_dict
    from posttrain.loops.produce import Producer
    from posttrain.metrics.reduce import MetricAccumulator
    from posttrain.metrics.timers import Timers
    from posttrain.reward.rule_reward import RuleReward
    from posttrain.roles.judge import build_judge
    from posttrain.roles.reward_model import build_reward_scorer
    from tests.unit.loops.test_reward_step import _config, dock_of_responses

    tok = tiny_tokenizer
    raw = _config(tiny_model_dir, lowercase_rm_dir, 0.375).raw
    raw["rl_config"].update(judge_path=str(lowercase_judge_dir), judge_template=TEMPLATE, judge_parser=PARSER,
                            judge_max_tokens=3, judge_weight=1.5)
    plan = resolve_plan(run_config_from_dict(raw, name="judge_step"), device="cpu")
    rule = RuleReward(["test_rm_digit_share"], [2.0], verifier_parallel=0)
    session = SimpleNamespace(trainer_state={}, policy=SimpleNamespace(tokenizer=tok), rule_reward=rule,
                              reward_model=build_reward_scorer(plan.reward_model, tok, "cpu"),
                              judge=build_judge(plan.judge, None, "cpu"))
    texts = held_out[0][:8]
    prompts = [tok("What is 3 + 4?")["input_ids"], tok("Sum 9 and 1")["input_ids"]]
    responses = [tok(t)["input_ids"] for t in texts]
    td = dock_of_responses(prompts, responses)
    acc, timers = MetricAccumulator(), Timers()
    Producer(plan, session).reward(td, acc, timers)

    got, _ = td.get("metrics", ["scores"], indexes=list(range(8)))
    got = torch.cat([s.reshape(-1) for s in got["scores"]])
    decoded = [tok.decode(r, skip_special_tokens=True) for r in responses]
    rule_scores = rule.score(decoded, [""] * 8)[0]
    model_scores = session.reward_model.score_sequences([prompts[i // 4] for i in range(8)], responses)
    judge_scores = build_judge(plan.judge, None, "cpu").score(["?"] * 8, decoded).scores  # TEMPLATE reads no prompt
    assert len(set(judge_scores)) > 1, judge_scores  # the judge part varies, so the sum is a real check
    want = [r + 0.375 * m + 1.5 * j for r, m, j in zip(rule_scores, model_scores, judge_scores)]
    assert torch.equal(got, torch.tensor(want, dtype=torch.float32))
    metrics = acc.reduce()
    assert metrics["judge/score/mean"] == pytest.approx(sum(judge_scores) / 8)
    assert {"timing/rule_reward", "timing/reward_model", "timing/judge"} <= set(timers.metrics())
