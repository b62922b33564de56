"""The seed's ``validate_rl_args`` rules, with its messages, plus posttrain's own checks.

Rules are numbered as in seed_system.md 3.6. :func:`validate_run_config` raises
:class:`~posttrain.errors.ConfigError` on the first broken rule and returns the device layout with
the dispatch sizes the seed derives (a size the config sets is kept). It never writes into the
config. It is one part of :func:`posttrain.config.check.check_run_config`, the one check that both
``posttrain plan`` and ``posttrain train`` run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from posttrain.config.fields import fmt_value
from posttrain.config.megatron import MegatronConfig
from posttrain.config.run import RunConfig, role_sources
from posttrain.errors import ConfigError


@dataclass(frozen=True)
class Layout:
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


# ---- values that no rule can divide by: checked before the seed's rules ------------------------
def _where(cfg: RunConfig, *path: str) -> str:
    """``override '...': `` or ``file.yaml line 9: `` for a key path the config wrote."""
    return cfg.origins.prefix(*path) if getattr(cfg, "origins", None) is not None else ""


def actor_key(cfg: RunConfig, key: str) -> str:
    """``section.key`` of an actor key, naming the section that wrote it (megatron_training,
    actor_config or model.<name>; megatron_training for a default)."""
    return f"{role_sources(cfg.raw, cfg.models, 'actor_config').get(key, 'megatron_training')}.{key}"


def _bad(cfg: RunConfig, label: str, value: Any, want: str) -> ConfigError:
    where = "" if label.startswith("model.") else _where(cfg, *label.split("."))
    if where.startswith(f"override '{label}="):
        where = ""  # the override is this key=value, already in the message
    return ConfigError(f"{where}{label}={fmt_value(value)}: must be {want}")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def check_lora(cfg: RunConfig) -> None:
    """LoRA (``lora_target_modules`` set): its rank and alpha, and the features it does not run with
    yet, each refused by key."""
    a, rl = cfg.actor, cfg.rl
    if not a.lora_target_modules:
        return
    targets = actor_key(cfg, "lora_target_modules")
    if isinstance(a.lora_r, bool) or not isinstance(a.lora_r, int) or a.lora_r < 1:
        raise _bad(cfg, actor_key(cfg, "lora_r"), a.lora_r, "an integer >= 1 (the LoRA rank)")
    if not _finite(a.lora_alpha) or a.lora_alpha <= 0:
        raise _bad(cfg, actor_key(cfg, "lora_alpha"), a.lora_alpha, "a number > 0 (updates scale by lora_alpha / lora_r)")
    refusals = [
        (rl.ray_sharding == "fsdp2", "rl_config.ray_sharding=fsdp2",
         "FSDP2 with LoRA is not built yet; set rl_config.ray_sharding: ddp (the adapter is small: DDP keeps it whole)"),
        (rl.rollout_engine == "vllm", "rl_config.rollout_engine=vllm",
         "LoRA with the vLLM rollout is not built yet; use rollout_engine: native"),
        (cfg.critic is not None and bool(cfg.critic.lora_target_modules), "critic_config.lora_target_modules",
         "a LoRA critic is not built yet; set the lora_* keys in actor_config only"),
        (rl.share_backbone and rl.offload_reference, "rl_config.offload_reference=true",
         "with share_backbone the reference is the actor's own weights, so there is nothing to offload; remove one"),
    ]
    for active, key, why in refusals:
        if active:
            raise ConfigError(f"{key} with {targets}: {why}")


def check_sampling(cfg: RunConfig) -> None:
    """``generate_config.sampling_config``: the rollout's own rules (:meth:`SamplingParams.validate`,
    the same code the rollout runs), then a ``max_tokens`` the config writes against ``max_model_len``.

    A prompt and its response hold at most ``max_model_len`` tokens together (vLLM stops a response
    there, as in the seed), so a written ``max_tokens`` above ``max_model_len`` can never be reached
    and is refused. A longest prompt plus ``max_tokens`` above ``max_model_len`` is allowed: the seed's
    own recipes do that (r1_zero: 1024 + 4096 > 4096), relying on that cut."""
    from posttrain.rollout.base import SamplingParams

    gen = cfg.generate
    SamplingParams.from_config(gen.sampling_config.model_dump())  # raises naming the key
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


def check_verifier_settings(parallel: int, timeout: float) -> None:
    """``rl_config.verifier_parallel`` (0: inline) and ``verifier_timeout`` (seconds, finite, > 0)."""
    if parallel < 0:
        raise ConfigError(f"rl_config.verifier_parallel must be >= 0 (0 scores inline), got {parallel}")
    if not _finite(timeout) or timeout <= 0:
        raise ConfigError(f"rl_config.verifier_timeout must be a finite number of seconds > 0, got {timeout}")


def check_values(cfg: RunConfig) -> None:
    """Sizes, counts and optimizer numbers that no run can use (zero or negative sizes, NaN or
    infinite rates, ...): each error names the key, where it was written and its value. Runs
    before the seed's rules, which divide by the sizes."""
    a, rl, gen = cfg.actor, cfg.rl, cfg.generate
    on_policy = cfg.stage in ("grpo", "dapo", "ppo")

    def positive(key: str, what: str) -> None:
        value = getattr(a, key)
        if value is not None and value < 1:
            raise _bad(cfg, actor_key(cfg, key), value, f"an integer >= 1 ({what})")

    positive("global_batch_size", "prompts per iteration")
    positive("micro_batch_size", "sequences per forward/backward")
    positive("seq_length", "tokens")
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                "expert_model_parallel_size"):
        positive(key, "1 means no model parallelism")
    if a.train_iters is not None and a.train_iters < 1:
        raise _bad(cfg, actor_key(cfg, "train_iters"), a.train_iters, "an integer >= 1 (iterations to run)" +
                   ("; 0 leaves nothing to train" if a.train_iters == 0 else ""))
    if a.save_interval is not None and a.save_interval < 0:
        raise _bad(cfg, actor_key(cfg, "save_interval"), a.save_interval,
                   ">= 0 (save every N iterations; 0 or null: only the final save)")
    if a.keep_last is not None and a.keep_last < 1:
        raise _bad(cfg, actor_key(cfg, "keep_last"), a.keep_last, "an integer >= 1 (checkpoints to keep; null keeps all)")
    if a.lr is not None and (not _finite(a.lr) or a.lr <= 0):
        raise _bad(cfg, actor_key(cfg, "lr"), a.lr, "a finite number > 0 (the peak learning rate)")
    for key in ("min_lr", "weight_decay"):
        value = getattr(a, key)
        if not _finite(value) or value < 0:
            raise _bad(cfg, actor_key(cfg, key), value, "a finite number >= 0")
    if not _finite(a.clip_grad):
        raise _bad(cfg, actor_key(cfg, "clip_grad"), a.clip_grad,
                   "a finite number (the gradient-norm clip; 0 or less turns clipping off)")
    for key in ("adam_beta1", "adam_beta2"):
        value = getattr(a, key)
        if not _finite(value) or not 0 <= value < 1:
            raise _bad(cfg, actor_key(cfg, key), value, "a number in [0, 1)")
    if a.lr_warmup_fraction is not None and (not _finite(a.lr_warmup_fraction) or not 0 <= a.lr_warmup_fraction <= 1):
        raise _bad(cfg, actor_key(cfg, "lr_warmup_fraction"), a.lr_warmup_fraction, "a number in [0, 1]")
    check_lora(cfg)
    if rl.num_threads is not None and (isinstance(rl.num_threads, bool) or rl.num_threads < 1):
        raise _bad(cfg, "rl_config.num_threads", rl.num_threads, "an integer >= 1 (torch threads; unset: chosen "
                   "from the free cores)")
    for name in ("actor_resource", "reference_resource", "reward_resource", "critic_resource", "vit_resource"):
        resource = getattr(rl, name)
        if resource is not None and resource.num_npus is not None and resource.num_npus < 0:
            raise _bad(cfg, f"rl_config.{name}.num_npus", resource.num_npus,
                       ">= 0 (devices, or CPU worker processes; 0 or 1: one process)")
    if not on_policy:
        return
    for key, what in (("n_samples_per_prompt", "responses per prompt"), ("mini_batch_size", "prompts per "
                      "optimizer step"), ("epochs", "passes over each iteration's mini-batches"),
                      ("max_prompt_length", "prompts this long or longer are dropped")):
        value = getattr(rl, key)
        if value < 1:
            raise _bad(cfg, f"rl_config.{key}", value, f"an integer >= 1 ({what})")
    for key in ("actor_rollout_dispatch_size", "actor_logprob_dispatch_size", "ref_dispatch_size",
                "reward_dispatch_size", "dynamic_sampling_dispatch_size", "adv_dispatch_size",
                "actor_update_dispatch_size", "critic_update_dispatch_size", "critic_value_dispatch_size",
                "kl_dispatch_size"):
        value = getattr(rl, key)
        if value is not None and value < 1:
            raise _bad(cfg, f"rl_config.{key}", value, "an integer >= 1 (rows per read), or null to derive it")
    for key in ("infer_tensor_parallel_size", "infer_pipeline_parallel_size", "max_num_seqs", "max_model_len"):
        value = getattr(gen, key)
        if value < 1:
            raise _bad(cfg, f"generate_config.{key}", value, "an integer >= 1")
    check_sampling(cfg)
    for i, weight in enumerate(rl.verifier_weight):
        if not _finite(weight) or weight < 0:
            raise ConfigError(f"{_where(cfg, 'rl_config', 'verifier_weight')}rl_config.verifier_weight[{i}]="
                              f"{fmt_value(weight)}: must be a finite number >= 0 (the weight of verifier "
                              f"{rl.verifier_function[i] if i < len(rl.verifier_function) else i})")
    check_verifier_settings(rl.verifier_parallel, rl.verifier_timeout)
    # mini-batches are cut from the prompts of one update: global_batch_size, or DAPO's
    # filter_groups_train_batch_size with dynamic sampling
    gbs_key = actor_key(cfg, "global_batch_size")
    update_key, update = gbs_key, a.global_batch_size
    if cfg.stage == "dapo" and rl.filter_groups_enable:
        update_key, update = "rl_config.filter_groups_train_batch_size", rl.filter_groups_train_batch_size
        if update < 1:
            raise _bad(cfg, update_key, update, "an integer >= 1 (prompts kept per iteration)")
    if update is not None and rl.mini_batch_size > update:
        raise ConfigError(f"{_where(cfg, 'rl_config', 'mini_batch_size')}rl_config.mini_batch_size="
                          f"{rl.mini_batch_size} is larger than {update_key}={update} (both count prompts): an "
                          f"optimizer step cannot take more prompts than an iteration updates on. Make "
                          f"mini_batch_size a divisor of {update_key.split('.')[-1]}")


