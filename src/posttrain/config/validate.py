"""The seed's ``validate_rl_args`` rules, with its messages, plus posttrain's own cross-key checks.

Rules are numbered as in seed_system.md 3.6, one function per group (1-2 framework and precision,
3 the colocated roles, 4-6 sequence length, context parallel and packing, 7-10 devices, batch
ratios and data parallel, 11 the dispatch sizes, 12 the shared backbone, 13-15 the experience
counts, 16-19 rewards and clipping, 20-21 partial rollout and multi-turn).
:func:`validate_run_config` raises :class:`~posttrain.errors.ConfigError` on the first broken rule
and returns the :class:`DeviceLayout` with the dispatch sizes the seed derives (a size the config
sets is kept). It never writes into the config. It is one part of
:func:`posttrain.config.check.check_run_config`, the one check that both ``posttrain plan`` and
``posttrain train`` run.

The range of a single value (a size >= 1, a finite rate > 0, ...) is declared on its field
(:mod:`posttrain.config.sections`, :mod:`posttrain.config.megatron`) and refused when the config
loads; :func:`check_values` holds the value rules that read two keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.config.megatron import MegatronConfig
from posttrain.config.run import RunConfig, role_sources
from posttrain.errors import ConfigError


@dataclass(frozen=True)
class DeviceLayout:
    """Device counts, data-parallel sizes, and the seed's dispatch sizes (rows one data-parallel
    rank reads from the TransferDock per call; set in the config or derived as the seed does)."""

    num_devices: int
    actor_dp: int
    infer_dp: int
    ref_dp: int
    num_nodes: int
    dispatch_sizes: dict[str, int] = field(default_factory=dict)


def _model_parallel(c: MegatronConfig) -> int:
    return c.tensor_model_parallel_size * c.pipeline_model_parallel_size * c.context_parallel_size


def _check_resource(component: str, resource: int, c: MegatronConfig) -> None:
    t, p, cp = c.tensor_model_parallel_size, c.pipeline_model_parallel_size, c.context_parallel_size
    if resource % (t * p * cp) != 0:
        raise ConfigError(f"Invalid {component} resource allocation! Resource={resource} must be divisible by "
                          f"(tensor_parallel * pipeline_parallel * context_parallel) = {t}*{p}*{cp}={t * p * cp}; make "
                          f"rl_config.actor_resource.num_npus a multiple of tensor_model_parallel_size x "
                          f"pipeline_model_parallel_size x context_parallel_size")


def _check_batch_ratio(component: str, gbs: int, n: int, mbs: int) -> None:
    if (gbs * n) % mbs != 0:
        raise ConfigError(f"Invalid {component} batch configuration! (global_batch_size * n_samples) = "
                          f"{gbs}*{n} = {gbs * n} must be divisible by micro_batch_size {mbs}")


def _check_data_parallel(component: str, gbs: int, dp: int, n: int, mbs: int) -> None:
    if gbs % dp != 0:
        raise ConfigError(f"{component} global_batch_size {gbs} must be divisible by data_parallel_size {dp}")
    if (gbs // dp * n) % mbs != 0:
        raise ConfigError(f"{component} global_batch_size {gbs}  // data_parallel {dp}  * n_samples {n} "
                          f"must be divisible by micro_batch_size {mbs} ")


def _require(value, key: str):
    if value is None:
        raise ConfigError(f"{key} is not set; it is required for this stage")
    return value


# ---- labels -----------------------------------------------------------------------------------
def _where(cfg: RunConfig, *path: str) -> str:
    """``override '...': `` or ``file.yaml line 9: `` for a key path the config wrote."""
    return cfg.origins.prefix(*path) if getattr(cfg, "origins", None) is not None else ""


def actor_key(cfg: RunConfig, key: str) -> str:
    """``section.key`` of an actor key, naming the section that wrote it (megatron_training,
    actor_config or model.<name>; megatron_training for a default)."""
    return f"{role_sources(cfg.raw, cfg.models, 'actor_config').get(key, 'megatron_training')}.{key}"


# ---- posttrain's value rules that read two keys -------------------------------------------------
def check_values(cfg: RunConfig) -> None:
    """The value rules that read two keys (a ``max_tokens`` no response can reach, mini-batches larger
    than the prompts one update reads); the seed's rules come after them."""
    if cfg.stage not in ("grpo", "dapo", "ppo"):
        return
    check_sampling(cfg)
    rl = cfg.rl
    # mini-batches are cut from the prompts of one update: global_batch_size, or DAPO's
    # filter_groups_train_batch_size with dynamic sampling
    update_key, update = actor_key(cfg, "global_batch_size"), cfg.actor.global_batch_size
    if cfg.stage == "dapo" and rl.filter_groups_enable:
        update_key, update = "rl_config.filter_groups_train_batch_size", rl.filter_groups_train_batch_size
    if update is not None and rl.mini_batch_size > update:
        raise ConfigError(f"{_where(cfg, 'rl_config', 'mini_batch_size')}rl_config.mini_batch_size="
                          f"{rl.mini_batch_size} is larger than {update_key}={update} (both count prompts): an "
                          f"optimizer step cannot take more prompts than an iteration updates on. Make "
                          f"mini_batch_size a divisor of {update_key.split('.')[-1]}")


