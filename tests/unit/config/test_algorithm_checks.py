"""For each algorithm, wrong configs fail the one config check with a clear message; the plan maps
keys to the actor loss and the roles each stage builds."""

from __future__ import annotations

import copy

import pytest

from posttrain.config.check import check_run_config
from posttrain.config.plan import resolve_plan
from posttrain.config.run import run_config_from_dict
from posttrain.errors import ConfigError

BASE = {
    "megatron_training": {"stage": "ray_grpo", "global_batch_size": 8, "seq_length": 256, "micro_batch_size": 4},
    "rl_config": {"n_samples_per_prompt": 4, "mini_batch_size": 4, "verifier_function": ["acc", "format"],
                  "verifier_weight": [1.0, 0.5]},
    "generate_config": {"infer_tensor_parallel_size": 1, "max_model_len": 512, "sampling_config": {"max_tokens": 128}},
}


def make(stage, rl=None, sections=None, train=None):
    data = copy.deepcopy(BASE)
    rl = dict(rl or {})
    if "global_batch_size" in rl:
        data["megatron_training"]["global_batch_size"] = rl.pop("global_batch_size")
    data["megatron_training"]["stage"] = stage
    data["megatron_training"].update(train or {})
    data["rl_config"].update(rl or {})
    data.update(copy.deepcopy(sections or {}))
    return run_config_from_dict(data)


def check(cfg):
    check_run_config(cfg)


@pytest.mark.parametrize("stage,rl", [
    ("ray_grpo", {}),
    ("ray_grpo", {"adv_estimator": "rloo", "policy_loss": "gspo", "loss_agg_mode": "seq-mean-token-sum-norm",
                  "clip_ratio_c": 3.0}),
    ("ray_dapo", {"filter_groups_enable": True, "filter_groups_metric": "acc", "filter_groups_train_batch_size": 4,
                  "clip_higher_enable": True, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28}),
    ("ray_ppo", {"adv_estimator": "gae", "use_kl_in_reward": True}),
    ("ray_grpo", {"policy_loss": "sapo", "sapo_tau_neg": 2.0, "rollout_correction": "icepop",
                  "rollout_correction_cap": 5.0, "rollout_correction_floor": 0.5}),
    ("ray_dapo", {"policy_loss": "cispo", "clip_higher_enable": True, "clip_ratio_low": 0.2, "clip_ratio_high": 4.0}),
    ("ray_grpo", {"policy_loss": "gpg"}),
])
def test_good_configs_pass(stage, rl):
    check(make(stage, rl))


