"""Throughput of the rule reward: samples/s for verifiers over N mixed responses.

    .venv/bin/python benchmarks/reward/bench_rule_reward.py                 # acc, math_verify_reward; parallel 0,1,2
    .venv/bin/python benchmarks/reward/bench_rule_reward.py --n 2000 --repeats 1 --verifier math_equiv

``parallel 0`` scores inline in this process (no pool, no timeout): the gap to ``parallel 1`` is
the pool's overhead. Prints the median over repeats; the pool is created once per setting and
reused across repeats (as in training), its start-up time is printed separately.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from posttrain.reward.rule_reward import RuleReward


def mixed_responses(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """R1-format right/wrong, plain boxed, fractions, 'the answer is', no answer, long texts."""
    rng = random.Random(seed)
    responses, labels = [], []
    for i in range(n):
        a, b = rng.randint(1, 500), rng.randint(1, 500)
        ans = a + b
        wrong = ans + rng.choice([-2, -1, 1, 3])
        steps = f"Step 1: take {a}.\nStep 2: add {b}.\nStep 3: {a} + {b} = {ans}.\n"
        kind = i % 8
        if kind == 0:
            r = f"<think>\n{steps}</think>\n<answer>The answer is \\boxed{{{ans}}}</answer>"
        elif kind == 1:
            r = f"<think>\n{steps}</think>\n<answer>The answer is \\boxed{{{wrong}}}</answer>"
        elif kind == 2:
            r = f"{steps}So the result is \\boxed{{{ans}}}."
        elif kind == 3:
            r = f"<think>{steps}</think><answer>\\boxed{{\\frac{{{2 * ans}}}{{2}}}}</answer>"
        elif kind == 4:
            r = f"{steps}Therefore the answer is {ans}."
        elif kind == 5:
            r = f"<think>{steps}</think><answer>{ans}</answer>"
        elif kind == 6:
            r = f"<think>{steps * 40}</think><answer>\\boxed{{{ans}.0}}</answer>"
        else:
            r = "I am not sure how to solve this problem."
        responses.append(r)
        labels.append(str(ans))
    return responses, labels


def bench(verifier: str, parallel: int, responses, labels, repeats: int, timeout: float) -> None:
    t0 = time.perf_counter()
    with RuleReward([verifier], [1.0], verifier_parallel=parallel, verifier_timeout=timeout) as rr:
        rr.score(responses[:8], labels[:8])  # wait until the workers are up
        startup = time.perf_counter() - t0
        rates, metrics = [], {}
        for _ in range(repeats):
            t = time.perf_counter()
            _, metrics = rr.score(responses, labels)
            rates.append(len(responses) / (time.perf_counter() - t))
    print(f"{verifier:<20} parallel={parallel}  {statistics.median(rates):9.1f} samples/s  "
          f"(median of {repeats}; runs {', '.join(f'{r:.0f}' for r in rates)}; start-up {startup:.2f} s; "
          f"mean score {metrics[f'{verifier}_rewards/mean']:.3f}; timeouts {metrics['reward/timeouts']:.0f}; "
          f"errors {metrics['reward/errors']:.0f})", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=10_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--verifier", action="append", default=None)
    p.add_argument("--parallel", type=int, action="append", default=None)
    p.add_argument("--timeout", type=float, default=30.0)
    args = p.parse_args()
    responses, labels = mixed_responses(args.n)
    for verifier in args.verifier or ["acc", "math_verify_reward"]:
        for parallel in args.parallel or [0, 1, 2]:
            bench(verifier, parallel, responses, labels, args.repeats, args.timeout)


if __name__ == "__main__":
    main()
