"""On-policy distillation beside the loop's other rollout modes (rl_config.teacher_model with LoRA,
the per-request decode loop, partial rollout and asynchronous training).

The teacher is the student's own starting model and the learning rate (1e-20) too small to move the
student, so over 3 iterations the teacher's log-prob of every sampled token must equal the one the
rollout recorded: ``distill/reverse_kl`` (the mean of ``log pi - log q``) is zero up to float32
rounding, for responses finished over two iterations (partial rollout) and samples drawn by the
previous iteration's policy (async_staleness) too. A teacher read at the wrong rows, positions or
tokens (a shifted mask, a response split over iterations, a LoRA student scored through its adapter)
puts it far from zero: these log-probs are about -5.7 nats per token on the random mini model.
"""

from __future__ import annotations

import pytest

from tests.helpers.configs import OMIT, run_config
from tests.helpers.runs import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")

LORA = {"actor_config": {"lora_target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
                         "lora_r": 4, "lora_alpha": 8}}
MODES = {
    "lora": (LORA, {"share_backbone": True}),
    "per_request": ({}, {"async_engine": True}),
    "partial": ({}, {"partial_rollout_max_split": 2}),
    "async": ({}, {"async_staleness": 1}),
}


@pytest.mark.parametrize("mode", MODES)
def test_the_teachers_logprobs_match_the_rollouts_when_the_teacher_is_the_starting_policy(mode, tmp_path,
                                                                                         mini_world):
    from posttrain.commands.train import train_config as train

    sections, rl = MODES[mode]
    cfg = run_config(mini_world / "model", mini_world / "data" / "rl", tmp_path / "out", name=mode, iters=3,
                     rl_config={"n_samples_per_prompt": 4, "mini_batch_size": 4, "teacher_model":
                                str(mini_world / "model"), "verifier_function": ["last_number"],
                                "verifier_modules": OMIT, "verifier_parallel": 0, **rl},
                     generate_config={"max_num_seqs": 256, "sampling_config": {"max_tokens": 6, "temperature": 1.0,
                                                                               "top_k": -1, "top_p": 1.0}},
                     megatron_training={"lr": 1e-20}, **sections)
    train(cfg)
    rows = [r for r in read_metrics(tmp_path / "out") if "distill/reverse_kl" in r]
    assert len(rows) == 3
    for row in rows:
        assert row["distill/student_logprob"] < -1.0, row  # far from zero: a misread shows
        assert abs(row["distill/reverse_kl"]) < 1e-4, row
        assert row["distill/teacher_logprob"] == pytest.approx(row["distill/student_logprob"], abs=1e-4)
    if mode in ("partial", "async"):  # samples finished or drawn by the policy of an earlier iteration
        assert max(row["rollout/staleness_max"] for row in rows) >= 1, rows