@pytest.mark.parametrize("stage,rl,message", [
    # GRPO
    ("ray_grpo", {"adv_estimator": "gae"}, "'gae' needs a critic; it is only valid with stage ray_ppo"),
    ("ray_grpo", {"use_kl_in_reward": True}, "use_kl_in_reward is a PPO option"),
    ("ray_grpo", {"filter_groups_enable": True, "filter_groups_metric": "acc"}, "filter_groups_enable .* is a DAPO"),
    ("ray_grpo", {"adv_estimator": "best"}, "Unknown advantage estimator .*known: .*rloo"),
    ("ray_grpo", {"policy_loss": "ppo2"}, "Unknown policy loss 'ppo2'; known: .*gspo"),
    ("ray_grpo", {"loss_agg_mode": "sum"}, "Unknown loss aggregation mode 'sum'; known: .*seq-mean-token-sum-norm"),
    ("ray_grpo", {"clip_ratio_c": 0.5}, r"^rl_config.clip_ratio_c=0.5: must be a finite number > 1 \(dual-clip PPO"),
    ("ray_grpo", {"clip_ratio": -0.5}, r"^rl_config.clip_ratio=-0.5: must be a finite number >= 0"),
    ("ray_grpo", {"kl_ctrl_type": "adaptive", "kl_horizon": -1}, "rl_config.kl_horizon must be larger than 0"),
    ("ray_grpo", {"adv_estimator": "rloo", "n_samples_per_prompt": 1, "mini_batch_size": 8},
     "'rloo' needs n_samples_per_prompt >= 2"),
    # DAPO
    ("ray_dapo", {"filter_groups_enable": True, "filter_groups_metric": "math_verify", "filter_groups_train_batch_size": 4},
     r"filter_groups_metric math_verify must in verifier_function \['acc', 'format'\]"),
    ("ray_dapo", {"filter_groups_enable": True, "filter_groups_metric": "acc", "filter_groups_train_batch_size": 6,
                  "global_batch_size": 12}, "mini_batch_size 4 must divide filter_groups_train_batch_size 6"),
    ("ray_dapo", {"clip_higher_enable": True, "clip_ratio_low": 0.3, "clip_ratio_high": 0.2},
     "clip_ratio_low 0.3 must less than clip_ratio_high 0.2"),
    ("ray_dapo", {"overlong_buffer_enable": True, "overlong_buffer": 128, "rollout_max_tokens": 128},
     "Response max length 128 must greater than Dapo overlong buffer 128"),
    ("ray_dapo", {"overlong_buffer_enable": True, "overlong_buffer": 32, "rollout_max_tokens": 256},
     "overlong rollout_max_tokens and generate rollout_max_tokens mismatch: 256 vs 128"),
    ("ray_dapo", {"adv_estimator": "gae"}, "needs a critic"),
    # PPO
    ("ray_ppo", {}, "stage ray_ppo trains a critic and needs rl_config.adv_estimator: gae"),
    ("ray_ppo", {"adv_estimator": "gae", "cliprange_value": 0.0}, "rl_config.cliprange_value=0.0: must be a finite "
                                                                  "number > 0"),
    ("ray_ppo", {"adv_estimator": "gae", "lam": 1.5}, r"rl_config.lam=1.5: must be a number in \[0, 1\]"),
    ("ray_ppo", {"adv_estimator": "gae", "gamma": -0.1}, r"rl_config.gamma=-0.1: must be a number in \[0, 1\]"),
    ("ray_ppo", {"adv_estimator": "gae", "use_kl_in_reward": True, "init_kl_coef": 0.0}, "needs init_kl_coef > 0"),
    ("ray_ppo", {"adv_estimator": "gae", "filter_groups_enable": True}, "is a DAPO option"),
    ("ray_grpo", {"sapo_tau_pos": 2.0}, "rl_config.sapo_tau_pos is the temperature of SAPO's gate, and "
                                        "rl_config.policy_loss is 'ppo'; set policy_loss: sapo or remove the key"),
    ("ray_grpo", {"rollout_correction": "tis", "rollout_correction_floor": 0.5},
     "rollout_correction_floor is the lower edge of the band of mis and icepop"),
    ("ray_grpo", {"rollout_correction": "icepop", "rollout_correction_floor": 1.5},
     r"rl_config.rollout_correction_floor=1.5: must be a number in \(0, 1\)"),
])
def test_wrong_config_message(stage, rl, message):
    with pytest.raises(ConfigError, match=message):
        check(make(stage, rl))


def test_dapo_rejects_ref_config_with_the_seed_message():
    cfg = make("ray_dapo", sections={"ref_config": {"micro_batch_size": 4}})
    with pytest.raises(ConfigError) as err:
        check(cfg)
    assert str(err.value).splitlines()[0] == "ref_config should not be set when use_integrated_worker mode is on."
    cfg = make("ray_dapo", rl={"use_integrated_worker": False}, sections={"ref_config": {"micro_batch_size": 4}})
    with pytest.raises(ConfigError, match="ref_config should not be set"):
        check(cfg)


def test_critic_config_only_for_ppo():
    with pytest.raises(ConfigError, match="critic_config is only used by stage ray_ppo"):
        check(make("ray_grpo", sections={"critic_config": {"micro_batch_size": 4}}))
    cfg = make("ray_ppo", rl={"adv_estimator": "gae"}, sections={"critic_config": {"micro_batch_size": 2,
                                                                                  "lr": 1e-5}})
    check(cfg)
    assert cfg.critic.micro_batch_size == 2 and cfg.critic.seq_length == 256  # megatron_training + critic_config


DPO = {"global_batch_size": 8, "micro_batch_size": 4, "is_pairwise_dataset": True}


@pytest.mark.parametrize("train,message", [
    ({"dpo_loss_type": "simpo"}, r"Unknown loss type: simpo. Should be one of \['sigmoid', 'hinge', 'ipo', "
                                 r"'kto_pair', 'orpo', 'kto'\]"),
    ({"is_pairwise_dataset": False}, "set megatron_training.is_pairwise_dataset: true"),
    ({"dpo_beta": 0.0}, r"^megatron_training.dpo_beta=0.0: must be a finite number > 0 \(the seed's default is 0.1\)"),
    ({"dpo_label_smoothing": 0.5}, r"^megatron_training.dpo_label_smoothing=0.5: must be a number in \[0, 0.5\)"),
    ({"pref_ftx": -1.0}, r"^megatron_training.pref_ftx=-1.0: must be a finite number >= 0"),
])
def test_dpo_wrong_config_message(train, message):
    with pytest.raises(ConfigError, match=message):
        check(make("dpo", train={**DPO, **train}))


KTO = {"global_batch_size": 8, "micro_batch_size": 4, "dpo_loss_type": "kto"}


