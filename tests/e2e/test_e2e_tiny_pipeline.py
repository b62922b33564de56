"""The tiny pipeline end to end, as a user runs it: examples/tiny/run_pipeline.sh.

init-model -> data -> preprocess -> SFT warm start -> GRPO -> eval, on a ~10M-parameter Qwen2.
The warm start answers "?" (no answer) about half of the time; GRPO must
raise the reward and the greedy accuracy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_tiny_pipeline_learns(tmp_path):
    out = tmp_path / "tiny"
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
           "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(["bash", str(ROOT / "examples/tiny/run_pipeline.sh"), str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    rows = [json.loads(x) for x in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["grpo/score/mean"] for r in rows if "grpo/score/mean" in r]
    assert len(rewards) == 20
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.1, f"reward did not go up: {rewards}"

    evals = [json.loads(x) for x in (out / "grpo" / "eval.jsonl").read_text().splitlines()]
    assert evals[0]["iteration"] == 0 and evals[-1]["iteration"] == 20
    assert evals[-1]["eval/accuracy"] > evals[0]["eval/accuracy"]

    result = json.loads((out / "eval.json").read_text())
    assert result["accuracy"] == pytest.approx(evals[-1]["eval/accuracy"])
    assert (out / "grpo_ckpt" / "iter_0000020" / "model.safetensors").is_file()
    assert list((out / "grpo" / "tensorboard").iterdir())
