"""One test per validation message (the seed's validate_rl_args, seed_system.md 3.6)."""

from __future__ import annotations

import copy

import pytest

from posttrain.config.check import check_run_config
from posttrain.config.run import run_config_from_dict
from posttrain.config.validate import validate_run_config
from posttrain.errors import ConfigError

BASE = {
    "megatron_training": {"stage": "ray_grpo", "global_batch_size": 8, "seq_length": 1024,
                          "micro_batch_size": 2},
    "actor_config": {"micro_batch_size": 2},
    "rl_config": {"n_samples_per_prompt": 4, "mini_batch_size": 4, "actor_resource": {"num_npus": 4}},
    "generate_config": {"infer_tensor_parallel_size": 2, "max_model_len": 2048,
                        "sampling_config": {"max_tokens": 512}},
}


def check(overrides, device_type="cpu", num_nodes=1, base=BASE):
    cfg = run_config_from_dict(copy.deepcopy(base), overrides=overrides)
    if num_nodes != 1:
        return validate_run_config(cfg, device_type=device_type, num_nodes=num_nodes)
    return check_run_config(cfg, device_type=device_type)[0]  # the one check of plan and train


def test_base_is_valid_and_derives_dispatch_sizes():
    cfg = run_config_from_dict(copy.deepcopy(BASE))
    layout = validate_run_config(cfg)
    # actor dp = 4 devices / (TP1*PP1*CP1) = 4; infer dp = 4 / 2 = 2; gbs*n = 32
    assert (layout.actor_dp, layout.infer_dp) == (4, 2)
    d = layout.dispatch_sizes
    assert d["actor_rollout_dispatch_size"] == 16  # 32 // infer_dp 2
    assert d["actor_logprob_dispatch_size"] == 8  # 32 // actor_dp 4
    assert d["actor_update_dispatch_size"] == 8
    assert d["ref_dispatch_size"] == 8
    assert d["adv_dispatch_size"] == 32
    assert d["reward_dispatch_size"] == 32  # rule reward: 32 // 1 node
    # derived, never written back: the config the user wrote is the config the run reads
    assert cfg.rl.actor_rollout_dispatch_size is None and cfg.rl.adv_dispatch_size is None


