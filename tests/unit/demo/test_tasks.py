"""Task generators of the real-model demo: chain sums and products."""

from __future__ import annotations

import re

import pytest

from posttrain.data.readers import read_jsonl
from posttrain.demo.tasks import format_prompt, make_chain_sum, make_splits, write_splits
from posttrain.errors import ConfigError


def _evaluate(problem: str) -> int:
    """Independent left-to-right evaluation of 'What is a + b - c?'."""
    tokens = re.findall(r"\d+|[+-]", problem)
    value = int(tokens[0])
    for op, num in zip(tokens[1::2], tokens[2::2]):
        value += int(num) if op == "+" else -int(num)
    return value


def test_same_seed_same_problems_and_different_seed_differs():
    a = make_chain_sum(50, seed=3)
    assert a == make_chain_sum(50, seed=3)
    assert a != make_chain_sum(50, seed=4)


def test_answers_are_correct_and_ranges_respected():
    rows = make_chain_sum(200, seed=1, num_terms=4, min_value=1, max_value=9)
    for row in rows:
        numbers = [int(x) for x in re.findall(r"\d+", row["problem"])]
        assert len(numbers) == 4 and all(1 <= x <= 9 for x in numbers)
        assert int(row["answer"]) == _evaluate(row["problem"]) >= 0
        assert row["problem"] in row["prompt"]
    assert len({r["problem"] for r in rows}) == 200


def test_hand_checked_example_and_negative_option():
    assert _evaluate("What is 3 + 5 + 2 - 4?") == 6
    rows = make_chain_sum(300, seed=2, num_terms=3, allow_negative=True)
    assert any(int(r["answer"]) < 0 for r in rows)
    assert all(int(r["answer"]) == _evaluate(r["problem"]) for r in rows)


def test_splits_are_disjoint_and_written_atomically(tmp_path):
    train_path, test_path = write_splits(tmp_path, num_train=300, num_test=100, seed=0,
                                         num_terms=2, max_value=20)
    train, test = read_jsonl(train_path, strict=True), read_jsonl(test_path, strict=True)
    assert (len(train), len(test)) == (300, 100)
    assert not {r["problem"] for r in train} & {r["problem"] for r in test}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test.jsonl", "train.jsonl"]
    assert make_splits(300, 100, 0, num_terms=2, max_value=20) == (train, test)


def test_too_small_space_and_bad_style_raise():
    with pytest.raises(ConfigError, match="distinct"):
        make_chain_sum(200, seed=0, num_terms=2, min_value=1, max_value=3)  # only 18 problems
    with pytest.raises(ConfigError, match="known: answer_is, boxed, equation, plain"):
        format_prompt("What is 1 + 1?", "latex")


def test_sums_smoke_data_covers_the_whole_small_space(tmp_path):
    from posttrain.demo.tasks import write_demo_data

    train_path, test_path = write_demo_data(tmp_path, "sums")
    train, test = read_jsonl(train_path, strict=True), read_jsonl(test_path, strict=True)
    problems = {r["problem"] for r in train} | {r["problem"] for r in test}
    assert len(problems) == 126 == 81 + 45  # every a+b and every a-b >= 0 with a, b in 1..9
    assert all("The answer is N." in r["prompt"] for r in test)


def test_product_splits_hold_out_whole_facts(tmp_path):
    from posttrain.demo.tasks import DEMO_TASK, make_product_splits, write_demo_data

    train_path, test_path = write_demo_data(tmp_path)  # the demo's default task: products
    train, test = read_jsonl(train_path, strict=True), read_jsonl(test_path, strict=True)

    def facts(rows):
        pairs = [tuple(int(x) for x in re.findall(r"\d+", r["problem"])) for r in rows]
        for (a, b), row in zip(pairs, rows):
            assert row["answer"] == str(a * b) and row["problem"] == f"What is {a} * {b}?"
        return {frozenset(p) for p in pairs}, pairs

    (train_facts, train_pairs), (test_facts, test_pairs) = facts(train), facts(test)
    assert not train_facts & test_facts                      # 7 * 8 and 8 * 7 never on both sides
    assert len(test_facts) == DEMO_TASK["num_test_pairs"] == 30
    assert all((b, a) in test_pairs for a, b in test_pairs)   # both orders of a held-out fact
    assert len(train) + len(test) == 11 * 11 and len(set(train_pairs)) == len(train)
    assert make_product_splits(30, 0, max_value=12) == make_product_splits(30, 0, max_value=12)
    assert make_product_splits(30, 1, max_value=12)[1] != make_product_splits(30, 0, max_value=12)[1]
    with pytest.raises(ConfigError, match="num_test_pairs"):
        make_product_splits(66, 0, max_value=12)             # 66 facts: nothing left to train on
    with pytest.raises(ConfigError, match="known: products, sums"):
        write_demo_data(tmp_path, "division")