def validate_run_config(cfg: RunConfig, *, device_type: str = "cpu", num_nodes: int = 1) -> Layout:
    """Check ``cfg`` as the seed does and derive the dispatch sizes. Returns the device layout.

    ``num_nodes`` is the number of nodes of the Ray cluster the run will use (1 for a local run)."""
    a, rl, gen = cfg.actor, cfg.rl, cfg.generate
    stage = cfg.stage
    check_values(cfg)
    # 1
    if a.ai_framework not in (None, "mindspore"):
        raise ConfigError(f"Invalid value for ai_framework: '{a.ai_framework}'. Only None or mindspore are allowed")
    # 2 (not on CPU: fp32 is allowed there; bf16 is used only where the CPU has bf16 matmul units)
    if device_type != "cpu" and (a.bf16 is False or gen.dtype != "bfloat16"):
        raise ConfigError(" megatron_config.bf16 should be true and generate_config.dtype should be bfloat16.")
    if gen.dtype not in ("bfloat16", "float32", "float16"):
        raise ConfigError(f"generate_config.dtype: unknown dtype '{gen.dtype}'; use bfloat16 or float32")
    if stage in ("dpo", "sft"):
        return _validate_offline(cfg, num_nodes)
    # 3 (posttrain, unlike the seed, runs a reward model in integrated mode: colocated with the actor,
    # reward_config and reward_resource are checked in posttrain.config.reward_model)
    if rl.use_integrated_worker:
        if rl.reference_resource is not None:
            raise ConfigError("reference_resource should not be set when use_integrated_worker mode is on.")
        if cfg.raw.get("ref_config") is not None:
            raise ConfigError("ref_config should not be set when use_integrated_worker mode is on.")
    elif rl.integrated_mode_config is not None:
        raise ConfigError("integrated_mode_config should not be set when use_integrated_worker mode is off.")
    if stage == "dapo" and cfg.raw.get("ref_config") is not None:
        raise ConfigError("ref_config should not be set when use_integrated_worker mode is on.")
    # 4
    seq_length = _require(a.seq_length, "megatron_training.seq_length")
    if gen.max_model_len < seq_length:
        raise ConfigError(f"Sequence length exceeds vLLM max_model_len! Actor.seq_length={seq_length} vs "
                          f"GenerateConfig.max_model_len={gen.max_model_len}")
    # 5
    if a.context_parallel_size > 1 and a.context_parallel_algo not in ("ulysses_cp_algo", "megatron_cp_algo"):
        raise ConfigError("Now just support ulysses CP and megatron cp(ring)")
    # remove padding is on by default here (the seed's default is off): rules 5 and 6 apply when a config
    # asks for it, so a seed config that never mentions it runs unchanged, packed
    packing_asked = rl.use_remove_padding and cfg.explicitly_set("rl_config", "use_remove_padding")
    if (a.context_parallel_size > 1 and a.context_parallel_algo == "megatron_cp_algo" and packing_asked
            and not a.reset_attention_mask):
        raise ConfigError("when use ring cp and remove_padding, reset_attention_mask must be true")
    # 6
    if packing_asked:
        if a.pipeline_model_parallel_size > 1 and not a.no_pad_to_seq_lengths:
            raise ConfigError("'use_remove_padding' feature requires 'no_pad_to_seq_lengths=True' when using "
                              "pipeline parallelism! Please set 'no_pad_to_seq_lengths=True'.")
        if not a.reset_attention_mask:
            raise ConfigError("'use_remove_padding' feature requires 'reset_attention_mask=True'! ")
        if rl.is_multimodal:
            raise ConfigError("'multimodal' models cannot use 'use_remove_padding' feature! Please set "
                              "'use_remove_padding=False' in the RLConfig.")
    # 7
    num_devices = rl.actor_resource.num_npus or 1
    _check_resource("Actor", num_devices, a)
    gbs = _require(a.global_batch_size, "megatron_training.global_batch_size")
    mbs = _require(a.micro_batch_size, "actor_config.micro_batch_size")
    n = rl.n_samples_per_prompt
    # 8
    _check_batch_ratio("Actor", gbs, n, mbs)
    _check_batch_ratio("Reference", gbs, n, (cfg.ref or a).micro_batch_size or mbs)
    if cfg.reward is not None:
        _check_batch_ratio("Reward", gbs, n, cfg.reward.micro_batch_size or mbs)
    # 9
    if gen.infer_pipeline_parallel_size > 1:
        raise ConfigError("pipeline_parallel for vllm is not supported yet ! ")
    actor_dp = num_devices // _model_parallel(a)
    infer_model_parallel = gen.infer_tensor_parallel_size * gen.infer_pipeline_parallel_size
    if num_devices % infer_model_parallel != 0:
        raise ConfigError(f"Invalid Generation resource allocation! Resource={num_devices} must be divisible by "
                          f"(infer_tensor_parallel * infer_pipeline_parallel) = {infer_model_parallel}")
    infer_dp = num_devices // infer_model_parallel
    ref_dp = actor_dp
    # 10
    _check_data_parallel("Actor", gbs, actor_dp, n, mbs)
    rollout_dispatch = rl.actor_rollout_dispatch_size or gbs * n // infer_dp
    _check_data_parallel("Generation", gbs, infer_dp, n, rollout_dispatch)
    # 11
    filtering = stage == "dapo" and rl.filter_groups_enable
    train_gbs = rl.filter_groups_train_batch_size if filtering else gbs
    if filtering:
        _check_data_parallel("ActorForDapo", train_gbs, actor_dp, n, mbs)
    if rl.rule_reward and gbs % num_nodes != 0:
        raise ConfigError(f"Reward dispatch size configuration error!global_batch_size {gbs} must be divisible "
                          f"by the number of nodes in the ray cluster")
    derived = {
        "actor_rollout_dispatch_size": gbs * n // infer_dp,
        "actor_logprob_dispatch_size": train_gbs * n // actor_dp,
        "adv_dispatch_size": train_gbs * n,
        "dynamic_sampling_dispatch_size": gbs * n // num_nodes,
        "ref_dispatch_size": gbs * n // ref_dp,
        "reward_dispatch_size": gbs * n // num_nodes,
        "actor_update_dispatch_size": train_gbs * n // actor_dp,
    }
    if stage == "ppo":
        critic = cfg.critic or a
        critic_dp = (rl.critic_resource.num_npus if rl.critic_resource and rl.critic_resource.num_npus
                     else num_devices) // _model_parallel(critic)
        derived.update(critic_update_dispatch_size=gbs * n // critic_dp,
                       critic_value_dispatch_size=gbs * n // critic_dp, kl_dispatch_size=gbs * n)
    dispatch = {key: getattr(rl, key) if getattr(rl, key) is not None else value for key, value in derived.items()}
    # 12
    if rl.share_backbone and not a.lora_target_modules:
        raise ConfigError("The shared backbone can only be used with LoRA.")
    if rl.share_backbone and stage == "dapo":
        raise ConfigError("'share_backbone' cannot be True when 'stage' is set to 'ray_dapo'.")
    # 13
    experience = {"Actor Infer": dispatch["actor_rollout_dispatch_size"], "Advantages": dispatch["adv_dispatch_size"],
                  "Reference": dispatch["ref_dispatch_size"], "Rule Reward": dispatch["reward_dispatch_size"],
                  "Actor Update": dispatch["actor_update_dispatch_size"]}
    if filtering:
        experience["Dynamic Sampling"] = dispatch["dynamic_sampling_dispatch_size"]
    if stage == "ppo":
        experience.update({"Critic Infer": dispatch["critic_value_dispatch_size"], "KL": dispatch["kl_dispatch_size"],
                           "Critic Update": dispatch["critic_update_dispatch_size"]})
    for component, count in experience.items():
        if (gbs * n) % count != 0:
            raise ConfigError(f"{component} global_batch_size {gbs} must be divisible by experience_count {count}")
    if filtering and dispatch["dynamic_sampling_dispatch_size"] % n != 0:
        raise ConfigError(f"dynamic sampling dispatch size {dispatch['dynamic_sampling_dispatch_size']} must be "
                          f"divisible by n samples per prompt {n}")
    # 14
    mini = rl.mini_batch_size * n
    if dispatch["actor_update_dispatch_size"] < mini // actor_dp:
        raise ConfigError(f"actor_update_dispatch_size={dispatch['actor_update_dispatch_size']} must be >= "
                          f"mini_batch_size/actor_data_parallel_size ({mini}/{actor_dp}={mini // actor_dp})")
    # 15
    for key in ("actor_rollout_dispatch_size", "actor_logprob_dispatch_size", "ref_dispatch_size",
                "actor_update_dispatch_size", "critic_update_dispatch_size", "critic_value_dispatch_size"):
        value = dispatch.get(key)
        dp = infer_dp if key == "actor_rollout_dispatch_size" else actor_dp  # rollout runs on inference DP
        per_dp = gbs * n // dp
        if value is not None and value > per_dp:
            raise ConfigError(f"{key} {value} cannot be greater than the number of samples generated on each data "
                              f"parallel worker, which is global_batch_size * n_samples_per_prompt // "
                              f"data_parallel_size = {gbs}*{n}//{dp} = {per_dp}")
    # 16
    if len(rl.verifier_function) != len(rl.verifier_weight):
        raise ConfigError(f"Verifier function and weight length mismatch: {len(rl.verifier_function)} vs "
                          f"{len(rl.verifier_weight)}")
    max_tokens = gen.sampling_config.max_tokens
    # 17
    if rl.overlong_buffer_enable:
        if rl.overlong_buffer >= max_tokens:
            raise ConfigError(f"Response max length {max_tokens} must greater than Dapo overlong buffer "
                              f"{rl.overlong_buffer}")
        if rl.rollout_max_tokens != max_tokens:
            raise ConfigError(f"overlong rollout_max_tokens and generate rollout_max_tokens mismatch: "
                              f"{rl.rollout_max_tokens} vs {max_tokens}")
    # 18
    if rl.clip_higher_enable and rl.clip_ratio_low > rl.clip_ratio_high:
        raise ConfigError(f"clip_ratio_low {rl.clip_ratio_low} must less than clip_ratio_high {rl.clip_ratio_high}")
    # 19
    if filtering and rl.filter_groups_metric not in rl.verifier_function:
        raise ConfigError(f"filter_groups_metric {rl.filter_groups_metric} must in verifier_function "
                          f"{rl.verifier_function}")
    # 20
    if rl.partial_rollout_max_split > 1 and rl.guarantee_order:
        raise ConfigError("guarantee_order must be false when partial_rollout_max_split > 1")
    # 21
    if rl.multi_turn_enable:
        if rl.max_total_response_length < max_tokens:
            raise ConfigError(f"max_total_response_length must greater than max_tokens:"
                              f"{rl.max_total_response_length} vs {max_tokens}")
        if not rl.async_engine:
            raise ConfigError("async_engine must be True when multi_turn_enable is True")
    # posttrain's own rules
    if gbs % rl.mini_batch_size != 0:
        raise ConfigError(f"rl_config.mini_batch_size {rl.mini_batch_size} must divide global_batch_size {gbs} "
                          f"(both count prompts)")
    if (mini // actor_dp) % mbs != 0:
        raise ConfigError(f"mini_batch_size * n_samples_per_prompt / actor_dp = {mini}/{actor_dp} must be divisible "
                          f"by micro_batch_size {mbs}")
    return Layout(num_devices=num_devices, actor_dp=actor_dp, infer_dp=infer_dp, ref_dp=ref_dp, num_nodes=num_nodes,
                  dispatch_sizes=dispatch)


def _validate_offline(cfg: RunConfig, num_nodes: int) -> Layout:
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
        from posttrain.algo.dpo_loss import DPO_LOSSES

        if a.dpo_loss_type not in DPO_LOSSES:  # the seed's message, with its list
            raise ConfigError(f"Unknown loss type: {a.dpo_loss_type}. Should be one of "
                              f"['sigmoid', 'hinge', 'ipo', 'kto_pair']")
    return Layout(num_devices=num_devices, actor_dp=dp, infer_dp=dp, ref_dp=dp, num_nodes=num_nodes)