def check_sampling(cfg: RunConfig) -> None:
    """A ``generate_config.sampling_config.max_tokens`` the config writes, against ``max_model_len``
    (the range of each sampling key is declared on its field, as the rollout's
    :meth:`~posttrain.rollout.base.SamplingParams.validate` has it).

    A prompt and its response hold at most ``max_model_len`` tokens together (vLLM stops a response
    there, as in the seed), so a written ``max_tokens`` above ``max_model_len`` can never be reached
    and is refused. A longest prompt plus ``max_tokens`` above ``max_model_len`` is allowed: the seed's
    own recipes do that (r1_zero: 1024 + 4096 > 4096), relying on that cut."""
    gen = cfg.generate
    max_tokens, max_len = gen.sampling_config.max_tokens, gen.max_model_len
    if max_tokens > max_len and cfg.explicitly_set("generate_config", "sampling_config", "max_tokens"):
        room = max_len - cfg.rl.max_prompt_length
        hint = (f"at most max_model_len - rl_config.max_prompt_length = {max_len} - {cfg.rl.max_prompt_length} = "
                f"{room}" if room > 0 else "below max_model_len")
        raise ConfigError(
            f"{_where(cfg, 'generate_config', 'sampling_config', 'max_tokens')}generate_config.sampling_config."
            f"max_tokens={max_tokens} is larger than generate_config.max_model_len={max_len}, the most tokens a "
            f"prompt and its response hold together, so no response can be that long. Set max_tokens {hint}, or "
            f"raise max_model_len")


# ---- the seed's rules, by group ----------------------------------------------------------------
@dataclass(frozen=True)
class _Batch:
    """The sizes the seed's rules 7 to 15 divide by."""

    gbs: int  # prompts per iteration
    n: int  # responses per prompt
    mbs: int  # the actor's micro batch
    num_devices: int
    actor_dp: int
    infer_dp: int
    num_nodes: int
    filtering: bool  # DAPO's dynamic sampling: the update reads filter_groups_train_batch_size prompts
    train_gbs: int  # prompts per update


def validate_run_config(cfg: RunConfig, *, device_type: str = "cpu", num_nodes: int = 1) -> DeviceLayout:
    """Check ``cfg`` as the seed does and derive the dispatch sizes. Returns the device layout.

    ``num_nodes`` is the number of nodes of the Ray cluster the run will use (1 for a local run)."""
    check_values(cfg)
    _check_framework(cfg, device_type)  # 1, 2
    if cfg.stage in ("dpo", "sft"):
        return _validate_offline(cfg, num_nodes)
    _check_roles(cfg)  # 3
    _check_sequences(cfg)  # 4, 5, 6
    batch = _check_devices(cfg, num_nodes)  # 7, 8, 9, 10
    dispatch = _dispatch_sizes(cfg, batch)  # 11
    _check_shared_backbone(cfg)  # 12
    _check_experience(cfg, batch, dispatch)  # 13, 14, 15
    _check_rewards_and_clips(cfg)  # 16, 17, 18, 19
    _check_rollout_modes(cfg)  # 20, 21
    _check_mini_batches(cfg, batch)  # posttrain's own
    return DeviceLayout(num_devices=batch.num_devices, actor_dp=batch.actor_dp, infer_dp=batch.infer_dp,
                        ref_dp=batch.actor_dp, num_nodes=num_nodes, dispatch_sizes=dispatch)


