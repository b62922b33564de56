"""The seed's separated roles in the config (posttrain.config.separated): ``use_integrated_worker:
false`` with role resources puts the reference / reward model in worker groups of their own (the
plan says where, and so does ``posttrain plan``); without them it is the deprecated spelling of
``separate_rollout_worker: true`` (one warning naming the new key); ``ref_config`` is read for a
separated reference only, its other keys refused by name; ``blocking: false`` only there."""

from __future__ import annotations

import pytest

from posttrain.commands.plan import format_plan
from posttrain.config.arch import model_arch
from posttrain.config.check import check_run_config
from posttrain.config.plan import resolve_plan
from posttrain.config.run import load_run_config
from posttrain.config.separated import DEPRECATED_ROLLOUT_WORKER
from posttrain.errors import ConfigError

# the 7B recipe in one process, with a reference (a KL term)
BASE = ["actor_config.tensor_model_parallel_size=1", "actor_config.pipeline_model_parallel_size=1",
        "rl_config.actor_resource.num_npus=1", "generate_config.infer_tensor_parallel_size=1",
        "rl_config.ignore_memory_estimate=true", "rl_config.init_kl_coef=0.001"]
SEPARATED = ["rl_config.use_integrated_worker=false", "rl_config.reference_resource.num_npus=2"]


@pytest.fixture(autouse=True)
def _no_ray_address(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def config(*overrides):
    return load_run_config("r1_zero_qwen25_7b", overrides=[*BASE, *overrides])


def plan_of(*overrides):
    cfg = config(*overrides)
    return resolve_plan(cfg, model_arch(cfg), device="cpu")


def warnings_of(*overrides) -> list[str]:
    cfg = config(*overrides)
    return check_run_config(cfg, device_type="cpu", arch=model_arch(cfg))[1]


def test_the_old_spelling_of_the_rollout_worker_still_runs_it_with_one_warning():
    old, new = plan_of("rl_config.use_integrated_worker=false"), plan_of("rl_config.separate_rollout_worker=true")
    assert old.off_policy.separate_worker and new.off_policy.separate_worker
    assert not old.separated and not old.use_ray  # the trainer in this process, as before
    assert warnings_of("rl_config.use_integrated_worker=false").count(DEPRECATED_ROLLOUT_WORKER) == 1
    assert "rl_config.separate_rollout_worker: true" in DEPRECATED_ROLLOUT_WORKER
    assert DEPRECATED_ROLLOUT_WORKER not in warnings_of("rl_config.separate_rollout_worker=true")


def test_role_resources_put_the_roles_in_groups_of_their_own():
    plan = plan_of(*SEPARATED, "ref_config.load=/models/ref", "ref_config.micro_batch_size=4")
    assert plan.use_ray and plan.workers == 1 and not plan.off_policy.separate_worker
    assert plan.separated.devices == {"reference": 2} and plan.separated.blocking
    assert plan.policy.reference_load == "/models/ref" and plan.separated.reference_micro_batch_size == 4
    assert plan.memory.reference == 0  # not on the actor's workers
    assert plan_of().memory.reference > 0
    text = format_plan(plan)
    assert "1 Ray worker(s), ddp (actor), 2 reference worker(s)" in text
    assert "reference (a worker group of its own)" in text
    assert not plan_of(*SEPARATED, "rl_config.blocking=false").separated.blocking
    assert DEPRECATED_ROLLOUT_WORKER not in warnings_of(*SEPARATED)


@pytest.mark.parametrize("overrides, words", [
    (["ref_config.lr=0.5"], "ref_config.lr=0.5: the separated reference reads only ref_config.load"),
    (["ref_config.use_remove_padding=false"], "ref_config.use_remove_padding=false"),
    (["rl_config.init_kl_coef=0"], "rl_config.reference_resource={num_npus: 2}: this run has no reference"),
])
def test_what_a_separated_reference_cannot_honour_is_refused_by_name(overrides, words):
    with pytest.raises(ConfigError) as err:
        warnings_of(*SEPARATED, *overrides)
    assert words in str(err.value)


def test_ref_config_repeating_the_actors_values_is_accepted():
    actor = config().actor
    warnings_of(*SEPARATED, f"ref_config.seq_length={actor.seq_length}", "ref_config.micro_batch_size=1")


def test_blocking_false_and_ref_config_need_separated_roles():
    with pytest.raises(ConfigError, match="rl_config.blocking: false overlaps the passes of roles in worker groups"):
        warnings_of("rl_config.blocking=false")
    with pytest.raises(ConfigError, match="ref_config configures a reference in a worker group of its own"):
        warnings_of("rl_config.use_integrated_worker=false", "ref_config.micro_batch_size=2")


PPO = ["megatron_training.stage=ray_ppo", "rl_config.adv_estimator=gae", "critic_config.save=/ckpt/critic"]


def test_a_critic_group_of_its_own_for_ppo():
    plan = plan_of(*PPO, "rl_config.use_integrated_worker=false", "rl_config.critic_resource.num_npus=2")
    assert plan.separated.devices == {"critic": 2} and plan.use_ray and plan.workers == 1
    assert plan.memory.critic == 0 and plan_of(*PPO).memory.critic > 0  # not on the actor's workers
    assert "1 Ray worker(s), ddp (actor), 2 critic worker(s)" in format_plan(plan)


@pytest.mark.parametrize("overrides, words", [
    (["rl_config.critic_resource.num_npus=2"], "rl_config.critic_resource={num_npus: 2}: this stage has no critic"),
    ([*PPO, "rl_config.critic_resource.num_npus=3"], "cannot be shared equally by 3 critic workers"),
    ([*PPO, "critic_config.save=null", "rl_config.critic_resource.num_npus=2"],
     "a critic in a worker group of its own writes checkpoints of its own"),
])
def test_what_a_critic_group_cannot_run_is_refused_by_name(overrides, words):
    with pytest.raises(ConfigError) as err:
        warnings_of("rl_config.use_integrated_worker=false", *overrides)
    assert words in str(err.value)
