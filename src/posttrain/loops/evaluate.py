"""Accuracy of a policy on held-out prompts: greedy or sampled generation scored by verifiers.

* ``accuracy`` / ``pass@1``: the **strict** accuracy, the share of prompts whose first sample
  scores >= ``threshold`` with the run's verifiers (the answer in the required format; with greedy
  decoding, the greedy accuracy);
* ``lenient_accuracy``: the share of prompts whose first sample ends with the right number,
  whatever the format (the ``last_number`` verifier: the last number in the response equals the
  label's). The gap between the two is how much of the accuracy is format: a model that learns to
  write "The answer is N." gains strict accuracy without solving more problems;
* ``avg@k``: the mean over all k samples of each prompt, averaged over prompts;
* ``pass@k``: the share of prompts with at least one sample scoring >= ``threshold``;
* ``score/mean``: the mean weighted verifier score.

``samples``, a list, receives one record per generated response (prompt index, sample index,
response text, label, verifier score, lenient score), as ``posttrain eval --samples`` writes them.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from posttrain.reward.decoding import decode_responses
from posttrain.reward.verifiers.numbers import last_number_reward


def evaluate(engine, tokenizer, prompts: list[list[int]], labels: list[str], reward, *, sampling,
             n: int = 1, stop_token_ids=None, threshold: float = 1.0, batch_size: int = 64,
             samples: list[dict] | None = None) -> dict[str, float]:
    """Generate ``n`` samples per prompt with ``engine`` and score them with ``reward`` (a RuleReward);
    with ``samples``, append each response's record to it."""
    scores_by_prompt: list[list[float]] = []
    lenient: list[float] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        keys = list(range(start, start + len(chunk)))  # each prompt its own stream across chunks
        outs = engine.generate(chunk, n, sampling, stop_token_ids, prompt_keys=keys)
        texts = decode_responses(tokenizer, [o.token_ids for group in outs for o in group])
        chunk_labels = [labels[start + i] for i, group in enumerate(outs) for _ in group]
        scores, _ = reward.score(texts, chunk_labels)
        for i in range(len(chunk)):
            scores_by_prompt.append(scores[i * n:(i + 1) * n])
            lenient.append(last_number_reward(texts[i * n], chunk_labels[i * n]))
        if samples is not None:
            samples.extend({"prompt": start + j // n, "sample": j % n, "response": text, "label": label,
                            "score": float(score), "lenient": last_number_reward(text, label)}
                           for j, (text, label, score) in enumerate(zip(texts, chunk_labels, scores)))
    if not scores_by_prompt:
        return {}
    t = torch.tensor(scores_by_prompt, dtype=torch.float64)
    correct = (t >= threshold - 1e-9).to(torch.float64)
    return {
        "accuracy": correct[:, 0].mean().item(),
        "lenient_accuracy": sum(lenient) / len(lenient),
        "pass@1": correct[:, 0].mean().item(),
        f"avg@{n}": correct.mean().item(),
        f"pass@{n}": correct.max(dim=1).values.mean().item(),
        "score/mean": t.mean().item(),
        "num_prompts": float(len(scores_by_prompt)),
    }


def greedy(sampling):
    """The same sampling parameters with temperature 0 (greedy decoding)."""
    return replace(sampling, temperature=0.0, seed=0)
