"""Data for the tiny pipeline: small additions ("7+2" -> "9", rendered "7+2=" by the tiny_math template).

The SFT warm start is deliberately unsure: for each problem it sees the right answer half of the
time and "?" (no answer) otherwise, so the warm-started model answers about half of its samples and
its groups of samples have mixed rewards. GRPO's job is then to make it answer, which the reward
alone tells it. Writes <out>/sft.jsonl (instruction/output), <out>/train.jsonl and <out>/test.jsonl
(problem/answer; test = every problem once, greedy-scored).

    python examples/tiny/make_data.py runs/tiny/raw
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

# a in 0..9, b in 1..2: 20 problems, few enough for a 10M-parameter model to learn in ~100 SFT steps
FIRST, SECOND = range(10), (1, 2)


def main(out: str, seed: int = 0) -> None:
    rng = random.Random(seed)
    problems = [(a, b) for a in FIRST for b in SECOND]
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)

    def row(a, b):
        return {"problem": f"{a}+{b}", "answer": str(a + b)}

    sft = []
    for _ in range(3200):
        a, b = rng.choice(problems)
        answer = str(a + b) if rng.random() < 0.5 else "?"
        sft.append({"instruction": f"{a}+{b}", "output": answer})
    train = [row(*rng.choice(problems)) for _ in range(1000)]
    test = [row(a, b) for a, b in problems]
    for name, data in (("sft", sft), ("train", train), ("test", test)):
        (out_dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/tiny/raw")
