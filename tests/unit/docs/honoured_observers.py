"""Observers of the honoured keys other than the architecture's (tests/unit/docs/test_honoured_keys.py).

Most keys are observed in the plan (:class:`posttrain.config.plan.Plan`, every derived value a run
reads): a change of the key, on a shipped tiny config with the context the key needs, must change
the plan. ``OBSERVERS`` gives that change where another value of the key's type (:func:`other_values`,
relative to the config's value) is not enough. The keys a plan does not carry (a run's inputs and
outputs, the loggers, the Ray cluster...) are observed by a named test (``ELSEWHERE``)."""

from __future__ import annotations

import dataclasses
import json
import typing

SECTION_OF = {"MegatronConfig": "actor_config", "RLConfig": "rl_config", "GenerateConfig": "generate_config",
              "SamplingConfig": "generate_config.sampling_config", "ProfilerConfig": "profiler_config.integrated",
              "Resource": "rl_config.actor_resource", "MsprobeConfig": "msprobe_config"}
BASE = "grpo_tiny_qwen2"
RAY = ["rl_config.actor_resource.num_npus=2"]
PROFILE = ["profiler_config.integrated.profile=true"]
DYNAMIC = ["rl_config.use_dynamic_bsz=true"]
LORA = ["actor_config.lora_target_modules=[q_proj,v_proj]"]
ASYNC = ["rl_config.async_staleness=1"]
MSPROBE = ["msprobe_config.msprobe=true"]
JUDGE = ["rl_config.judge_path=policy"]
KTO = ["actor_config.dpo_loss_type=kto", "actor_config.is_pairwise_dataset=false"]
MULTI_TURN_KEYS = ("max_tool_calls", "max_total_response_length", "tool_config_path", "tool_parser_format",
                   "max_parallel_calls", "max_tool_response_length", "tool_response_truncate_side")
NAMES = ("tool_config_path", "tool_parser_format", "tool_response_truncate_side")
NO_TOOLS = ["rl_config.multi_turn_enable=false",
            *(f"rl_config.{k}={'null' if k in NAMES else 0}" for k in MULTI_TURN_KEYS)]
TOOLS = ["rl_config.multi_turn_enable=true", "rl_config.max_tool_calls=2", "rl_config.max_total_response_length=64",
         "rl_config.tool_config_path=configs/tools/retool.yaml"]

NO_EVAL = ["rl_config.eval_data_path=null"]  # the held-out evaluation takes no images (compat row mm-eval)
MM = [*NO_EVAL, "rl_config.is_multimodal=true", "rl_config.freeze_vision_tower=true"]

