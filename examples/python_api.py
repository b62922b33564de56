"""posttrain from Python, notebook style: a tiny random-init model, a reward written as a Python
function, a dataset from a list of dicts preprocessed on the fly, a few GRPO iterations, and an
evaluation of the last checkpoint with the same reward (well under a minute on a laptop CPU; a
random model scores little: this shows the calls, docs/demo.md shows learning).

    python examples/python_api.py [OUT_DIR]     # default runs/python_api
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import posttrain

out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/python_api")
model = posttrain.init_model("tiny_qwen2", out / "model", seed=1234)  # a random ~10M-parameter Qwen2


@posttrain.register_reward("answers_in_digits")
def answers_in_digits(response: str, label: str, **kw) -> float:
    """The share of the response's characters that are digits, and 1 more for the right answer: dense
    enough for a random model to climb."""
    text = response.strip()
    return sum(c.isdigit() for c in text) / max(len(text), 1) + float(text == label)


rows = [{"problem": f"{a}+{b}", "answer": str(a + b)} for a in range(10) for b in (1, 2)]
summary = posttrain.train(
    "grpo_tiny_qwen2", data=rows, dataset_config="tiny_add", reward=answers_in_digits, output_dir=out / "grpo",
    **{"megatron_training.tokenizer_name_or_path": str(model), "actor_config.load": str(model),
       "actor_config.save": str(out / "ckpt"), "megatron_training.train_iters": 10,
       "megatron_training.save_interval": 10, "rl_config.eval_data_path": None, "rl_config.use_tensorboard": False})
scores = [row["grpo/score/mean"] for row in summary.history if "grpo/score/mean" in row]
print(f"reward per iteration: {', '.join(f'{s:.3f}' for s in scores)}")
print(f"checkpoints in {summary.save_dir}, metrics in {summary.output_dir / 'metrics.jsonl'}")

(out / "test.jsonl").write_text("".join(json.dumps({"prompt": f"{r['problem']}=", "answer": r["answer"]}) + "\n"
                                        for r in rows))
result = posttrain.evaluate(summary.save_dir / "iter_0000010", out / "test.jsonl", verifiers=["answers_in_digits"],
                            max_tokens=4, prompt_type="empty")
print(f"held-out mean reward {result['score/mean']:.2f} (the share of digits, +1 when right)")