CASES = [
    (["megatron_training.ai_framework=jax"], "Invalid value for ai_framework: 'jax'. Only None or mindspore are allowed"),
    (["rl_config.reference_resource.num_npus=2"], "reference_resource should not be set when use_integrated_worker mode is on."),
    (["ref_config.micro_batch_size=2"], "ref_config should not be set when use_integrated_worker mode is on."),
    (["rl_config.use_integrated_worker=false", "rl_config.integrated_mode_config={ref_model_load_path: x}"],
     "integrated_mode_config should not be set when use_integrated_worker mode is off."),
    (["generate_config.max_model_len=512"],
     "Sequence length exceeds vLLM max_model_len! Actor.seq_length=1024 vs GenerateConfig.max_model_len=512"),
    (["actor_config.context_parallel_size=2", "actor_config.context_parallel_algo=foo"],
     "Now just support ulysses CP and megatron cp(ring)"),
    (["actor_config.context_parallel_size=2", "actor_config.context_parallel_algo=megatron_cp_algo",
      "rl_config.use_remove_padding=true", "actor_config.reset_attention_mask=false"],
     "when use ring cp and remove_padding, reset_attention_mask must be true"),
    (["rl_config.use_remove_padding=true", "actor_config.pipeline_model_parallel_size=2"],
     "'use_remove_padding' feature requires 'no_pad_to_seq_lengths=True' when using pipeline parallelism!"),
    (["rl_config.use_remove_padding=true", "actor_config.reset_attention_mask=false"],
     "'use_remove_padding' feature requires 'reset_attention_mask=True'! "),
    (["actor_config.tensor_model_parallel_size=3"],
     "Invalid Actor resource allocation! Resource=4 must be divisible by (tensor_parallel * pipeline_parallel * "
     "context_parallel) = 3*1*1=3"),
    (["actor_config.micro_batch_size=3"],
     "Invalid Actor batch configuration! (global_batch_size * n_samples) = 8*4 = 32 must be divisible by "
     "micro_batch_size 3"),
    (["generate_config.infer_pipeline_parallel_size=2", "generate_config.infer_tensor_parallel_size=1"],
     "pipeline_parallel for vllm is not supported yet ! "),
    (["megatron_training.global_batch_size=6", "rl_config.mini_batch_size=6"],
     "Actor global_batch_size 6 must be divisible by data_parallel_size 4"),
    (["actor_config.micro_batch_size=8", "megatron_training.global_batch_size=4", "rl_config.mini_batch_size=4",
      "rl_config.n_samples_per_prompt=2"],
     "Actor global_batch_size 4  // data_parallel 4  * n_samples 2 must be divisible by micro_batch_size 8 "),
    (["rl_config.actor_rollout_dispatch_size=5"],
     "Generation global_batch_size 8  // data_parallel 2  * n_samples 4 must be divisible by micro_batch_size 5 "),
    (["rl_config.ref_dispatch_size=3"], "Reference global_batch_size 8 must be divisible by experience_count 3"),
    (["rl_config.adv_dispatch_size=5"], "Advantages global_batch_size 8 must be divisible by experience_count 5"),
    (["rl_config.share_backbone=true"], "The shared backbone can only be used with LoRA."),
    (["rl_config.share_backbone=true", "actor_config.lora_target_modules=[linear_qkv]", "megatron_training.stage=ray_dapo"],
     "'share_backbone' cannot be True when 'stage' is set to 'ray_dapo'."),
    (["rl_config.actor_update_dispatch_size=2"],
     "actor_update_dispatch_size=2 must be >= mini_batch_size/actor_data_parallel_size (16/4=4)"),
    (["rl_config.actor_logprob_dispatch_size=16"],
     "actor_logprob_dispatch_size 16 cannot be greater than the number of samples generated on each data parallel "
     "worker, which is global_batch_size * n_samples_per_prompt // data_parallel_size = 8*4//4 = 8"),
    (["rl_config.verifier_function=[acc,format]"], "Verifier function and weight length mismatch: 2 vs 1"),
    (["rl_config.overlong_buffer_enable=true", "rl_config.overlong_buffer=512", "rl_config.rollout_max_tokens=512"],
     "Response max length 512 must greater than Dapo overlong buffer 512"),
    (["rl_config.overlong_buffer_enable=true", "rl_config.overlong_buffer=128"],
     "overlong rollout_max_tokens and generate rollout_max_tokens mismatch: 2048 vs 512"),
    (["rl_config.clip_higher_enable=true", "rl_config.clip_ratio_low=0.3", "rl_config.clip_ratio_high=0.2"],
     "clip_ratio_low 0.3 must less than clip_ratio_high 0.2"),
    (["megatron_training.stage=ray_dapo", "rl_config.filter_groups_enable=true", "rl_config.filter_groups_metric=acc",
      "rl_config.filter_groups_train_batch_size=4"],
     "filter_groups_metric acc must in verifier_function ['base_acc']"),
    (["rl_config.partial_rollout_max_split=2", "rl_config.guarantee_order=true"],
     "guarantee_order must be false when partial_rollout_max_split > 1"),
    (["rl_config.multi_turn_enable=true", "rl_config.async_engine=true"],
     "max_total_response_length must greater than max_tokens:0 vs 512"),
    (["rl_config.multi_turn_enable=true", "rl_config.max_total_response_length=1024"],
     "async_engine must be True when multi_turn_enable is True"),
    # posttrain's own rules
    (["megatron_training.stage=foo"], "unknown stage 'foo'"),
    (["rl_config.mini_batch_size=3"], "rl_config.mini_batch_size 3 must divide global_batch_size 8"),
    (["rl_config.kl_penalty=full"], "Unknown KL penalty 'full'; known: abs, kl, low_var_kl, mse"),
    (["rl_config.kl_ctrl_type=pid"], "rl_config.kl_ctrl_type='pid': must be one of fixed, adaptive"),
    (["rl_config.kl_ctrl_type=adaptive", "rl_config.kl_horizon=0"],
     "rl_config.kl_horizon must be larger than 0. Got 0"),  # the seed's KL controller's check
    (["megatron_training.seq_length=null"], "megatron_training.seq_length is not set"),
    (["generate_config.dtype=int8"], "generate_config.dtype='int8': must be one of bfloat16, float32, float16"),
]


@pytest.mark.parametrize("overrides,message", CASES, ids=[c[1][:50] for c in CASES])
def test_validation_message(overrides, message):
    with pytest.raises(ConfigError) as err:
        check(overrides)
    assert message in str(err.value)


def test_bf16_required_on_accelerators_only():
    overrides = ["generate_config.dtype=float32"]
    check(overrides, device_type="cpu")  # fine on a CPU
    with pytest.raises(ConfigError, match="megatron_config.bf16 should be true and generate_config.dtype"):
        check(overrides, device_type="cuda")


def test_rule_reward_needs_gbs_divisible_by_nodes():
    with pytest.raises(ConfigError, match="global_batch_size 8 must be divisible by the number of nodes"):
        check([], num_nodes=3)


def test_dynamic_sampling_dispatch_divisible_by_n():
    with pytest.raises(ConfigError, match="dynamic sampling dispatch size 8 must be divisible by n samples per prompt 3"):
        check(["megatron_training.stage=ray_dapo", "rl_config.filter_groups_enable=true",
               "rl_config.filter_groups_metric=base_acc", "rl_config.filter_groups_train_batch_size=4",
               "rl_config.dynamic_sampling_dispatch_size=8", "rl_config.n_samples_per_prompt=3",
               "actor_config.micro_batch_size=1", "rl_config.actor_rollout_dispatch_size=12"])


def test_dpo_unknown_loss_type():
    base = {"megatron_training": {"stage": "dpo", "global_batch_size": 4, "micro_batch_size": 1, "seq_length": 64,
                                  "dpo_loss_type": "simpo"}}
    with pytest.raises(ConfigError, match=r"Unknown loss type: simpo. Should be one of \['sigmoid', 'hinge', 'ipo', 'kto_pair', 'orpo', 'kto'\]"):
        check([], base=base)


def test_profiler_messages():
    with pytest.raises(ConfigError, match="profiler_level only supports level0, 1, 2, and level_none, but gets level9"):
        check(["profiler_config.integrated.profile_level=level9"])
    with pytest.raises(ConfigError, match="profile_export_type only supports text or db"):
        check(["profiler_config.integrated.profile_export_type=csv"])