def _check_framework(cfg: RunConfig, device_type: str) -> None:
    """Rules 1 (the framework) and 2 (bf16; not on CPU: fp32 is allowed there, and bf16 is used only
    where the CPU has bf16 matmul units)."""
    a, gen = cfg.actor, cfg.generate
    if a.ai_framework not in (None, "mindspore"):
        raise ConfigError(f"Invalid value for ai_framework: '{a.ai_framework}'. Only None or mindspore are allowed")
    if device_type != "cpu" and (a.bf16 is False or gen.dtype != "bfloat16"):
        raise ConfigError(" megatron_config.bf16 should be true and generate_config.dtype should be bfloat16.")


def _check_roles(cfg: RunConfig) -> None:
    """Rule 3. posttrain, unlike the seed, runs a reward model in integrated mode (colocated with the
    actor; reward_config and reward_resource are checked in posttrain.config.reward_model)."""
    rl = cfg.rl
    if rl.use_integrated_worker:
        if rl.reference_resource is not None:
            raise ConfigError("reference_resource should not be set when use_integrated_worker mode is on.")
        if cfg.raw.get("ref_config") is not None:
            raise ConfigError("ref_config should not be set when use_integrated_worker mode is on.")
    elif rl.integrated_mode_config is not None:
        raise ConfigError("integrated_mode_config should not be set when use_integrated_worker mode is off.")
    if cfg.stage == "dapo" and cfg.raw.get("ref_config") is not None:
        raise ConfigError("ref_config should not be set when use_integrated_worker mode is on.")


def _check_sequences(cfg: RunConfig) -> None:
    """Rules 4 (max_model_len), 5 (context parallel) and 6 (remove padding). Remove padding is on by
    default here (the seed's default is off): rules 5 and 6 apply when a config asks for it, so a
    seed config that never mentions it runs unchanged, packed."""
    a, rl, gen = cfg.actor, cfg.rl, cfg.generate
    seq_length = _require(a.seq_length, "megatron_training.seq_length")
    if gen.max_model_len < seq_length:
        raise ConfigError(f"Sequence length exceeds vLLM max_model_len! Actor.seq_length={seq_length} vs "
                          f"GenerateConfig.max_model_len={gen.max_model_len}")
    if a.context_parallel_size > 1 and a.context_parallel_algo not in ("ulysses_cp_algo", "megatron_cp_algo"):
        raise ConfigError("Now just support ulysses CP and megatron cp(ring)")
    packing_asked = rl.use_remove_padding and cfg.explicitly_set("rl_config", "use_remove_padding")
    if (a.context_parallel_size > 1 and a.context_parallel_algo == "megatron_cp_algo" and packing_asked
            and not a.reset_attention_mask):
        raise ConfigError("when use ring cp and remove_padding, reset_attention_mask must be true")
    if not packing_asked:
        return
    if a.pipeline_model_parallel_size > 1 and not a.no_pad_to_seq_lengths:
        raise ConfigError("'use_remove_padding' feature requires 'no_pad_to_seq_lengths=True' when using "
                          "pipeline parallelism! Please set 'no_pad_to_seq_lengths=True'.")
    if not a.reset_attention_mask:
        raise ConfigError("'use_remove_padding' feature requires 'reset_attention_mask=True'! ")
    # the seed refuses remove padding for multimodal models; posttrain packs their rows (the 3-D rotary
    # positions per sequence, docs/multimodal.md), so that rule is not kept


