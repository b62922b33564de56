"""Arithmetic problems with seeded, disjoint splits: chain sums ("What is 3 + 5 + 2 - 4?") and
products ("What is 7 * 8?").

A chain-sum problem has ``num_terms`` single- or multi-digit operands in ``[min_value, max_value]`` joined
by ``+`` / ``-``; its answer is the integer value. :func:`make_splits` draws the test split first
and then the train split from problems not in it, so the splits are disjoint by problem text.
Rows are ``{"problem": str, "answer": str, "prompt": str}``; ``prompt`` is the user message
with the answer-format instruction appended (see :data:`PROMPT_STYLES`).

Products are split by fact: :func:`make_product_splits` holds out unordered pairs, so ``7 * 8`` and
``8 * 7`` are always on the same side and the test split asks facts the training never rewarded.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from posttrain.errors import ConfigError

#: Instruction appended to the problem; the verifier in ``scoring`` accepts all of them.
PROMPT_STYLES = {
    "plain": "{problem}",
    "boxed": "{problem} Put the final answer in \\boxed{{}}.",
    "answer_is": "{problem} End your reply with 'The answer is N.' where N is the result.",
    "equation": "{problem} Write the calculation as an equation, e.g. 2 + 3 = 5.",
}


def format_prompt(problem: str, style: str = "boxed") -> str:
    """User message for ``problem`` in ``style`` (a key of :data:`PROMPT_STYLES`)."""
    if style not in PROMPT_STYLES:
        known = ", ".join(sorted(PROMPT_STYLES))
        raise ConfigError(f"unknown prompt style {style!r}; known: {known}")
    return PROMPT_STYLES[style].format(problem=problem)


def _one_problem(rng: random.Random, num_terms: int, min_value: int, max_value: int,
                 allow_negative: bool) -> tuple[str, int]:
    """Draw one expression; redraw when ``allow_negative`` is False and the value is < 0."""
    while True:
        terms = [rng.randint(min_value, max_value) for _ in range(num_terms)]
        ops = [rng.choice("+-") for _ in range(num_terms - 1)]
        value = terms[0]
        text = str(terms[0])
        for op, term in zip(ops, terms[1:]):
            value = value + term if op == "+" else value - term
            text += f" {op} {term}"
        if allow_negative or value >= 0:
            return f"What is {text}?", value


def make_chain_sum(n: int, seed: int, *, num_terms: int = 4, min_value: int = 1,
                   max_value: int = 9, allow_negative: bool = False, style: str = "boxed",
                   exclude: set[str] | None = None) -> list[dict]:
    """``n`` distinct chain-sum problems drawn with ``random.Random(seed)``.

    Problems whose text is in ``exclude`` are skipped. Raises :class:`ConfigError` when the
    problem space is too small to provide ``n`` distinct problems.
    """
    if num_terms < 2 or min_value < 0 or max_value < min_value:
        raise ConfigError(
            f"chain_sum needs num_terms >= 2 and 0 <= min_value <= max_value "
            f"(got num_terms={num_terms}, min_value={min_value}, max_value={max_value})"
        )
    rng = random.Random(seed)
    seen = set(exclude or ())
    rows: list[dict] = []
    attempts = 0
    while len(rows) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ConfigError(
                f"could not draw {n} distinct chain_sum problems with num_terms={num_terms}, "
                f"values {min_value}..{max_value}; lower n or widen the ranges"
            )
        problem, value = _one_problem(rng, num_terms, min_value, max_value, allow_negative)
        if problem in seen:
            continue
        seen.add(problem)
        rows.append({"problem": problem, "answer": str(value),
                     "prompt": format_prompt(problem, style)})
    return rows


def make_splits(num_train: int, num_test: int, seed: int, **kwargs) -> tuple[list[dict], list[dict]]:
    """Disjoint (train, test) lists; test uses ``seed``, train ``seed + 1`` and excludes test."""
    test = make_chain_sum(num_test, seed, **kwargs)
    train = make_chain_sum(num_train, seed + 1, exclude={r["problem"] for r in test}, **kwargs)
    return train, test


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    """Write ``rows`` as JSON lines to ``path`` atomically (temporary file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def write_splits(out_dir: str | Path, num_train: int = 2000, num_test: int = 200, seed: int = 0,
                 **kwargs) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``test.jsonl`` under ``out_dir``; returns their paths."""
    train, test = make_splits(num_train, num_test, seed, **kwargs)
    out = Path(out_dir)
    return write_jsonl(train, out / "train.jsonl"), write_jsonl(test, out / "test.jsonl")


def product_row(a: int, b: int, style: str) -> dict:
    """The row of the problem ``a * b``."""
    problem = f"What is {a} * {b}?"
    return {"problem": problem, "answer": str(a * b), "prompt": format_prompt(problem, style)}


def make_product_splits(num_test_pairs: int, seed: int, *, min_value: int = 2, max_value: int = 9,
                        style: str = "answer_is") -> tuple[list[dict], list[dict]]:
    """(train, test) products ``a * b`` with ``a, b`` in ``[min_value, max_value]``, split by fact.

    ``num_test_pairs`` unordered pairs ``{a, b}`` drawn with ``random.Random(seed)`` go to the test
    split in both orders; every other ordered pair is a training problem. Both lists are shuffled.
    """
    pairs = [(a, b) for a in range(min_value, max_value + 1) for b in range(a, max_value + 1)]
    if min_value < 0 or not 0 < num_test_pairs < len(pairs):
        raise ConfigError(f"products need 0 <= min_value <= max_value and 0 < num_test_pairs < {len(pairs)} "
                          f"(the unordered pairs of {min_value}..{max_value}); got num_test_pairs={num_test_pairs}")
    rng = random.Random(seed)
    held_out = set(rng.sample(pairs, num_test_pairs))
    ordered = [(a, b) for a in range(min_value, max_value + 1) for b in range(min_value, max_value + 1)]
    test = [product_row(a, b, style) for a, b in ordered if (min(a, b), max(a, b)) in held_out]
    train = [product_row(a, b, style) for a, b in ordered if (min(a, b), max(a, b)) not in held_out]
    rng.shuffle(test)
    rng.shuffle(train)
    return train, test


#: The demo task (docs/demo.md): single-digit products, which SmolLM2-135M-Instruct (Q4_1) gets
#: about half right greedily, so most sampled groups carry a GRPO signal.
DEMO_TASK = {"kind": "products", "num_test_pairs": 30, "seed": 0, "min_value": 2, "max_value": 12,
             "style": "answer_is"}
#: The first demo task, kept as the fast smoke config (``grpo_smollm2_demo_sums``): two-term sums
#: and differences, 76 train and 50 test problems (the whole space of 126).
SUMS_TASK = {"kind": "sums", "num_train": 76, "num_test": 50, "seed": 0, "num_terms": 2, "min_value": 1,
             "max_value": 9, "style": "answer_is"}
DEMO_TASKS = {"products": DEMO_TASK, "sums": SUMS_TASK}


def write_demo_data(out_dir: str | Path, task: str = "products") -> tuple[Path, Path]:
    """Write ``train.jsonl`` / ``test.jsonl`` of the demo task ``task`` (a key of :data:`DEMO_TASKS`)."""
    if task not in DEMO_TASKS:
        raise ConfigError(f"unknown demo task {task!r}; known: {', '.join(DEMO_TASKS)}")
    spec = dict(DEMO_TASKS[task])
    if spec.pop("kind") == "products":
        train, test = make_product_splits(**spec)
    else:
        train, test = make_splits(**spec)
    out = Path(out_dir)
    return write_jsonl(train, out / "train.jsonl"), write_jsonl(test, out / "test.jsonl")
