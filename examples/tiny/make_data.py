"""Data for the tiny pipeline: small additions ("What is 3 + 4?" -> "7").

The SFT warm start is deliberately unsure: for each problem it sees the right answer half of the
time and an off-by-one answer otherwise, so the warm-started model answers about half of the
problems right and its groups of samples have mixed rewards. GRPO's job is then to make it prefer
the right answer, which the reward alone tells it. Writes <out>/sft.jsonl (instruction/output),
<out>/train.jsonl and <out>/test.jsonl (problem/answer; test = every problem once, greedy-scored).

    python examples/tiny/make_data.py runs/tiny/raw
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

MAX_TERM = 4  # a, b in 0..4: 25 problems, small enough for a 10M-parameter model to memorise


def main(out: str, seed: int = 0) -> None:
    rng = random.Random(seed)
    problems = [(a, b) for a in range(MAX_TERM + 1) for b in range(MAX_TERM + 1)]
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)

    def row(a, b):
        return {"problem": f"What is {a} + {b}?", "answer": str(a + b)}

    sft = []
    for _ in range(3200):
        a, b = rng.choice(problems)
        answer = a + b if rng.random() < 0.5 else a + b + rng.choice((-1, 1))
        sft.append({"instruction": f"What is {a} + {b}?", "output": f"<answer>{answer}</answer>"})
    train = [row(*rng.choice(problems)) for _ in range(1000)]
    test = [row(a, b) for a, b in problems]
    for name, data in (("sft", sft), ("train", train), ("test", test)):
        (out_dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/tiny/raw")
