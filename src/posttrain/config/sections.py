"""``rl_config``, ``generate_config`` (with ``sampling_config``), ``profiler_config``, ``msprobe_config``.

Keys and defaults are the seed's (reference: seed_system.md 3.2, 3.3, 3.5). Keys marked
"posttrain:" are this project's additions.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import AliasChoices, Field, model_validator

from posttrain.config.fields import F, Section

Opt = Optional


class Resource(Section):
    num_npus: Opt[int] = Field(default=None, description="devices (or CPU worker processes) for the role",
                               validation_alias=AliasChoices("num_npus", "num_gpus", "num_devices"))

    @model_validator(mode="before")
    @classmethod
    def _one_name(cls, data: Any) -> Any:
        if isinstance(data, dict):
            names = [k for k in ("num_npus", "num_gpus", "num_devices") if k in data]
            if len(names) > 1:
                raise ValueError(f"give only one of {', '.join(names)}: they name the same count")
        return data


class RLConfig(Section):
    runtime_env_path: str = F("configs/envs/runtime_env.yaml", "Ray runtime env file")
    hccl_buffersize: int = F(256, "Ascend HCCL buffer MB (ignored)")
    rule_reward: bool = F(True, "use rule-based verifiers")
    beta: float = F(0.1, "rule/model reward balance (unused, as in the seed)")
    actor_resource: Resource = F(Resource(), "devices for the actor")
    reference_resource: Opt[Resource] = F(None, "separate-mode reference devices")
    reward_resource: Opt[Resource] = F(None, "separate-mode reward-model devices")
    critic_resource: Opt[Resource] = F(None, "critic devices (PPO)")
    vit_resource: Opt[Resource] = F(None, "multimodal ViT devices")
    num_samples_per_step: int = F(1, "unused")
    max_prompt_length: int = F(512, "prompts with token length >= this are filtered out")
    epochs: int = F(1, "passes over the mini-batches per iteration")
    clip_ratio: float = F(0.2, "PPO/GRPO clip epsilon")
    clip_ratio_c: Opt[float] = F(None, "posttrain: dual-clip PPO constant (e.g. 3.0); None disables")
    cliprange_value: float = F(0.5, "critic value clip")
    entropy_coeff: float = F(0.0, "entropy bonus weight")
    gamma: float = F(1.0, "GAE discount")
    lam: float = F(0.95, "GAE lambda")
    advantage_whiten: bool = F(True, "unused (GAE always whitens)")
    kl_penalty: str = F("low_var_kl", "kl, abs, mse or low_var_kl")
    kl_ctrl_type: str = F("fixed", "fixed or adaptive")
    init_kl_coef: float = F(0.01, "KL coefficient")
    kl_horizon: float = F(1000, "adaptive KL horizon")
    kl_target: float = F(100.0, "adaptive KL target")
    adv_estimator: str = F("group_norm", "group_norm, gae, grpo_no_std, rloo, reinforce_plus_plus, ...")
    policy_loss: str = F("ppo", "posttrain: ppo (clipped surrogate; dual-clip with clip_ratio_c) or gspo")
    loss_agg_mode: Opt[str] = F(None, "posttrain: token-mean, seq-mean-token-mean, seq-mean-token-sum or "
                                      "seq-mean-token-sum-norm; default: the algorithm's (DAPO: token_level_loss)")
    verifier_function: list[str] = F(["base_acc"], "rule verifiers")
    verifier_weight: list[float] = F([1.0], "weights, one per verifier")
    verifier_parallel: int = F(1, "verifier worker processes (honoured, unlike the seed)")
    verifier_timeout: float = F(30, "seconds per sample (honoured, unlike the seed)")
    verifier_modules: list[str] = F([], "posttrain: modules that register user verifiers")
    integrated_mode_config: Opt[dict[str, Any]] = F(None, "integrated mode: ref_model_load_path")
    use_kl_in_reward: bool = F(False, "PPO: subtract beta*KL from token rewards")
    shuffle_mini_batch: bool = F(False, "shuffle mini-batch order")
    tp_split_expert: bool = F(False, "unused")
    use_tensorboard: bool = F(False, "write TensorBoard logs")
    tensorboard_log_dir: Opt[str] = F(None, "TensorBoard directory (default: <run dir>/tensorboard)")
    use_wandb: bool = F(False, "log to wandb")
    wandb_project: str = F("", "wandb project")
    wandb_exp_name: str = F("", "wandb run name")
    wandb_save_dir: str = F("", "wandb directory")
    use_swanlab: bool = F(False, "swanlab (not supported; use TensorBoard or wandb)")
    swanlab_mode: str = F("", "swanlab")
    swanlab_project: str = F("", "swanlab")
    swanlab_exp_name: str = F("", "swanlab")
    swanlab_save_dir: str = F("", "swanlab")
    blocking: bool = F(True, "synchronous calls")
    async_engine: bool = F(False, "streaming rollout (multi-turn)")
    guarantee_order: bool = F(False, "deterministic TransferDock order")
    num_cpus_for_local_task: float = F(1, "CPUs per rule-reward task")
    num_cpus_for_placement_group: int = F(8, "CPUs per device bundle")
    use_integrated_worker: bool = F(True, "colocated actor, rollout and reference")
    use_dp_batch_balance: bool = F(False, "sequence-length-balanced DP split")
    ref_forward_micro_batch_size: Opt[int] = F(None, "reference log-prob micro batch")
    actor_forward_micro_batch_size: Opt[int] = F(None, "old log-prob micro batch")
    vit_forward_micro_batch_size: Opt[int] = F(None, "multimodal")
    actor_rollout_dispatch_size: Opt[int] = F(None, "TD read size for rollout")
    actor_logprob_dispatch_size: Opt[int] = F(None, "TD read size for old log-probs")
    ref_dispatch_size: Opt[int] = F(None, "TD read size for reference log-probs")
    reward_dispatch_size: Opt[int] = F(None, "TD read size for rewards")
    dynamic_sampling_dispatch_size: Opt[int] = F(None, "TD read size for DAPO filtering")
    adv_dispatch_size: Opt[int] = F(None, "TD read size for advantages")
    actor_update_dispatch_size: Opt[int] = F(None, "TD read size for the update")
    critic_update_dispatch_size: Opt[int] = F(None, "TD read size for the critic update")
    critic_value_dispatch_size: Opt[int] = F(None, "TD read size for critic values")
    kl_dispatch_size: Opt[int] = F(None, "TD read size for KL-in-reward")
    actor_image_embeds_dispatch_size: Opt[int] = F(None, "multimodal")
    is_multimodal: bool = F(False, "multimodal")
    use_remove_padding: bool = F(False, "pack valid tokens of a micro-batch into one row")
    share_prompt_prefix: bool = F(True, "posttrain: with use_remove_padding, pack a prompt shared by several "
                                        "rows (a group's n samples) once")
    reuse_image_embeds: bool = F(False, "multimodal")
    colocate_actor_and_vit: bool = F(False, "multimodal")
    n_samples_per_prompt: int = F(1, "group size n")
    mini_batch_size: int = F(1, "prompts per optimizer step")
    use_dynamic_bsz: bool = F(False, "token-budget micro-batches")
    max_packing_token_size: int = F(4096, "token budget base")
    ref_max_packing_token_size: int = F(4096, "reference token budget")
    actor_max_packing_token_size: int = F(4096, "old log-prob token budget")
    update_max_packing_token_size: int = F(4096, "update token budget")
    dynamic_max_batch_size: Opt[int] = F(None, "max sequences per dynamic micro-batch")
    ref_dynamic_max_batch_size: Opt[int] = F(None, "reference")
    actor_dynamic_max_batch_size: Opt[int] = F(None, "old log-prob")
    update_dynamic_max_batch_size: Opt[int] = F(None, "update")
    log_max_throughput: bool = F(True, "tps from max lengths instead of mean")
    token_level_loss: bool = F(True, "DAPO: token-mean (true) or seq-mean-token-mean")
    data_strategy: str = F("td", "td (TransferDock) or tq (TransferQueue, not supported)")
    transfer_queue_data_shard_num: int = F(1, "TQ")
    transfer_queue_data_shard_port_base: Opt[int] = F(None, "TQ")
    clip_higher_enable: bool = F(False, "DAPO clip-higher")
    clip_ratio_low: float = F(0.1, "DAPO lower clip")
    clip_ratio_high: float = F(0.1, "DAPO upper clip")
    overlong_buffer_enable: bool = F(False, "DAPO overlong penalty")
    overlong_buffer: int = F(0, "DAPO overlong buffer tokens")
    overlong_buffer_penalty_factor: float = F(1.0, "DAPO overlong penalty factor")
    rollout_max_tokens: int = F(2048, "must equal sampling_config.max_tokens")
    filter_groups_enable: bool = F(False, "DAPO dynamic sampling")
    filter_groups_metric: str = F("acc", "verifier whose score std must be nonzero")
    filter_groups_max_batches: int = F(1, "generation batches cap (<=0 unlimited)")
    filter_groups_train_batch_size: int = F(1, "prompts to keep per iteration")
    zmq_communication: bool = F(True, "Ascend (ignored)")
    partial_rollout_max_split: int = F(1, "partial rollout")
    require_max_age_all_finished: bool = F(True, "partial rollout")
    multi_turn_enable: bool = F(False, "agentic multi-turn")
    tool_config_path: Opt[str] = F(None, "multi-turn tools")
    max_tool_calls: int = F(0, "multi-turn")
    max_parallel_calls: int = F(0, "multi-turn")
    max_total_response_length: int = F(0, "multi-turn")
    max_tool_response_length: int = F(0, "multi-turn")
    tool_response_truncate_side: Opt[str] = F(None, "multi-turn")
    tool_parser_format: Opt[str] = F(None, "multi-turn")
    share_backbone: bool = F(False, "LoRA: reference shares the actor backbone")
    missing_eos_penalty: float = F(1.0, "unused, as in the seed")
    # ---- posttrain additions --------------------------------------------------------------------
    ray_address: Opt[str] = F(None, "posttrain: Ray cluster address (or RAY_ADDRESS)")
    ray_timeout_s: float = F(600.0, "posttrain: seconds any Ray remote call or torch.distributed collective may take")
    ray_num_cpus_per_worker: int = F(1, "posttrain: CPUs (and torch threads) per actor worker without accelerators")
    ray_sharding: str = F("ddp", "posttrain: Ray actor workers: ddp (full replicas) or fsdp2 (sharded parameters, "
                                 "gradients and optimizer state)")
    device: str = F("auto", "posttrain: auto, cpu, cuda or cuda:N")
    rollout_engine: str = F("native", "posttrain: native or vllm")
    output_dir: Opt[str] = F(None, "posttrain: run directory for metrics (default runs/<config>)")
    eval_data_path: Opt[str] = F(None, "posttrain: held-out prompt dataset prefix for eval during training")
    eval_interval: int = F(0, "posttrain: evaluate every N iterations (0: only before and after)")
    eval_limit: Opt[int] = F(None, "posttrain: evaluate at most this many prompts")


class SamplingConfig(Section):
    logprobs: int = F(1, "return per-token logprobs")
    max_tokens: int = F(128, "new tokens per response")
    top_p: float = F(1.0, "nucleus sampling")
    top_k: int = F(50, "top-k (-1 off)")
    min_p: float = F(0.0, "min-p")
    temperature: float = F(0.2, "temperature (0: greedy)")
    detokenize: bool = F(False, "return text")
    seed: Opt[int] = F(None, "sampling seed")


class GenerateConfig(Section):
    limit_mm_image_per_prompt: int = F(1, "multimodal")
    limit_mm_video_per_prompt: int = F(0, "multimodal")
    data_parallel_size: Opt[int] = F(None, "computed: actor devices / (infer TP x infer PP)")
    tokenizer_name_or_path: str = F("/path/to/tokenizer", "tokenizer")
    trust_remote_code: bool = F(False, "HF trust_remote_code")
    eplb_token_collects: bool = F(False, "EPLB (ignored)")
    eplb_token_save_path: str = F("./", "EPLB (ignored)")
    expert_map_path: Opt[str] = F(None, "EPLB (ignored)")
    infer_tensor_parallel_size: int = F(8, "rollout TP")
    infer_pipeline_parallel_size: int = F(1, "rollout PP (must be 1)")
    infer_expert_parallel_size: int = F(1, "rollout EP")
    max_num_seqs: int = F(1, "sequences decoded at once")
    max_model_len: int = F(2048, "must be >= actor seq_length")
    max_num_batched_tokens: int = F(2048, "token budget of one batch")
    dtype: str = F("bfloat16", "bfloat16 or float32 (float32 only on CPU; the seed requires bfloat16)")
    gpu_memory_utilization: float = F(0.5, "vLLM memory fraction")
    offload_train_optimizer: bool = F(False, "offload during rollout")
    offload_train_grad: bool = F(False, "offload during rollout")
    offload_train_param: bool = F(False, "offload during rollout")
    enable_prefix_caching: bool = F(False, "vLLM prefix caching")
    num_scheduler_steps: int = F(1, "vLLM")
    enforce_eager: bool = F(True, "vLLM eager mode")
    torchair_graph: bool = F(False, "Ascend (ignored)")
    enable_expert_parallel: bool = F(False, "vLLM EP")
    ascend_scheduler_config_enabled: bool = F(True, "Ascend (ignored)")
    sampling_config: SamplingConfig = F(SamplingConfig(), "sampling parameters (replaced wholesale)")


class ProfilerConfig(Section):
    profile: bool = F(False, "enable the torch profiler")
    mstx: bool = F(False, "range markers")
    stage: Any = F("all", "all or a list of phases")
    profile_save_path: str = F("", "trace directory")
    profile_export_type: str = F("text", "text or db")
    profile_level: str = F("level0", "level_none, level0, level1, level2")
    profile_with_memory: bool = F(False, "record memory")
    profile_record_shapes: bool = F(False, "record shapes")
    profile_with_cpu: bool = F(True, "CPU activities")
    profile_with_npu: bool = F(True, "device activities")
    profile_with_module: bool = F(False, "module stacks")
    profile_step_start: int = F(1, "first profiled iteration")
    profile_step_end: int = F(2, "end iteration (exclusive)")
    profile_analysis: bool = F(False, "online analysis")
    profile_ranks: Any = F("all", "ranks to profile")

    @model_validator(mode="after")
    def _check(self) -> "ProfilerConfig":
        if self.profile_level not in ("level_none", "level0", "level1", "level2"):
            raise ValueError(f"profiler_level only supports level0, 1, 2, and level_none, but gets {self.profile_level}")
        if self.profile_export_type not in ("text", "db"):
            raise ValueError(f"profile_export_type only supports text or db, but gets {self.profile_export_type}")
        return self


class MsprobeConfig(Section):
    msprobe: bool = F(False, "accuracy-debug dumps")
    dump_path: str = F("./msprobe_dump", "dump directory")
    key_data_dump: bool = F(False, "dump key tensors")
    configurations_dump: bool = F(False, "dump configurations.json")
    actor_train_dump: bool = F(False, "dump")
    actor_infer_dump: bool = F(False, "dump")
    reference_dump: bool = F(False, "dump")
    critic_train_dump: bool = F(False, "dump")
    token_range_start: int = F(0, "dump")
    token_range_end: int = F(0, "dump")
    step_start: int = F(0, "dump")
    step_end: int = F(0, "dump")
