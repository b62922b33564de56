"""The off-policy keys (posttrain.config.async_rollout and the seed's rule 20): honoured where
they run, refused by key elsewhere, and the plan computes the old log-probs whenever the rollout's
policy may differ from the trainer's."""

from __future__ import annotations

import copy

import pytest

from posttrain.config.check import check_run_config
from posttrain.config.options import off_policy_options
from posttrain.config.run import run_config_from_dict
from posttrain.errors import ConfigError

BASE = {
    "megatron_training": {"stage": "ray_grpo", "global_batch_size": 4, "seq_length": 256, "micro_batch_size": 2,
                          "train_iters": 4},
    "rl_config": {"n_samples_per_prompt": 4, "mini_batch_size": 4, "verifier_function": ["base_acc"],
                  "verifier_weight": [1.0]},
    "generate_config": {"infer_tensor_parallel_size": 1, "max_model_len": 256, "sampling_config": {"max_tokens": 64}},
}


def config(overrides=(), base=BASE):
    return run_config_from_dict(copy.deepcopy(base), overrides=list(overrides))


def check(overrides=(), base=BASE):
    return check_run_config(config(overrides, base), device_type="cpu")


def refusal(overrides, base=BASE) -> str:
    with pytest.raises(ConfigError) as err:
        check(overrides, base)
    return str(err.value)


def test_the_off_policy_keys_are_honoured_without_warnings():
    _, warnings = check(["rl_config.async_staleness=2", "rl_config.rollout_correction=mis",
                         "rl_config.rollout_correction_cap=3.0", "rl_config.rollout_correction_level=sequence",
                         "rl_config.partial_rollout_max_split=4", "rl_config.require_max_age_all_finished=false"])
    assert not any("async" in w or "partial" in w or "correction" in w for w in warnings)


@pytest.mark.parametrize("placement", [["rl_config.actor_resource.num_npus=2"],  # Ray actor workers (DDP)
                                       ["rl_config.actor_resource.num_npus=2", "rl_config.ray_sharding=fsdp2"],
                                       ["rl_config.actor_resource.num_npus=2", "actor_config.tensor_model_parallel_size=2"]])
def test_partial_rollout_runs_on_every_placement(placement):
    """Ray actor workers (DDP, FSDP2) and the megatron backend (TP2) take partial rollout."""
    _, warnings = check(["rl_config.partial_rollout_max_split=2", *placement])
    assert not any("partial" in w for w in warnings)


@pytest.mark.parametrize("sharding", ["ddp", "fsdp2"])
def test_async_staleness_runs_on_ray_actor_workers_with_the_native_engine(sharding):
    _, warnings = check(["rl_config.async_staleness=1", "rl_config.actor_resource.num_npus=2",
                         f"rl_config.ray_sharding={sharding}"])
    assert not any("async" in w for w in warnings)


def test_async_staleness_runs_with_vllm_on_the_megatron_backend():
    """Accepted (the compatibility rows are checked before the vllm package, which this venv may lack)."""
    overrides = ["rl_config.async_staleness=1", "rl_config.actor_resource.num_npus=2",
                 "actor_config.tensor_model_parallel_size=2", "rl_config.rollout_engine=vllm"]
    try:
        plan, warnings = check(overrides)
    except ConfigError as err:
        assert "needs the vllm package" in str(err) and "async" not in str(err), err
        return
    assert plan.off_policy.staleness == 1 and plan.rollout.engine == "vllm"
    assert not any("async" in w for w in warnings)


def test_staleness_zero_and_a_single_iteration_say_that_nothing_overlaps():
    _, warnings = check(["rl_config.async_staleness=0"])
    assert any("never overlap" in w for w in warnings)
    _, warnings = check(["rl_config.async_staleness=1", "megatron_training.train_iters=1"])
    assert any("nothing to overlap" in w for w in warnings)


@pytest.mark.parametrize("overrides, words", [
    (["rl_config.async_staleness=-1"], "rl_config.async_staleness=-1: must be an integer >= 0 (0: the rollout uses"),
    (["rl_config.rollout_correction_cap=1.0"], "rl_config.rollout_correction_cap=1.0: must be a finite number > 1"),
    (["rl_config.rollout_correction_cap=.inf"], "rollout_correction_cap=inf"),
    (["rl_config.rollout_correction=clip"], "rl_config.rollout_correction='clip': must be one of none, tis, mis"),
    (["rl_config.rollout_correction_level=batch"], "rl_config.rollout_correction_level='batch'"),
    (["rl_config.partial_rollout_max_split=2", "rl_config.guarantee_order=true"],
     "guarantee_order must be false when partial_rollout_max_split > 1"),  # the seed's rule 20
    (["rl_config.partial_rollout_max_split=0"],
     "rl_config.partial_rollout_max_split=0: must be an integer >= 1 (1: off)"),
    (["rl_config.partial_rollout_max_split=65"], "more than sampling_config.max_tokens=64"),
    (["rl_config.async_staleness=1", "rl_config.rollout_engine=mine"], "async_staleness runs on the native and vLLM"),
    (["rl_config.separate_rollout_worker=true", "rl_config.rollout_engine=mine"],
     "separate_rollout_worker: true runs on"),
    (["rl_config.use_integrated_worker=false", "rl_config.rollout_engine=mine"],
     "use_integrated_worker: false (the deprecated spelling of rl_config.separate_rollout_worker: true) runs on"),
    (["rl_config.separate_rollout_worker=true", "rl_config.actor_resource.num_npus=2"], "with Ray actor workers is not"),
    (["rl_config.partial_rollout_max_split=2", "rl_config.rollout_engine=mine"], "runs on the native and vLLM"),
    (["rl_config.async_staleness=1", "actor_config.lora_target_modules=[linear_qkv]", "actor_config.lora_r=4"],
     "with LoRA is not supported yet"),
])
def test_bad_off_policy_settings_are_refused_by_key(overrides, words):
    assert words in refusal(overrides)


def test_partial_rollout_with_dynamic_sampling_is_refused():
    base = copy.deepcopy(BASE)
    base["megatron_training"]["stage"] = "ray_dapo"
    base["rl_config"].update(filter_groups_enable=True, filter_groups_metric="base_acc",
                             filter_groups_train_batch_size=2, mini_batch_size=2)
    assert "with DAPO's dynamic sampling" in refusal(["rl_config.partial_rollout_max_split=2"], base)


@pytest.mark.parametrize("overrides, computed", [
    ([], False), (["rl_config.async_staleness=0"], True), (["rl_config.rollout_correction=tis"], True),
    (["rl_config.partial_rollout_max_split=2"], True), (["rl_config.separate_rollout_worker=true"], True),
    (["rl_config.use_integrated_worker=false"], True),  # the deprecated spelling
])
def test_the_old_logprobs_are_computed_whenever_the_rollout_may_be_off_policy(overrides, computed):
    assert off_policy_options(config(overrides)).any is computed