# key -> (config name, context overrides of both plans, the change)
OBSERVERS: dict[str, tuple[str, list[str], list[str]]] = {
    "rl_config.is_multimodal": (BASE, NO_EVAL, ["rl_config.is_multimodal=true"]),
    "rl_config.freeze_vision_tower": (BASE, [*NO_EVAL, "rl_config.is_multimodal=true"],
                                      ["rl_config.freeze_vision_tower=true"]),
    "rl_config.reuse_image_embeds": (BASE, MM, ["rl_config.reuse_image_embeds=true"]),
    "rl_config.vit_forward_micro_batch_size": (BASE, MM, ["rl_config.vit_forward_micro_batch_size=2"]),
    "rl_config.actor_image_embeds_dispatch_size": (BASE, [*MM, "rl_config.reuse_image_embeds=true"],
                                                   ["rl_config.actor_image_embeds_dispatch_size=2"]),
    "generate_config.limit_mm_image_per_prompt": (BASE, MM, ["generate_config.limit_mm_image_per_prompt=2"]),
    "generate_config.limit_mm_video_per_prompt": (BASE, MM, ["generate_config.limit_mm_video_per_prompt=1"]),
    "actor_config.lr_decay_style": (BASE, [], ["actor_config.lr_decay_style=cosine"]),
    "actor_config.data_path": (BASE, [], ["actor_config.data_path=runs/other/data"]),
    "actor_config.split": (BASE, [], ["actor_config.split=90,10,0"]),
    "actor_config.stage": (BASE, [], ["actor_config.stage=ray_dapo"]),
    "actor_config.tokenizer_name_or_path": (BASE, [], ["actor_config.tokenizer_name_or_path=runs/other/model"]),
    "actor_config.prompt_type": (BASE, [], ["actor_config.prompt_type=tiny_math_chat"]),
    "actor_config.load": (BASE, [], ["actor_config.load=runs/other/ckpt"]),
    "actor_config.save": (BASE, [], ["actor_config.save=runs/other/ckpt"]),
    "actor_config.dpo_loss_type": ("dpo_tiny_qwen2", [], ["actor_config.dpo_loss_type=ipo"]),
    "actor_config.dpo_beta": ("dpo_tiny_qwen2", [], ["actor_config.dpo_beta=0.5"]),
    "actor_config.dpo_label_smoothing": ("dpo_tiny_qwen2", [], ["actor_config.dpo_label_smoothing=0.2"]),
    "actor_config.pref_ftx": ("dpo_tiny_qwen2", [], ["actor_config.pref_ftx=0.5"]),
    "actor_config.kto_desirable_weight": ("dpo_tiny_qwen2", KTO, ["actor_config.kto_desirable_weight=1.5"]),
    "actor_config.kto_undesirable_weight": ("dpo_tiny_qwen2", KTO, ["actor_config.kto_undesirable_weight=1.5"]),
    "actor_config.lora_r": (BASE, LORA, ["actor_config.lora_r=4"]),
    "actor_config.lora_alpha": (BASE, LORA, ["actor_config.lora_alpha=4"]),
    "actor_config.lora_target_modules": (BASE, [], LORA),
    "rl_config.actor_resource": (BASE, [], RAY),
    "rl_config.clip_ratio_c": (BASE, [], ["rl_config.clip_ratio_c=3.0"]),
    "rl_config.cliprange_value": ("ppo_tiny_qwen2", [], ["rl_config.cliprange_value=0.3"]),
    "rl_config.kl_penalty": (BASE, [], ["rl_config.kl_penalty=kl"]),
    "rl_config.kl_ctrl_type": (BASE, [], ["rl_config.kl_ctrl_type=adaptive"]),
    "rl_config.adv_estimator": (BASE, [], ["rl_config.adv_estimator=rloo"]),
    "rl_config.teacher_model": (BASE, [], ["rl_config.teacher_model=runs/other/teacher"]),
    "rl_config.distill_mode": (BASE, ["rl_config.teacher_model=runs/other/teacher"], ["rl_config.distill_mode=mixed"]),
    "rl_config.distill_coef": (BASE, ["rl_config.teacher_model=runs/other/teacher"], ["rl_config.distill_coef=0.5"]),
    "rl_config.policy_loss": (BASE, [], ["rl_config.policy_loss=gspo"]),
    "rl_config.loss_agg_mode": (BASE, [], ["rl_config.loss_agg_mode=seq-mean-token-sum"]),
    "rl_config.verifier_function": (BASE, [], ["rl_config.verifier_function=[acc]"]),
    "rl_config.verifier_weight": (BASE, [], ["rl_config.verifier_weight=[2.0]"]),
    "rl_config.use_kl_in_reward": ("ppo_tiny_qwen2", [], ["rl_config.use_kl_in_reward=true"]),
    "rl_config.tensorboard_log_dir": (BASE, [], ["rl_config.tensorboard_log_dir=runs/tb"]),
    "rl_config.use_dp_batch_balance": (BASE, RAY, ["rl_config.use_dp_batch_balance=true"]),
    "rl_config.mini_batch_size": (BASE, [], ["rl_config.mini_batch_size=4"]),
    "rl_config.max_packing_token_size": (BASE, DYNAMIC, ["rl_config.max_packing_token_size=64"]),
    "rl_config.ref_max_packing_token_size": (BASE, DYNAMIC, ["rl_config.ref_max_packing_token_size=64"]),
    "rl_config.actor_max_packing_token_size": (BASE, DYNAMIC, ["rl_config.actor_max_packing_token_size=64"]),
    "rl_config.update_max_packing_token_size": (BASE, DYNAMIC, ["rl_config.update_max_packing_token_size=64"]),
    "rl_config.dynamic_max_batch_size": (BASE, DYNAMIC, ["rl_config.dynamic_max_batch_size=2"]),
    "rl_config.ref_dynamic_max_batch_size": (BASE, DYNAMIC, ["rl_config.ref_dynamic_max_batch_size=2"]),
    "rl_config.actor_dynamic_max_batch_size": (BASE, DYNAMIC, ["rl_config.actor_dynamic_max_batch_size=2"]),
    "rl_config.update_dynamic_max_batch_size": (BASE, DYNAMIC, ["rl_config.update_dynamic_max_batch_size=2"]),
    "rl_config.clip_ratio_low": (BASE, ["rl_config.clip_higher_enable=true"], ["rl_config.clip_ratio_low=0.05"]),
    "rl_config.clip_ratio_high": (BASE, ["rl_config.clip_higher_enable=true"], ["rl_config.clip_ratio_high=0.3"]),
    "rl_config.overlong_buffer_enable": (BASE, ["rl_config.rollout_max_tokens=8"],
                                         ["rl_config.overlong_buffer_enable=true", "rl_config.overlong_buffer=2"]),
    "rl_config.filter_groups_enable": ("dapo_tiny_qwen2", ["rl_config.filter_groups_enable=false"],
                                       ["rl_config.filter_groups_enable=true"]),
    "rl_config.filter_groups_metric": ("dapo_tiny_qwen2", ["rl_config.verifier_function=[last_number,format]",
                                                           "rl_config.verifier_weight=[1.0,1.0]"],
                                       ["rl_config.filter_groups_metric=format"]),
    "rl_config.filter_groups_max_batches": ("dapo_tiny_qwen2", [], ["rl_config.filter_groups_max_batches=7"]),
    "rl_config.filter_groups_train_batch_size": ("dapo_tiny_qwen2", [], ["rl_config.filter_groups_train_batch_size=4"]),
    "rl_config.multi_turn_enable": ("dapo_tiny_multi_turn", [*NO_TOOLS], [*TOOLS]),
    "rl_config.tool_config_path": ("dapo_tiny_multi_turn", [], ["rl_config.tool_config_path=configs/tools/search.yaml"]),
    "rl_config.max_tool_calls": ("dapo_tiny_multi_turn", [], ["rl_config.max_tool_calls=5"]),
    "rl_config.turn_credit": ("dapo_tiny_multi_turn", [], ["rl_config.turn_credit=turn"]),
    "rl_config.max_parallel_calls": ("dapo_tiny_multi_turn", [], ["rl_config.max_parallel_calls=2"]),
    "rl_config.max_total_response_length": ("dapo_tiny_multi_turn", [], ["rl_config.max_total_response_length=300"]),
    "rl_config.max_tool_response_length": ("dapo_tiny_multi_turn", [], ["rl_config.max_tool_response_length=7"]),
    "rl_config.tool_response_truncate_side": ("dapo_tiny_multi_turn", [],
                                              ["rl_config.tool_response_truncate_side=left"]),
    "rl_config.share_backbone": (BASE, LORA, ["rl_config.share_backbone=true"]),
    "rl_config.ray_address": (BASE, RAY, ["rl_config.ray_address=auto"]),
    "rl_config.ray_timeout_s": (BASE, RAY, ["rl_config.ray_timeout_s=60"]),
    "rl_config.ray_num_cpus_per_worker": (BASE, RAY, ["rl_config.ray_num_cpus_per_worker=2"]),
    "rl_config.ray_sharding": (BASE, RAY, ["rl_config.ray_sharding=fsdp2"]),
    "rl_config.output_dir": (BASE, [], ["rl_config.output_dir=runs/other/out"]),
    "rl_config.eval_data_path": (BASE, [], ["rl_config.eval_data_path=runs/other/test"]),
    "rl_config.rollout_correction": (BASE, ASYNC, ["rl_config.rollout_correction=tis"]),
    "rl_config.truncated_sampling_logprobs": (BASE, ["generate_config.sampling_config.top_p=0.9"],
                                              ["rl_config.truncated_sampling_logprobs=true"]),
    "rl_config.rollout_correction_level": (BASE, [*ASYNC, "rl_config.rollout_correction=tis"],
                                           ["rl_config.rollout_correction_level=sequence"]),
    "rl_config.wandb_project": (BASE, [], ["rl_config.wandb_project=p"]),
    "rl_config.wandb_exp_name": (BASE, [], ["rl_config.wandb_exp_name=e"]),
    "rl_config.wandb_save_dir": (BASE, [], ["rl_config.wandb_save_dir=w"]),
    "rl_config.mlflow_tracking_uri": (BASE, ["rl_config.use_mlflow=true"], ["rl_config.mlflow_tracking_uri=file:m"]),
    "rl_config.mlflow_experiment": (BASE, ["rl_config.use_mlflow=true"], ["rl_config.mlflow_experiment=e"]),
    "rl_config.swanlab_project": (BASE, ["rl_config.use_swanlab=true"], ["rl_config.swanlab_project=p"]),
    "rl_config.swanlab_exp_name": (BASE, ["rl_config.use_swanlab=true"], ["rl_config.swanlab_exp_name=e"]),
    "rl_config.swanlab_save_dir": (BASE, ["rl_config.use_swanlab=true"], ["rl_config.swanlab_save_dir=s"]),
    "rl_config.reference_resource": (BASE, ["rl_config.use_integrated_worker=false", "rl_config.init_kl_coef=0.01"],
                                     ["rl_config.reference_resource.num_npus=1"]),
    "rl_config.integrated_mode_config": (BASE, [], ["rl_config.integrated_mode_config.ref_model_load_path=runs/r"]),
    "rl_config.critic_update_dispatch_size": ("ppo_tiny_qwen2", [], ["rl_config.critic_update_dispatch_size=32"]),
    "rl_config.critic_value_dispatch_size": ("ppo_tiny_qwen2", [], ["rl_config.critic_value_dispatch_size=32"]),
    "generate_config.sampling_config": (BASE, [], ["generate_config.sampling_config.max_tokens=4"]),
    "profiler_config.integrated.stage": (BASE, PROFILE, ["profiler_config.integrated.stage=actor_update"]),
    "profiler_config.integrated.profile_save_path": (BASE, PROFILE, ["profiler_config.integrated.profile_save_path=p"]),
    "profiler_config.integrated.profile_level": (BASE, PROFILE, ["profiler_config.integrated.profile_level=level1"]),
    "profiler_config.integrated.profile_ranks": (BASE, PROFILE, ["profiler_config.integrated.profile_ranks=[0]"]),
    "rl_config.sapo_tau_pos": (BASE, ["rl_config.policy_loss=sapo"], ["rl_config.sapo_tau_pos=2.0"]),
    "rl_config.sapo_tau_neg": (BASE, ["rl_config.policy_loss=sapo"], ["rl_config.sapo_tau_neg=2.0"]),
    "rl_config.rollout_correction_floor": (BASE, [*ASYNC, "rl_config.rollout_correction=icepop"],
                                           ["rl_config.rollout_correction_floor=0.3"]),
    "msprobe_config.msprobe": (BASE, [], MSPROBE),
    "msprobe_config.dump_path": (BASE, MSPROBE, ["msprobe_config.dump_path=d"]),
    "msprobe_config.token_range_end": (BASE, MSPROBE, ["msprobe_config.token_range_end=3"]),
    "msprobe_config.token_range_start": (BASE, [*MSPROBE, "msprobe_config.token_range_end=5"],
                                         ["msprobe_config.token_range_start=2"]),
    "msprobe_config.step_end": (BASE, MSPROBE, ["msprobe_config.step_end=3"]),
    "msprobe_config.step_start": (BASE, [*MSPROBE, "msprobe_config.step_end=5"], ["msprobe_config.step_start=2"]),
    "rl_config.judge_path": (BASE, [], JUDGE),
    **{f"rl_config.{key}": (BASE, JUDGE, [f"rl_config.{key}={value}"]) for key, value in (
        ("judge_template", "'Rate {response}'"), ("judge_parser", "boxed"), ("judge_max_score", 5),
        ("judge_weight", 0.5), ("judge_max_tokens", 8), ("judge_temperature", 0.5), ("judge_timeout", 9),
        ("judge_failure_value", -1))},
}
for _key in ("key_data_dump", "configurations_dump", "actor_train_dump", "actor_infer_dump", "reference_dump",
             "critic_train_dump"):
    OBSERVERS[f"msprobe_config.{_key}"] = (BASE, MSPROBE, [])  # another bool, under msprobe: true