@pytest.mark.parametrize("stage_train,message", [
    ({**KTO, "is_pairwise_dataset": True}, "dpo_loss_type: kto trains on unpaired rows .* set megatron_training"
                                           ".is_pairwise_dataset: false .* handler_name: UnpairedPreferenceHandler"),
    ({**KTO, "dpo_label_smoothing": 0.1}, r"megatron_training.dpo_label_smoothing=0.1 is for the pairwise DPO losses"),
    ({**KTO, "pref_ftx": 0.5}, r"megatron_training.pref_ftx=0.5 is for the pairwise DPO losses"),
    ({**KTO, "global_batch_size": 1, "micro_batch_size": 1}, r"global_batch_size=1: dpo_loss_type: kto .* at least 2"),
    ({**DPO, "kto_desirable_weight": 2.0}, r"kto_desirable_weight=2.0 weighs KTO's rows .* not dpo_loss_type: sigmoid"),
    ({**KTO, "kto_undesirable_weight": 0.0}, r"^megatron_training.kto_undesirable_weight=0.0: must be a finite number"),
])
def test_kto_wrong_config_message(stage_train, message):
    with pytest.raises(ConfigError, match=message):
        check(make("dpo", train=stage_train))


def test_kto_good_config_reaches_the_plan():
    cfg = make("dpo", train={**KTO, "dpo_beta": 0.2, "kto_desirable_weight": 1.3, "kto_undesirable_weight": 0.7})
    check(cfg)
    plan = resolve_plan(cfg)
    assert plan.uses_reference and plan.dpo.unpaired
    assert (plan.dpo.beta, plan.dpo.desirable_weight, plan.dpo.undesirable_weight) == (0.2, 1.3, 0.7)
    assert plan.stage.loop == "posttrain.loops.dpo:preference_trainer"


def test_dpo_good_config():
    check(make("dpo", train={**DPO, "dpo_loss_type": "kto_pair", "dpo_label_smoothing": 0.1, "pref_ftx": 0.5}))
    assert resolve_plan(make("dpo", train=DPO)).uses_reference
    assert not resolve_plan(make("dpo", train={**DPO, "dpo_loss_type": "orpo"})).uses_reference  # reference-free


# ---- what the plan hands the actor loss and which roles it builds ---------------------------------
def test_grpo_loss_options():
    plan = resolve_plan(make("ray_grpo", {"kl_penalty": "kl", "clip_ratio": 0.3}))
    loss = plan.actor_loss
    assert loss.clip_low == loss.clip_high == 0.3
    assert loss.kl_penalty == "kl" and loss.loss_agg_mode == "token-mean" and loss.norm_length is None
    assert plan.uses_reference and not plan.uses_critic


def test_sapo_temperatures_reach_the_loss():
    assert resolve_plan(make("ray_grpo", {"policy_loss": "sapo", "sapo_tau_neg": 2.0})).actor_loss.policy_params == (
        ("tau_pos", 1.0), ("tau_neg", 2.0))
    assert resolve_plan(make("ray_grpo", {"policy_loss": "cispo"})).actor_loss.policy_params == ()


def test_dapo_clip_higher_token_level_loss_and_no_reference():
    plan = resolve_plan(make("ray_dapo", {"clip_higher_enable": True, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28,
                                          "token_level_loss": False, "init_kl_coef": 0.5}))
    loss = plan.actor_loss
    assert (loss.clip_low, loss.clip_high) == (0.2, 0.28)
    assert loss.loss_agg_mode == "seq-mean-token-mean"
    assert not plan.uses_reference
    loss = resolve_plan(make("ray_dapo", {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28})).actor_loss  # clip-higher off
    assert loss.clip_low == loss.clip_high == 0.2 and loss.loss_agg_mode == "token-mean"


def test_loss_agg_mode_override_and_norm_length():
    loss = resolve_plan(make("ray_dapo", {"loss_agg_mode": "seq-mean-token-sum-norm", "token_level_loss": True})).actor_loss
    assert loss.loss_agg_mode == "seq-mean-token-sum-norm" and loss.norm_length == 128.0


def test_ppo_reference_only_for_kl_in_reward():
    assert not resolve_plan(make("ray_ppo", {"adv_estimator": "gae"})).uses_reference
    plan = resolve_plan(make("ray_ppo", {"adv_estimator": "gae", "use_kl_in_reward": True}))
    assert plan.uses_reference and plan.uses_critic and plan.stage.metric_prefix == "critic"


def test_dpo_uses_a_reference_and_counts_chosen_tokens():
    plan = resolve_plan(make("dpo", train={**DPO}))
    assert plan.uses_reference and plan.actor_engine.loss_mask_key == "chosen_response_mask"
    assert plan.optimizer_steps_per_iteration == 1
