"""The precision a run gets on each device (posttrain.device.precision)."""

import pytest
import torch

from posttrain.device import precision
from posttrain.errors import ConfigError


def test_gpu_without_bf16_is_refused_by_key(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    with pytest.raises(ConfigError, match="megatron_training.bf16: true.*no bf16 support"):
        precision("cuda", bf16=True, rollout_dtype="float32")
    with pytest.raises(ConfigError, match="generate_config.dtype: bfloat16"):
        precision("cuda:0", bf16=False, rollout_dtype="bfloat16")
    assert precision("cuda", bf16=False, rollout_dtype="float32") == ("float32", "float32")


def test_gpu_with_bf16_keeps_the_configs_dtypes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert precision("cuda", bf16=True, rollout_dtype="bfloat16") == ("bfloat16", "bfloat16")


def test_cpu_precision_follows_its_bf16_units(monkeypatch):
    from posttrain import device

    monkeypatch.setattr(device, "cpu_supports_bf16", lambda: True)  # AMX or AVX512-BF16
    assert precision("cpu", bf16=True, rollout_dtype="bfloat16") == ("bfloat16", "bfloat16")  # the seed's defaults
    assert precision("cpu", bf16=False, rollout_dtype="float32") == ("float32", "float32")  # fp32 written: kept
    assert precision("cpu", bf16=False, rollout_dtype="bfloat16") == ("float32", "bfloat16")
    monkeypatch.setattr(device, "cpu_supports_bf16", lambda: False)  # AVX2 only: emulated bf16 is far slower
    assert precision("cpu", bf16=True, rollout_dtype="bfloat16") == ("float32", "float32")


def test_a_default_config_runs_in_bf16_on_a_cpu_with_bf16_units(monkeypatch):
    from posttrain import device
    from posttrain.config.plan import build_plan
    from posttrain.config.run import run_config_from_dict
    from posttrain.config.validate import validate_run_config

    cfg = run_config_from_dict({
        "megatron_training": {"stage": "ray_grpo", "global_batch_size": 2, "seq_length": 64, "micro_batch_size": 2},
        "rl_config": {"n_samples_per_prompt": 2, "mini_batch_size": 2, "verifier_function": ["last_number"],
                      "verifier_weight": [1.0]},
        "generate_config": {"infer_tensor_parallel_size": 1, "max_model_len": 64}})
    layout = validate_run_config(cfg)
    monkeypatch.setattr(device, "cpu_supports_bf16", lambda: True)
    plan = build_plan(cfg, layout)
    assert (plan.train_dtype, plan.rollout_dtype) == ("bfloat16", "bfloat16")
    monkeypatch.setattr(device, "cpu_supports_bf16", lambda: False)
    plan = build_plan(cfg, layout)
    assert (plan.train_dtype, plan.rollout_dtype) == ("float32", "float32")


def test_threads_follow_the_config_then_omp_then_the_checkpoint_then_the_free_cores(monkeypatch):
    from posttrain import device

    monkeypatch.setattr(device, "free_cores", lambda seconds=0.3: 1)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert device.cpu_threads(3, 4, current=2) == (3, "rl_config.num_threads")
    assert device.cpu_threads(None, 4, current=2) == (2, "OMP_NUM_THREADS")  # pinned: kept as torch has it
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert device.cpu_threads(None, 4, current=2) == (4, "the checkpoint")  # a resume reduces as its run did
    assert device.cpu_threads(None, None, current=2) == (1, "1 core(s) free at the start")  # one core is busy
    monkeypatch.setattr(device, "free_cores", lambda seconds=0.3: 8)
    assert device.cpu_threads(None, None, current=2)[0] == 2  # never more than torch's (or the caller's) count


def test_free_cores_is_between_one_and_this_process_cores():
    import os

    from posttrain.device import free_cores

    assert 1 <= free_cores(seconds=0.05) <= len(os.sched_getaffinity(0))


def test_num_threads_is_refused_with_ray_workers():
    from posttrain.config.check import check_run_config
    from posttrain.config.run import run_config_from_dict

    cfg = run_config_from_dict({
        "megatron_training": {"stage": "ray_grpo", "global_batch_size": 4, "seq_length": 64, "micro_batch_size": 2},
        "rl_config": {"n_samples_per_prompt": 2, "mini_batch_size": 2, "num_threads": 1,
                      "actor_resource": {"num_npus": 2}, "verifier_function": ["last_number"],
                      "verifier_weight": [1.0]},
        "generate_config": {"infer_tensor_parallel_size": 1, "max_model_len": 64}})
    with pytest.raises(ConfigError, match="ray_num_cpus_per_worker"):
        check_run_config(cfg)