def _check_devices(cfg: RunConfig, num_nodes: int) -> _Batch:
    """Rules 7 (resources), 8 (batch ratios), 9 (no pipeline-parallel rollout) and 10 (data parallel)."""
    a, rl, gen = cfg.actor, cfg.rl, cfg.generate
    num_devices = rl.actor_resource.num_npus or 1
    _check_resource("Actor", num_devices, a)
    gbs = _require(a.global_batch_size, "megatron_training.global_batch_size")
    mbs = _require(a.micro_batch_size, "actor_config.micro_batch_size")
    n = rl.n_samples_per_prompt
    _check_batch_ratio("Actor", gbs, n, mbs)
    _check_batch_ratio("Reference", gbs, n, (cfg.ref or a).micro_batch_size or mbs)
    if cfg.reward is not None:
        _check_batch_ratio("Reward", gbs, n, cfg.reward.micro_batch_size or mbs)
    if gen.infer_pipeline_parallel_size > 1:
        raise ConfigError("pipeline_parallel for vllm is not supported yet ! ")
    actor_dp = num_devices // _model_parallel(a)
    infer_model_parallel = gen.infer_tensor_parallel_size * gen.infer_pipeline_parallel_size
    if num_devices % infer_model_parallel != 0:
        raise ConfigError(f"Invalid Generation resource allocation! Resource={num_devices} must be divisible by "
                          f"(infer_tensor_parallel * infer_pipeline_parallel) = {infer_model_parallel}")
    infer_dp = num_devices // infer_model_parallel
    _check_data_parallel("Actor", gbs, actor_dp, n, mbs)
    _check_data_parallel("Generation", gbs, infer_dp, n, rl.actor_rollout_dispatch_size or gbs * n // infer_dp)
    filtering = cfg.stage == "dapo" and rl.filter_groups_enable
    train_gbs = rl.filter_groups_train_batch_size if filtering else gbs
    if filtering:
        _check_data_parallel("ActorForDapo", train_gbs, actor_dp, n, mbs)
    return _Batch(gbs=gbs, n=n, mbs=mbs, num_devices=num_devices, actor_dp=actor_dp, infer_dp=infer_dp,
                  num_nodes=num_nodes, filtering=filtering, train_gbs=train_gbs)


def _dispatch_sizes(cfg: RunConfig, b: _Batch) -> dict[str, int]:
    """Rule 11: the dispatch sizes the config does not set, derived as the seed does."""
    rl, gbs, n = cfg.rl, b.gbs, b.n
    if rl.rule_reward and gbs % b.num_nodes != 0:
        raise ConfigError(f"Reward dispatch size configuration error!global_batch_size {gbs} must be divisible "
                          f"by the number of nodes in the ray cluster")
    derived = {
        "actor_rollout_dispatch_size": gbs * n // b.infer_dp,
        "actor_logprob_dispatch_size": b.train_gbs * n // b.actor_dp,
        "adv_dispatch_size": b.train_gbs * n,
        "dynamic_sampling_dispatch_size": gbs * n // b.num_nodes,
        "ref_dispatch_size": gbs * n // b.actor_dp,
        "reward_dispatch_size": gbs * n // b.num_nodes,
        "actor_update_dispatch_size": b.train_gbs * n // b.actor_dp,
    }
    if rl.is_multimodal and rl.reuse_image_embeds:  # the image_embeds phase (loops/multimodal.py)
        derived["actor_image_embeds_dispatch_size"] = b.train_gbs * n // b.actor_dp
    if cfg.stage == "ppo":
        critic_dp = _critic_dp(cfg, b)
        derived.update(critic_update_dispatch_size=gbs * n // critic_dp,
                       critic_value_dispatch_size=gbs * n // critic_dp, kl_dispatch_size=gbs * n)
    return {key: getattr(rl, key) if getattr(rl, key) is not None else value for key, value in derived.items()}


def _critic_dp(cfg: RunConfig, b: _Batch) -> int:
    """The critic's data-parallel size: its own devices (``critic_resource``, separated mode) or the
    actor's, over its model-parallel size (at least 1: a critic split wider than the devices is
    refused by its own rules, after these)."""
    rl = cfg.rl
    devices = rl.critic_resource.num_npus if rl.critic_resource and rl.critic_resource.num_npus else None
    return max((devices or b.num_devices) // _model_parallel(cfg.critic or cfg.actor), 1)


def _check_shared_backbone(cfg: RunConfig) -> None:
    """Rule 12: the shared backbone needs LoRA, and not with DAPO."""
    if cfg.rl.share_backbone and not cfg.actor.lora_target_modules:
        raise ConfigError("The shared backbone can only be used with LoRA.")
    if cfg.rl.share_backbone and cfg.stage == "dapo":
        raise ConfigError("'share_backbone' cannot be True when 'stage' is set to 'ray_dapo'.")


def _check_experience(cfg: RunConfig, b: _Batch, dispatch: dict[str, int]) -> None:
    """Rules 13 (the experience counts divide the responses), 14 (an update reads a mini-batch) and
    15 (no read larger than one data-parallel rank's share)."""
    gbs, n = b.gbs, b.n
    experience = {"Actor Infer": dispatch["actor_rollout_dispatch_size"], "Advantages": dispatch["adv_dispatch_size"],
                  "Reference": dispatch["ref_dispatch_size"], "Rule Reward": dispatch["reward_dispatch_size"],
                  "Actor Update": dispatch["actor_update_dispatch_size"]}
    if b.filtering:
        experience["Dynamic Sampling"] = dispatch["dynamic_sampling_dispatch_size"]
    if "actor_image_embeds_dispatch_size" in dispatch:
        experience["Image Embeds"] = dispatch["actor_image_embeds_dispatch_size"]
    if cfg.stage == "ppo":
        experience.update({"Critic Infer": dispatch["critic_value_dispatch_size"], "KL": dispatch["kl_dispatch_size"],
                           "Critic Update": dispatch["critic_update_dispatch_size"]})
    for component, count in experience.items():
        if (gbs * n) % count != 0:
            raise ConfigError(f"{component} global_batch_size {gbs} must be divisible by experience_count {count}")
    if b.filtering and dispatch["dynamic_sampling_dispatch_size"] % n != 0:
        raise ConfigError(f"dynamic sampling dispatch size {dispatch['dynamic_sampling_dispatch_size']} must be "
                          f"divisible by n samples per prompt {n}")
    mini = cfg.rl.mini_batch_size * n
    if dispatch["actor_update_dispatch_size"] < mini // b.actor_dp:
        raise ConfigError(f"actor_update_dispatch_size={dispatch['actor_update_dispatch_size']} must be >= "
                          f"mini_batch_size/actor_data_parallel_size ({mini}/{b.actor_dp}={mini // b.actor_dp})")
    for key in ("actor_rollout_dispatch_size", "actor_logprob_dispatch_size", "ref_dispatch_size",
                "actor_update_dispatch_size", "critic_update_dispatch_size", "critic_value_dispatch_size",
                "actor_image_embeds_dispatch_size"):
        value = dispatch.get(key)
        # the rollout runs on the inference DP, the critic on its own
        dp = b.infer_dp if key == "actor_rollout_dispatch_size" else _critic_dp(cfg, b) if key.startswith("critic") \
            else b.actor_dp
        per_dp = gbs * n // dp
        if value is not None and value > per_dp:
            raise ConfigError(f"{key} {value} cannot be greater than the number of samples generated on each data "
                              f"parallel worker, which is global_batch_size * n_samples_per_prompt // "
                              f"data_parallel_size = {gbs}*{n}//{dp} = {per_dp}")


def _check_rewards_and_clips(cfg: RunConfig) -> None:
    """Rules 16 (one weight per verifier), 17 (the overlong buffer), 18 (clip-higher) and 19 (the
    dynamic-sampling metric is a verifier)."""
    rl, max_tokens = cfg.rl, cfg.generate.sampling_config.max_tokens
    if len(rl.verifier_function) != len(rl.verifier_weight):
        raise ConfigError(f"Verifier function and weight length mismatch: {len(rl.verifier_function)} vs "
                          f"{len(rl.verifier_weight)}")
    if rl.overlong_buffer_enable:
        if rl.overlong_buffer >= max_tokens:
            raise ConfigError(f"Response max length {max_tokens} must greater than Dapo overlong buffer "
                              f"{rl.overlong_buffer}")
        if rl.rollout_max_tokens != max_tokens:
            raise ConfigError(f"overlong rollout_max_tokens and generate rollout_max_tokens mismatch: "
                              f"{rl.rollout_max_tokens} vs {max_tokens}")
    if rl.clip_higher_enable and rl.clip_ratio_low > rl.clip_ratio_high:
        raise ConfigError(f"clip_ratio_low {rl.clip_ratio_low} must less than clip_ratio_high {rl.clip_ratio_high}")
    filtering = cfg.stage == "dapo" and rl.filter_groups_enable
    if filtering and rl.filter_groups_metric not in rl.verifier_function:
        raise ConfigError(f"filter_groups_metric {rl.filter_groups_metric} must in verifier_function "
                          f"{rl.verifier_function}")


def _check_rollout_modes(cfg: RunConfig) -> None:
    """Rules 20 (partial rollout without guarantee_order) and 21 (multi-turn)."""
    rl, max_tokens = cfg.rl, cfg.generate.sampling_config.max_tokens
    if rl.partial_rollout_max_split > 1 and rl.guarantee_order:
        raise ConfigError("guarantee_order must be false when partial_rollout_max_split > 1")
    if rl.multi_turn_enable:
        if rl.max_total_response_length < max_tokens:
            raise ConfigError(f"max_total_response_length must greater than max_tokens:"
                              f"{rl.max_total_response_length} vs {max_tokens}")
        if not rl.async_engine:
            raise ConfigError("async_engine must be True when multi_turn_enable is True")


def _check_mini_batches(cfg: RunConfig, b: _Batch) -> None:
    """posttrain's own: a mini-batch is a whole number of prompts of the iteration, and of micro-batches
    on each data-parallel rank."""
    rl, mini = cfg.rl, cfg.rl.mini_batch_size * b.n
    if b.gbs % rl.mini_batch_size != 0:
        raise ConfigError(f"rl_config.mini_batch_size {rl.mini_batch_size} must divide global_batch_size {b.gbs} "
                          f"(both count prompts)")
    if (mini // b.actor_dp) % b.mbs != 0:
        raise ConfigError(f"mini_batch_size * n_samples_per_prompt / actor_dp = {mini}/{b.actor_dp} must be "
                          f"divisible by micro_batch_size {b.mbs}")


def _validate_offline(cfg: RunConfig, num_nodes: int) -> DeviceLayout:
    """DPO and SFT: rule 7, the global batch in micro-batches on every rank, and the DPO loss type
    (with the seed's message)."""
    a = cfg.actor
    num_devices = cfg.rl.actor_resource.num_npus or 1
    _check_resource("Actor", num_devices, a)
    gbs = _require(a.global_batch_size, "megatron_training.global_batch_size")
    mbs = _require(a.micro_batch_size, "megatron_training.micro_batch_size")
    dp = num_devices // _model_parallel(a)
    if gbs % (mbs * dp) != 0:
        raise ConfigError(f"global_batch_size {gbs} must be divisible by micro_batch_size {mbs} * "
                          f"data_parallel_size {dp}")
    _require(a.seq_length, "megatron_training.seq_length")
    if cfg.stage == "dpo":
        from posttrain.algo.dpo_loss import DPO_LOSSES  # lazy: algo/ imports torch; keeps config/ light
        from posttrain.algo.kto_loss import KTO

        if a.dpo_loss_type not in DPO_LOSSES and a.dpo_loss_type != KTO:  # the seed's message, with its list
            seed = ["sigmoid", "hinge", "ipo", "kto_pair"]  # and posttrain's additions
            raise ConfigError(f"Unknown loss type: {a.dpo_loss_type}. Should be one of "
                              f"{seed + [name for name in DPO_LOSSES.names() if name not in seed] + [KTO]}")
    return DeviceLayout(num_devices=num_devices, actor_dp=dp, infer_dp=dp, ref_dp=dp, num_nodes=num_nodes)