for _key in ("profile_with_memory", "profile_record_shapes", "profile_with_cpu", "profile_with_npu",
             "profile_with_module", "profile_analysis"):
    OBSERVERS[f"profiler_config.integrated.{_key}"] = (BASE, PROFILE, [])  # another bool, under profile: true
for _key, _value in (("profile_step_start", 0), ("profile_step_end", 3)):
    OBSERVERS[f"profiler_config.integrated.{_key}"] = (BASE, PROFILE, [f"profiler_config.integrated.{_key}={_value}"])

# key -> the test that observes it (a run's files, loggers, tokenizer, the cluster...): it must exist and name the key
ELSEWHERE: dict[str, str] = {
    "actor_config.vision_tower": "tests/unit/models/test_vlm.py::test_vision_tower_keys_are_checked",
    "rl_config.env_config": "tests/unit/envs/test_verifiers_env.py::test_grpo_on_a_verifiers_taskset_raises_its_reward",
    "actor_config.model": "tests/unit/config/test_config_loader.py::test_unknown_model_in_section",
    "actor_config.tokenizer_vocab_size": "tests/unit/models/test_arch_keys.py::test_qwen3_moe_dense_layers_and_llama3_rope_scaling",
    "actor_config.make_vocab_size_divisible_by": "tests/unit/models/mcore/test_convert.py::test_a_checkpoint_whose_padded_vocabulary_does_not_fit_tp_is_refused",
    "actor_config.is_pairwise_dataset": "tests/unit/config/test_backend.py::test_offline_stages_plan_on_megatron",
    "actor_config.dataset_additional_keys": "tests/unit/data/test_preprocess.py::test_sft_labels_mask_prompt",
    "actor_config.algorithm": "tests/e2e/test_e2e_tiny_pipeline.py::test_ppo_raises_the_reward",
    "actor_config.prompt_type_path": "tests/unit/config/test_reliability_config.py::test_C98_missing_prompt_type_path_names_the_path",
    "actor_config.ref_model": "tests/unit/roles/test_policy.py::test_a_resumed_dpo_run_loads_its_reference_from_the_initial_model",
    "rl_config.runtime_env_path": "tests/unit/cluster/test_cluster_plan.py::test_runtime_env_has_the_seed_vars_and_rejects_a_bad_file",
    "rl_config.rule_reward": "tests/integration/test_reward_model_loop.py::test_grpo_raises_the_reward_model_score",
    "rl_config.verifier_modules": "tests/unit/reward/test_pool.py::test_exceptions_score_zero_and_are_counted",
    "rl_config.trackio_project": "tests/unit/metrics/test_trackers.py::test_trackio_holds_every_iteration_offline",
    "rl_config.blocking": "tests/cluster/test_separated_roles.py::test_separated_roles_equal_the_integrated_run_blocking_or_not",
    "rl_config.reward_model_weight": "tests/unit/config/test_config_reward_model.py::test_accepted_settings_and_the_plan",
    "rl_config.device": "tests/unit/cluster/test_cluster_plan.py::test_a_mini_batch_the_workers_cannot_share_is_refused_by_the_plan",
    "rl_config.rollout_engine": "tests/unit/config/test_backend.py::test_the_vllm_rollout_counts_its_share_per_device",
    "rl_config.ignore_memory_estimate": "tests/unit/config/test_backend.py::test_a_model_whose_rollout_copy_does_not_fit_one_device_is_refused",
    "rl_config.token_level_loss": "tests/unit/config/test_algorithm_checks.py::test_dapo_clip_higher_token_level_loss_and_no_reference",
    "rl_config.actor_update_dispatch_size": "tests/unit/config/test_config_validation.py::test_base_is_valid_and_derives_dispatch_sizes",
    "rl_config.tool_parser_format": "tests/unit/config/test_multi_turn_config.py::test_the_multi_turn_keys_are_honoured",
    # the training and rollout precision follow the device's bf16 units: on this CPU (none) both plans train in fp32
    "actor_config.bf16": "tests/unit/config/test_backend.py::test_bf16_is_honoured_on_cuda_and_named_on_cpu",
    "generate_config.dtype": "tests/unit/test_device.py::test_cpu_precision_follows_its_bf16_units",
    "rl_config.swanlab_mode": "tests/unit/metrics/test_trackers.py::test_swanlab_modes_are_the_seeds",
    "profiler_config.integrated.profile_export_type": "tests/unit/config/test_config_validation.py::test_profiler_messages",
    # files and checkpoints a run reads: their effect is the run's tokenizer or weights
    "actor_config.vocab_file": "tests/integration/test_gpt2_bpe_tokenizer.py::test_grpo_with_the_bpe_files_equals_the_run_with_its_hf_directory",
    "actor_config.merge_file": "tests/integration/test_gpt2_bpe_tokenizer.py::test_grpo_with_the_bpe_files_equals_the_run_with_its_hf_directory",
    "actor_config.tokenizer_model": "tests/integration/test_sentencepiece_tokenizer.py::test_grpo_with_the_model_file_equals_the_run_with_its_hf_directory",
    "actor_config.pretrained_checkpoint": "tests/integration/test_start_keys.py::test_pretrained_checkpoint_starts_fresh_from_its_weights",
    "actor_config.refer_model_iter": "tests/e2e/test_e2e_algorithms.py::test_dpo_reference_is_ref_model_at_refer_model_iter",
    # tq runs only with transferqueue installed (the config check refuses it otherwise): the plan built past the check
    "rl_config.data_strategy": "tests/unit/config/test_plan.py::test_data_strategy_spellings_reach_the_plan",
    "rl_config.transfer_queue_data_shard_num": "tests/unit/config/test_plan.py::test_data_strategy_spellings_reach_the_plan",
}


