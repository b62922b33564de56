"""The tiny pipeline end to end, as a user runs it: examples/tiny/run_pipeline.sh, then run_algorithms.sh.

init-model -> data -> preprocess -> SFT warm start -> GRPO -> eval, on a ~10M-parameter Qwen2, run
once for the module. The warm start answers "?" (no answer) about half of the time; GRPO must
raise the reward and the greedy accuracy. PPO, DAPO and DPO then start from the same SFT
checkpoint (examples/tiny/run_algorithms.sh, one leg per test): PPO must raise the reward, DAPO
must report its generation batches, DPO must prefer the right sum over a wrong one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.runs import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def run_script(name: str, *args: str) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
           "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(["bash", str(ROOT / "examples/tiny" / name), *args], cwd=ROOT, env=env, check=False,
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def first_last(values: list[float], first: int = 2, last: int = 5) -> tuple[float, float]:
    """The mean reward of the first iterations (the warm start's samples, and those after one update)
    and of the last ones. The policy reaches its plateau within a few updates on this task, so a
    wider first window already holds learned iterations, and the faster a run learns, the smaller
    the gain it would measure."""
    return sum(values[:first]) / first, sum(values[-last:]) / last


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "tiny"
    run_script("run_pipeline.sh", str(out))
    return out


def test_tiny_pipeline_learns(tiny):
    rows = read_jsonl(tiny / "grpo" / "metrics.jsonl")
    rewards = [r["grpo/score/mean"] for r in rows if "grpo/score/mean" in r]
    assert len(rewards) == 20
    first, last = first_last(rewards)
    assert last > first + 0.1, f"reward did not go up: {rewards}"

    evals = read_jsonl(tiny / "grpo" / "eval.jsonl")
    assert evals[0]["iteration"] == 0 and evals[-1]["iteration"] == 20
    assert evals[-1]["eval/accuracy"] > evals[0]["eval/accuracy"]

    result = json.loads((tiny / "eval.json").read_text())
    assert result["accuracy"] == pytest.approx(evals[-1]["eval/accuracy"])
    assert (tiny / "grpo_ckpt" / "iter_0000020" / "model.safetensors").is_file()
    assert list((tiny / "grpo" / "tensorboard").iterdir())


def test_ppo_raises_the_reward(tiny):
    run_script("run_algorithms.sh", str(tiny), "ppo")
    rows = read_jsonl(tiny / "ppo" / "metrics.jsonl")
    rewards = [r["critic/score/mean"] for r in rows if "critic/score/mean" in r]
    assert len(rewards) == 20
    first, last = first_last(rewards)
    assert last > first + 0.1, f"reward did not go up: {rewards}"
    trained = [r for r in rows if "critic/vf_loss" in r]
    assert trained[-1]["critic/values/mean"] != 0.0  # the critic (zero-initialised head) learned
    evals = read_jsonl(tiny / "ppo" / "eval.jsonl")
    assert evals[0]["iteration"] == 0 and evals[-1]["iteration"] == 20
    assert evals[-1]["eval/accuracy"] > evals[0]["eval/accuracy"]
    assert (tiny / "ppo_ckpt" / "iter_0000020" / "critic" / "model.safetensors").is_file()


def test_dapo_dynamic_sampling_reports_generation_batches(tiny):
    run_script("run_algorithms.sh", str(tiny), "dapo")
    rows = [r for r in read_jsonl(tiny / "dapo" / "metrics.jsonl") if "train/num_gen_batches" in r]
    assert len(rows) == 15
    assert all(r["train/num_gen_batches"] >= 1 for r in rows)
    # filter_groups_train_batch_size = global_batch_size (8 prompts): a dropped group means another batch
    for r in rows:
        assert r["dapo/num_kept_groups"] >= 8
        if r["train/num_gen_batches"] == 1:
            assert r["dapo/num_kept_groups"] == 8
    assert max(r["train/num_gen_batches"] for r in rows) >= 2  # groups were dropped and regenerated
    assert "dapo/score/mean" in rows[-1] and "actor/kl_loss" not in rows[-1]


def test_dpo_prefers_the_right_sum(tiny):
    run_script("run_algorithms.sh", str(tiny), "dpo")
    rows = [r for r in read_jsonl(tiny / "dpo" / "metrics.jsonl") if "rewards/accuracies" in r]
    assert len(rows) == 40
    accuracies = [r["rewards/accuracies"] for r in rows]
    margins = [r["rewards/margins"] for r in rows]
    assert sum(accuracies[-10:]) / 10 > 0.9, accuracies  # a batch holds 32 pairs: one batch's accuracy is noisy
    first, last = first_last(margins)
    assert last > first + 0.5, f"margin did not grow: {margins}"
    assert rows[-1]["rewards/chosen"] > rows[-1]["rewards/rejected"]
    assert json.loads((tiny / "dpo" / "eval.json").read_text())["num_prompts"] == 20
