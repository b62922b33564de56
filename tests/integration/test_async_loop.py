"""Asynchronous training with bounded staleness and the rollout correction, on the tiny model.

k = 0 samples exactly what synchronous training samples; k = 1 trains on samples one version old;
a resume in the middle of an async run repeats the uninterrupted run; fp32 rollout log-probs
match the trainer's, and a bf16 rollout's do not (which the correction then sees).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.runs import metrics_by_iteration
from tests.integration.test_grpo_loop import grpo_config

COMMON = {"megatron_training__train_iters": 4, "rl_config__mini_batch_size": 1}


def comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("timing/") and not k.endswith("_tps") and k != "time"}


@pytest.fixture(scope="module")
def sync_run(tiny_model_dir, tiny_prompt_data, tmp_path_factory):
    from posttrain.commands.train import train_config as train

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("sync")
    train(grpo_config(tiny_model_dir, tiny_prompt_data, out, **COMMON))
    return metrics_by_iteration(out / "run")


def test_staleness_zero_equals_synchronous_training(sync_run, tiny_model_dir, tiny_prompt_data, tmp_path):
    from posttrain.commands.train import train_config as train

    torch.set_num_threads(1)
    train(grpo_config(tiny_model_dir, tiny_prompt_data, tmp_path, **COMMON, rl_config__async_staleness=0))
    k0 = metrics_by_iteration(tmp_path / "run")
    assert sorted(k0) == sorted(sync_run) == [1, 2, 3, 4]
    for it in k0:
        want = comparable(sync_run[it])
        assert {"actor/pg_loss", "grpo/score/mean", "rollout/logprob_diff_max"} <= set(want)
        for key, value in want.items():
            assert k0[it][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (it, key)
        assert k0[it]["rollout/staleness_max"] == 0.0
        assert k0[it]["rollout/logprob_diff_max"] < 1e-4  # fp32 native engine: the trainer's numbers


def test_staleness_one_trains_on_samples_one_version_old(sync_run, tiny_model_dir, tiny_prompt_data, tmp_path):
    from posttrain.commands.train import train_config as train

    torch.set_num_threads(1)
    train(grpo_config(tiny_model_dir, tiny_prompt_data, tmp_path, **COMMON, rl_config__async_staleness=1,
                      rl_config__rollout_correction="tis"))
    k1 = metrics_by_iteration(tmp_path / "run")
    assert [k1[it]["rollout/staleness_max"] for it in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 1.0]
    assert all(k1[it]["rollout/dropped_stale"] == 0.0 for it in k1)
    # iterations 1 and 2 sample with the initial weights, as the synchronous run's first iteration
    assert comparable(k1[1])["grpo/score/mean"] == pytest.approx(sync_run[1]["grpo/score/mean"])
    assert k1[2]["grpo/score/mean"] != pytest.approx(sync_run[2]["grpo/score/mean"])
    assert k1[2]["rollout/logprob_diff_max"] > 1e-3  # the trainer moved on: the correction has work
    assert "timing/non_overlap_rollout" in k1[2] and "timing/resharding_to_infer" in k1[2]


class Interrupt(Exception):
    pass


def straight_and_resumed(model, data, tmp_path, monkeypatch, over: dict) -> tuple[dict, dict]:
    """The metrics of a 4-iteration run, and of the same run stopped at iteration 3 (after the save of
    iteration 2) and resumed from its checkpoint; they must agree on iterations 3 and 4."""
    from posttrain.loops.onpolicy import OnPolicyTrainer
    from posttrain.commands.train import train_config as train

    torch.set_num_threads(1)
    train(grpo_config(model, data, tmp_path / "straight", **over))
    step = OnPolicyTrainer.train_step

    def stop_at_three(self, iteration):
        if iteration == 3:
            raise Interrupt
        return step(self, iteration)

    monkeypatch.setattr(OnPolicyTrainer, "train_step", stop_at_three)
    with pytest.raises(Interrupt):
        train(grpo_config(model, data, tmp_path / "resumed", **over))
    monkeypatch.setattr(OnPolicyTrainer, "train_step", step)
    train(grpo_config(model, data, tmp_path / "resumed", **over, actor_config__load=str(tmp_path / "resumed" / "ckpt")))
    a, b = metrics_by_iteration(tmp_path / "straight" / "run"), metrics_by_iteration(tmp_path / "resumed" / "run")
    for it in (3, 4):
        for key, value in comparable(a[it]).items():
            assert b[it][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (it, key)
    return a, b


def test_a_resume_in_the_middle_of_an_async_run_repeats_it(tiny_model_dir, tiny_prompt_data, tmp_path, monkeypatch):
    from posttrain.loops.sources import IN_FLIGHT

    straight_and_resumed(tiny_model_dir, tiny_prompt_data, tmp_path, monkeypatch,
                         {**COMMON, "rl_config__async_staleness": 1})
    saved = torch.load(tmp_path / "resumed" / "ckpt" / "iter_0000002" / IN_FLIGHT, weights_only=False)
    assert sorted(saved) == [3, 4]  # sampled with versions 1 and 2 before the interruption


@pytest.mark.parametrize("mode", ["mis", "icepop"])
def test_a_bf16_rollout_differs_from_the_fp32_trainer_and_mis_masks_it(tiny_model_dir, tiny_prompt_data, tmp_path,
                                                                       monkeypatch, mode):
    from posttrain.commands.train import train_config as train

    monkeypatch.setattr("posttrain.device.cpu_supports_bf16", lambda: True)  # a bf16 rollout on any CPU
    torch.set_num_threads(1)
    metrics = train(grpo_config(tiny_model_dir, tiny_prompt_data, tmp_path, **{**COMMON, "megatron_training__train_iters": 1},
                                generate_config__dtype="bfloat16", rl_config__rollout_correction=mode,
                                rl_config__rollout_correction_cap=1.0005))
    assert metrics["rollout/logprob_diff_max"] > 1e-3
    assert metrics["rollout/masked_fraction"] > 0.0, metrics["rollout/logprob_diff_max"]
    assert metrics["rollout/staleness_max"] == 0.0


PARTIAL = {**COMMON, "rl_config__partial_rollout_max_split": 4,
           "generate_config__sampling_config": {"max_tokens": 16, "temperature": 1.0, "top_k": -1}}


def test_partial_rollout_resumes_exactly_and_no_sample_outlives_the_split(tiny_model_dir, tiny_prompt_data, tmp_path,
                                                                          monkeypatch):
    from posttrain.loops.partial_rollout import STATE_FILE

    a, _ = straight_and_resumed(tiny_model_dir, tiny_prompt_data, tmp_path, monkeypatch, PARTIAL)
    assert (tmp_path / "resumed" / "ckpt" / "iter_0000002" / STATE_FILE).is_file()
    assert max(a[it]["rollout/age_max"] for it in a) >= 1  # groups waited in the dock
    assert all(a[it]["rollout/age_max"] <= 3 and a[it]["rollout/staleness_max"] <= 3 for it in a)
    assert all(a[it]["rollout/dropped_stale"] == 0 for it in a)


def test_async_with_partial_rollout_keeps_staleness_within_its_bound(tiny_model_dir, tiny_prompt_data, tmp_path):
    from posttrain.commands.train import train_config as train

    torch.set_num_threads(1)
    train(grpo_config(tiny_model_dir, tiny_prompt_data, tmp_path, **{**PARTIAL, "rl_config__partial_rollout_max_split": 2},
                      rl_config__async_staleness=1))
    m = metrics_by_iteration(tmp_path / "run")
    assert sorted(m) == [1, 2, 3, 4]
    assert all(m[it]["rollout/staleness_max"] <= 1 + 2 - 1 for it in m)
    assert max(m[it]["rollout/staleness_max"] for it in m) >= 1


def test_truncated_sampling_logprobs_make_the_on_policy_ratio_one(tiny_model_dir, tiny_prompt_data, tmp_path):
    """top_k 20 and top_p 0.9 with rl_config.truncated_sampling_logprobs: the native engine reports
    log mu(y) and the actor's old log-probs renormalise over the same kept set, so the rollout
    correction sees no mismatch on-policy (docs/algorithms.md). Were only one side truncated (the
    rollout's log mu(y) against the trainer's log p(y), as with vLLM without the key), they would
    differ by the kept mass (measured in tests/unit/algo/test_truncation.py)."""
    from posttrain.commands.train import train_config as train

    torch.set_num_threads(1)
    sampling = {"max_tokens": 16, "temperature": 1.0, "top_k": 20, "top_p": 0.9}
    metrics = train(grpo_config(tiny_model_dir, tiny_prompt_data, tmp_path, **{**COMMON, "megatron_training__train_iters": 1},
                                generate_config__sampling_config=sampling, rl_config__rollout_correction="tis",
                                rl_config__truncated_sampling_logprobs=True))
    assert metrics["rollout/logprob_diff_max"] < 1e-4  # fails when only one side truncates