def flat(plan) -> dict[str, str]:
    """The plan's values (not the config's text nor the warnings): what a change must move."""
    return {f.name: repr(getattr(plan, f.name)) for f in dataclasses.fields(plan)
            if f.name not in ("config_json", "warnings")}


def current_value(cfg, section: str, name: str):
    obj = {"actor_config": cfg.actor, "rl_config": cfg.rl, "generate_config": cfg.generate,
           "generate_config.sampling_config": cfg.generate.sampling_config,
           "profiler_config.integrated": cfg.profiler, "rl_config.actor_resource": cfg.rl.actor_resource,
           "msprobe_config": cfg.msprobe}[section]
    return getattr(obj, name)


def other_values(cls, name: str, current) -> list[str]:
    """Override values of the key's type other than ``current``."""
    field = cls.model_fields[name]
    annotation = field.annotation
    if typing.get_origin(annotation) is typing.Literal:
        return [v for v in typing.get_args(annotation) if v != current]
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    kind = args[0]
    if typing.get_origin(kind) is typing.Literal:
        values = [v for v in typing.get_args(kind) if v != current]
    elif kind is bool:
        values = [not current]
    elif kind is int:
        values = [v for v in ((current or 1) * 2, 3) if v != current]
    elif kind is float:
        values = [(current or 0.5) * 0.5 + 0.01]
    else:
        return []
    return [v if isinstance(v, str) else json.dumps(v) for v in values]
