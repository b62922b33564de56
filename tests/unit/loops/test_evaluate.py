"""Held-out evaluation reports strict accuracy (the run's verifiers) and lenient accuracy (the last
number is the answer, whatever the format)."""

from __future__ import annotations

from posttrain.rollout.base import RolloutOutput, SamplingParams
from posttrain.loops.evaluate import evaluate

RESPONSES = ["The answer is 7.", "3 + 4 = 7", "The answer is 8.", "I think 9, or maybe 5"]
LABELS = ["7", "7", "5", "5"]


class Scripted:
    """Returns the scripted response of each prompt (its token ids), for every sample."""

    def __init__(self, tokenizer):
        self.ids = [tokenizer.encode(text, add_special_tokens=False) for text in RESPONSES]

    def generate(self, prompts, n, sampling, stop_token_ids=None, prompt_keys=None):
        return [[RolloutOutput(token_ids=self.ids[key]) for _ in range(n)] for key in prompt_keys]


class FormatReward:
    """Strict: "The answer is N." with the right N."""

    def score(self, texts, labels):
        return [float(t.strip() == f"The answer is {label}.") for t, label in zip(texts, labels)], None


def test_strict_and_lenient_accuracy(tiny_tokenizer):
    prompts = [[1, 2]] * len(RESPONSES)
    result = evaluate(Scripted(tiny_tokenizer), tiny_tokenizer, prompts, LABELS, FormatReward(),
                      sampling=SamplingParams(temperature=0, max_tokens=8), n=2, batch_size=3)
    assert result["accuracy"] == 0.25  # only the first is in the required format and right
    assert result["lenient_accuracy"] == 0.75  # 7, 7 and 5 end three responses; 8 is wrong
    assert result["pass@2"] == 0.25 and result["num_prompts"] == 4


def test_samples_records_every_response_with_its_scores(tiny_tokenizer):
    samples: list[dict] = []
    evaluate(Scripted(tiny_tokenizer), tiny_tokenizer, [[1, 2]] * len(RESPONSES), LABELS, FormatReward(),
             sampling=SamplingParams(temperature=0, max_tokens=8), n=2, batch_size=3, samples=samples)
    assert [(s["prompt"], s["sample"]) for s in samples] == [(p, k) for p in range(4) for k in range(2)]
    assert [s["response"].strip() for s in samples[::2]] == RESPONSES  # batches of 3 prompts keep the order
    assert [s["label"] for s in samples[::2]] == LABELS
    assert [s["score"] for s in samples[::2]] == [1.0, 0.0, 0.0, 0.0]
    assert [s["lenient"] for s in samples[::2]] == [1.0, 1.0, 0.0, 1.0]
