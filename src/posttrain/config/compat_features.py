"""The dimensions a run is placed along and the features a config turns on: the two axes of the
compatibility table (:mod:`posttrain.config.compat`), which also re-exports these names.

:class:`Setup` places a run (backend, rollout engine, placement, device, stage); :data:`FEATURES`
names each :class:`Feature`: its key, when it is on, and how a message shows it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from posttrain.config.backend import VPP_KEY, resolve_backend, role_label, uses_ray
from posttrain.config.engine_choice import auto_engine
from posttrain.config.fields import fmt_value
from posttrain.config.run import RunConfig
from posttrain.config.sections import QUEUE_STRATEGIES
from posttrain.config.separated import legacy_rollout_worker, role_devices, rollout_worker

# the dimensions and their values (the table's keys), with the names the docs print
DIMENSIONS: dict[str, dict[str, str]] = {
    "backend": {"hf": "hf", "megatron": "megatron"},
    "engine": {"native": "native", "vllm": "vllm", "other": "another engine"},
    "placement": {"process": "one process", "ray-ddp": "Ray DDP", "ray-fsdp2": "Ray FSDP2"},
    "device": {"cpu": "cpu", "cuda": "cuda"},
    "stage": {s: s for s in ("grpo", "dapo", "ppo", "dpo", "sft")},
}
RAY = ("ray-ddp", "ray-fsdp2")
NOT_NATIVE = ("vllm", "other")
ON_POLICY = ("grpo", "dapo", "ppo")
OFFLINE = ("dpo", "sft")
EFFECTS = ("refused", "no effect")
# how the docs name a set of values of one dimension
GROUPS = {("stage", ON_POLICY): "on-policy stages", ("engine", NOT_NATIVE): "engine not native",
          ("placement", RAY): "Ray actor workers"}


@dataclass(frozen=True)
class Setup:
    """Where a run sits along the table's dimensions."""

    backend: str
    engine: str
    placement: str
    device: str
    stage: str
    reason: str = ""  # why this backend (backend.resolve_backend)

    def value(self, dimension: str) -> str:
        return getattr(self, dimension)


def setup_of(cfg: RunConfig, device_type: str, backend: str | None = None) -> Setup:
    """The :class:`Setup` of ``cfg`` on ``device_type`` ("cpu" or "cuda"); ``backend`` defaults to the
    resolved one."""
    resolved, reason = resolve_backend(cfg)
    engine = cfg.rl.rollout_engine
    if engine == "auto":  # not resolved yet (posttrain.config.engine_choice.resolve_engine)
        engine = auto_engine(cfg, device_type)
    engine = engine if engine in ("native", "vllm") else "other"
    placement = "process" if not uses_ray(cfg) else f"ray-{cfg.rl.ray_sharding}"
    return Setup(backend=backend or resolved, engine=engine, placement=placement, device=device_type,
                 stage=cfg.stage, reason=reason)


# ---- features: what a config turns on --------------------------------------------------------------
_SECTIONS = {"actor_config": "actor", "ref_config": "ref", "critic_config": "critic", "reward_config": "reward",
             "rl_config": "rl", "generate_config": "generate"}


def value_of(cfg: RunConfig, key: str) -> Any:
    """The value of ``section.key`` (``section.key.sub``) in ``cfg`` (None when the section is absent)."""
    section, *names = key.split(".")
    value = getattr(cfg, _SECTIONS[section])
    for name in names:
        value = None if value is None else getattr(value, name)
    return value


@dataclass(frozen=True)
class Feature:
    """Something a config turns on: ``keys`` turn it on (the first is the one a message names),
    ``active`` says whether ``cfg`` does. ``shown`` replaces ``key=value`` in messages; ``when`` says
    in words when it is on and ``title`` names it (both for the docs)."""

    name: str
    keys: tuple[str, ...]
    active: Callable[[RunConfig], bool]
    shown: str | Callable[[RunConfig], str] = ""
    when: str = ""
    title: str = ""

    def label(self, cfg: RunConfig) -> str:
        """The first key, naming for a Megatron role the section (or model yaml) that wrote it."""
        section, _, name = self.keys[0].partition(".")
        return role_label(cfg, section, name) if name else section

    def setting(self, cfg: RunConfig) -> str:
        if callable(self.shown):
            return self.shown(cfg)
        if self.shown:
            return self.shown
        if "." not in self.keys[0]:
            return self.keys[0]
        return f"{self.label(cfg)}={fmt_value(value_of(cfg, self.keys[0]))}"

    def describe(self) -> str:
        """How the docs name it: ``actor_config.lora_target_modules (set)``."""
        return self.title or ", ".join(self.keys) + (f" ({self.when})" if self.when else "")


def _on(key: str, test: Callable[[Any], bool] = bool, **kw: Any) -> Feature:
    """A feature that ``key`` turns on when ``test(value)`` holds."""
    return Feature(kw.pop("name", key.split(".")[-1]), (key,), lambda cfg: test(value_of(cfg, key)), **kw)


def _written(key: str, test: Callable[[Any], bool]) -> Callable[[RunConfig], bool]:
    return lambda cfg: test(value_of(cfg, key)) and cfg.explicitly_set(*key.split("."))


def _differs(key: str) -> Callable[[RunConfig], bool]:
    """A role's value of a layout key that is not the actor's."""
    name = key.partition(".")[2]
    return lambda cfg: value_of(cfg, key) is not None and value_of(cfg, key) != getattr(cfg.actor, name)


def _own_critic_save(cfg: RunConfig) -> bool:
    """``critic_config.save`` names a directory other than the actor's."""
    critic, actor = cfg.critic, cfg.actor
    return (critic is not None and bool(critic.save) and
            (not actor.save or os.path.realpath(critic.save) != os.path.realpath(actor.save)))


def _bf16_asked(cfg: RunConfig) -> bool:
    """``bf16: true`` written in the config (the seed's default, true, is not a request)."""
    return bool(cfg.actor.bf16) and (cfg.explicitly_set("megatron_training", "bf16")
                                     or cfg.explicitly_set("actor_config", "bf16"))


def _separated_shown(cfg: RunConfig) -> str:
    groups = ", ".join(f"{role} on {count}" for role, count in role_devices(cfg).items())
    return (f"rl_config.use_integrated_worker: false with reference_resource / reward_resource / critic_resource "
            f"({groups} worker(s))")


def _queue_features() -> list[Feature]:
    """rl_config.data_strategy: tq (posttrain.cluster.transfer_queue), and its shard count without it."""
    return [_on("rl_config.data_strategy", lambda v: v in QUEUE_STRATEGIES, name="transfer_queue",
                shown=lambda c: f"rl_config.data_strategy: {c.rl.data_strategy}", when="tq, transfer_queue or queue"),
            Feature("queue_shards", ("rl_config.transfer_queue_data_shard_num",),
                    lambda c: c.rl.transfer_queue_data_shard_num != 1 and c.rl.data_strategy not in QUEUE_STRATEGIES,
                    when="not 1, without data_strategy: tq")]


def _diagnostics() -> list[Feature]:
    """The seed's diagnostics sections: the profiler and the accuracy dumps."""
    return [
        Feature("profiler", ("profiler_config.integrated.profile",), lambda c: c.profiler.profile,
                shown="profiler_config.integrated.profile: true", when="true"),
        Feature("msprobe", ("msprobe_config.msprobe",), lambda c: c.msprobe.msprobe, shown="msprobe_config.msprobe: "
                "true", when="true"),
        *(Feature(f"msprobe_{name}", (f"msprobe_config.{name}_dump",),
                  lambda c, key=f"{name}_dump": c.msprobe.msprobe and getattr(c.msprobe, key),
                  shown=f"msprobe_config.{name}_dump: true", when="true, with msprobe: true")
          for name in ("actor_infer", "reference", "critic_train")),
    ]


def _truncation_features() -> list[Feature]:
    """rl_config.truncated_sampling_logprobs, and the sampling settings it cannot follow."""
    key, shown = "rl_config.truncated_sampling_logprobs", "rl_config.truncated_sampling_logprobs: true"
    sampling = lambda c: c.generate.sampling_config  # noqa: E731
    return [
        _on(key, name="truncated_logprobs", shown=shown, when="true"),
        Feature("truncated_logprobs_greedy", (key,), lambda c: c.rl.truncated_sampling_logprobs
                and sampling(c).temperature == 0, shown=shown + " with sampling_config.temperature: 0",
                when="true, with temperature 0 (greedy)"),
        Feature("truncated_logprobs_untruncated", (key,), lambda c: c.rl.truncated_sampling_logprobs
                and sampling(c).top_k <= 0 and sampling(c).top_p >= 1.0 and sampling(c).min_p <= 0.0,
                shown=shown + " without top_k, top_p or min_p", when="true, with no truncation"),
        Feature("truncated_logprobs_min_p", (key,), lambda c: c.rl.truncated_sampling_logprobs
                and sampling(c).min_p > 0.0, shown=shown + " with sampling_config.min_p > 0",
                when="true, with min_p > 0"),
    ]


VIDEO_KEY = "generate_config.limit_mm_video_per_prompt"  # videos in the multimodal loop (Qwen2.5-VL, Qwen3-VL)
MM_KEYS_ALONE = ("reuse_image_embeds", "freeze_vision_tower", "vit_forward_micro_batch_size",
                 "actor_image_embeds_dispatch_size")  # rl_config keys that only a multimodal run reads


def _mm_keys_set(cfg: RunConfig) -> list[str]:
    return [k for k in MM_KEYS_ALONE if getattr(cfg.rl, k) not in (None, False)]


_SPLIT_KEYS = ("pipeline_model_parallel_size", "context_parallel_size", "expert_model_parallel_size",
               "sequence_parallel")  # the megatron layouts a VLM's language model is not built with


def _split_set(cfg: RunConfig) -> list[str]:
    return [k for k in _SPLIT_KEYS if getattr(cfg.actor, k) not in (None, False, 1)]


def _multimodal_features() -> list[Feature]:
    """rl_config.is_multimodal (docs/multimodal.md) and the multimodal keys that need it or each other."""
    rl = lambda c: c.rl  # noqa: E731
    return [
        _on("rl_config.is_multimodal", name="multimodal", shown="rl_config.is_multimodal: true", when="true"),
        Feature("mm_key_alone", tuple(f"rl_config.{k}" for k in MM_KEYS_ALONE),
                lambda c: not rl(c).is_multimodal and bool(_mm_keys_set(c)),
                shown=lambda c: ", ".join(f"rl_config.{k}={fmt_value(getattr(c.rl, k))}" for k in _mm_keys_set(c)),
                when="set, without is_multimodal: true", title="a multimodal key without rl_config.is_multimodal"),
        Feature("vision_tower_trained", ("rl_config.freeze_vision_tower",),
                lambda c: rl(c).is_multimodal and not rl(c).freeze_vision_tower,
                shown="rl_config.freeze_vision_tower: false", when="false, with is_multimodal: true"),
        Feature("reuse_image_embeds", ("rl_config.reuse_image_embeds",),
                lambda c: rl(c).is_multimodal and rl(c).reuse_image_embeds,
                shown="rl_config.reuse_image_embeds: true", when="true, with is_multimodal: true"),
        Feature("mm_eval", ("rl_config.eval_data_path",), lambda c: rl(c).is_multimodal and bool(rl(c).eval_data_path),
                when="set, with is_multimodal: true"),
        Feature("image_embeds_dispatch_alone", ("rl_config.actor_image_embeds_dispatch_size",),
                lambda c: rl(c).actor_image_embeds_dispatch_size is not None and not rl(c).reuse_image_embeds,
                when="set, without reuse_image_embeds: true"),
        Feature("mm_model_split", tuple(f"actor_config.{k}" for k in _SPLIT_KEYS),
                lambda c: rl(c).is_multimodal and bool(_split_set(c)),
                shown=lambda c: ", ".join(f"actor_config.{k}={fmt_value(getattr(c.actor, k))}" for k in _split_set(c)),
                when="PP, CP or EP > 1 or sequence_parallel, with is_multimodal: true",
                title="pipeline, context or expert parallelism or sequence parallelism with images"),
        Feature("mm_bf16", ("actor_config.bf16",), lambda c: rl(c).is_multimodal and bool(c.actor.bf16),
                when="true (the default), with is_multimodal: true"),
        Feature("videos", (VIDEO_KEY,), lambda c: rl(c).is_multimodal and c.generate.limit_mm_video_per_prompt > 0,
                when="> 0, with is_multimodal: true"),
        Feature("videos_alone", (VIDEO_KEY,), lambda c: not rl(c).is_multimodal and c.generate.limit_mm_video_per_prompt > 0,
                when="> 0, without is_multimodal: true"),
    ]


def _features() -> dict[str, Feature]:
    per_request = Feature("per_request", ("rl_config.async_engine", "rl_config.multi_turn_enable"),
                          lambda c: c.rl.async_engine or c.rl.multi_turn_enable,
                          shown="rl_config.async_engine / multi_turn_enable", when="either is true")
    features = [
        Feature("ref_config", ("ref_config",),
                lambda c: c.raw.get("ref_config") is not None and "reference" not in role_devices(c),
                when="present, without a reference in a group of its own"),
        Feature("separated", ("rl_config.use_integrated_worker", "rl_config.reference_resource",
                              "rl_config.reward_resource", "rl_config.critic_resource"), lambda c: bool(role_devices(c)),
                shown=_separated_shown, when="false, with reference_resource, reward_resource or critic_resource",
                title="rl_config.use_integrated_worker: false with a role resource (separated roles)"),
        Feature("separated_reference", ("rl_config.reference_resource",), lambda c: "reference" in role_devices(c),
                when="set, with use_integrated_worker: false"),
        Feature("separated_critic_save", ("rl_config.critic_resource",),
                lambda c: "critic" in role_devices(c) and not _own_critic_save(c),
                when="set, with use_integrated_worker: false and no critic_config.save of its own"),
        Feature("blocking_integrated", ("rl_config.blocking",), lambda c: not c.rl.blocking and not role_devices(c),
                shown="rl_config.blocking: false", when="false, without separated roles"),
        Feature("reward_model", ("reward_config",), lambda c: c.reward is not None, when="present"),
        Feature("megatron", ("rl_config.actor_resource.num_npus",), lambda c: True,
                shown=lambda c: f"rl_config.actor_resource.num_npus={c.rl.actor_resource.num_npus or 1}",
                title="the megatron backend"),
        _on("actor_config.lora_target_modules", name="lora", when="set"),
        _on("critic_config.lora_target_modules", name="critic_lora", when="set"),
        _on("rl_config.ray_sharding", lambda v: v == "fsdp2", name="fsdp2", when="fsdp2"),
        _on("rl_config.offload_reference", when="true"),
        _on("rl_config.share_backbone", when="true"),
        Feature("ref_model_load_path", ("rl_config.integrated_mode_config",),
                lambda c: bool((c.rl.integrated_mode_config or {}).get("ref_model_load_path")),
                shown=lambda c: "rl_config.integrated_mode_config.ref_model_load_path="
                                f"{(c.rl.integrated_mode_config or {}).get('ref_model_load_path')}",
                when="ref_model_load_path set", title="rl_config.integrated_mode_config.ref_model_load_path (set)"),
        Feature("bf16", ("actor_config.bf16",), _bf16_asked, when="written as true"),
        Feature("share_prompt_prefix", ("rl_config.share_prompt_prefix",),
                lambda c: c.rl.use_remove_padding and _written("rl_config.share_prompt_prefix", bool)(c),
                when="written as true, with use_remove_padding"),
        *(Feature(f"{role}.{key}", (f"{role}.{key}",), _differs(f"{role}.{key}"), when="not the actor's value")
          for role in ("ref_config", "critic_config")
          for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", VPP_KEY)),
        _on("actor_config.moe_tp_extend_ep", when="true"),
        _on("actor_config.use_distributed_optimizer", when="true"),
        _on("rl_config.rollout_engine", lambda v: v == "vllm", name="vllm", shown="rl_config.rollout_engine=vllm",
            when="vllm"),
        _on("generate_config.infer_tensor_parallel_size", lambda v: v > 1, name="infer_tensor_parallel",
            when="> 1"),
        _on("generate_config.infer_pipeline_parallel_size", lambda v: v > 1, when="> 1"),
        _on("generate_config.infer_expert_parallel_size", lambda v: v > 1, when="> 1"),
        _on("generate_config.num_scheduler_steps", lambda v: v != 1, when="not 1"),
        _on("generate_config.torchair_graph", when="true"),
        Feature("ascend_scheduler_config_enabled", ("generate_config.ascend_scheduler_config_enabled",),
                _written("generate_config.ascend_scheduler_config_enabled", bool), when="written as true"),
        _on("generate_config.num_speculative_tokens", lambda v: v > 0, name="speculation", when="> 0"),
        _on("generate_config.offload_train_param", name="offload_param", when="true"),
        per_request,
        _on("generate_config.enforce_eager", lambda v: not v, name="graphs",
            shown="generate_config.enforce_eager: false", when="false"),
        *_kernel_features(),
        _on("rl_config.use_dp_batch_balance", name="dp_batch_balance", when="true"),
        _on("rl_config.async_staleness", lambda v: v is not None, name="async", shown="rl_config.async_staleness",
            when="set"),
        Feature("rollout_worker", ("rl_config.separate_rollout_worker",), rollout_worker,
                shown=lambda c: "rl_config.use_integrated_worker: false (the deprecated spelling of "
                "rl_config.separate_rollout_worker: true)" if legacy_rollout_worker(c)
                else "rl_config.separate_rollout_worker: true",
                when="true (or the deprecated use_integrated_worker: false without role resources)",
                title="rl_config.separate_rollout_worker (true)"),
        _on("rl_config.partial_rollout_max_split", lambda v: v > 1, name="partial",
            shown="rl_config.partial_rollout_max_split > 1", when="> 1"),
        _on("rl_config.filter_groups_enable", name="dynamic_sampling", when="true"),
        *_queue_features(),
        _on("rl_config.async_engine", shown="rl_config.async_engine: true", when="true"),
        _on("rl_config.multi_turn_enable", name="multi_turn", shown="rl_config.multi_turn_enable: true", when="true"),
        *_env_features(),
        *_diagnostics(),
        *_turn_credit_features(),
        *_truncation_features(),
        *_multimodal_features(),
    ]
    return {f.name: f for f in features}


def _kernel_features() -> list[Feature]:
    """The CPU's thread count and the compiled update regions."""
    return [_on("rl_config.num_threads", lambda v: v is not None, when="set"),
            _on("rl_config.compile_regions", when="true or auto"),
            _on("rl_config.compile_regions", lambda v: v == "auto", name="compile_auto", when="auto")]


def _env_features() -> list[Feature]:
    """rl_config.env_config (posttrain.envs), and the keys it replaces."""
    env = lambda c: c.rl.env_config is not None  # noqa: E731
    return [
        _on("rl_config.env_config", lambda v: v is not None, name="env", shown="rl_config.env_config", when="set"),
        Feature("env_turns", ("rl_config.env_config",), lambda c: env(c) and c.rl.env_config.get("type") == "openenv",
                shown="rl_config.env_config.type: openenv", when="type openenv (multi-turn)"),
        Feature("env_data_path", ("actor_config.data_path", "actor_config.split"),
                lambda c: env(c) and bool(c.actor.data_path or c.actor.split),
                shown=lambda c: " and ".join(role_label(c, "actor_config", k) for k in ("data_path", "split")
                                             if getattr(c.actor, k)),
                when="either set, with rl_config.env_config"),
        Feature("env_eval_data", ("rl_config.eval_data_path",), lambda c: env(c) and bool(c.rl.eval_data_path),
                when="set, with rl_config.env_config"),
        Feature("env_verifiers", tuple(f"rl_config.{k}" for k in RULE_REWARD_KEYS),
                lambda c: env(c) and (any(c.explicitly_set("rl_config", k) for k in RULE_REWARD_KEYS[:-1])
                                      or not c.rl.rule_reward),
                shown=lambda c: ", ".join(f"rl_config.{k}" for k in RULE_REWARD_KEYS[:-1]
                                          if c.explicitly_set("rl_config", k)) or "rl_config.rule_reward: false",
                when="one written, or rule_reward: false, with rl_config.env_config"),
    ]


# the rule verifiers' keys (posttrain.reward.rule_reward), which an environment's reward replaces
RULE_REWARD_KEYS = ("verifier_function", "verifier_weight", "verifier_parallel", "verifier_timeout",
                    "verifier_modules", "overlong_buffer_enable", "overlong_buffer", "overlong_buffer_penalty_factor",
                    "rule_reward")


def _judge_features() -> list[Feature]:
    """rl_config.judge_path (posttrain.config.judge): any judge, and the self-judge."""
    return [_on("rl_config.judge_path", name="judge", when="set"),
            _on("rl_config.judge_path", lambda v: v == "policy", name="self_judge", when="policy (the self-judge)")]


def _turn_credit_estimator_unknown(cfg: RunConfig) -> bool:
    """``turn_credit: turn`` with an ``adv_estimator`` that has no turn-level form."""
    if cfg.rl.turn_credit != "turn":
        return False
    from posttrain.algo.turn_credit import TURN_ESTIMATORS  # lazy: torch, only for turn credit

    return cfg.rl.adv_estimator not in TURN_ESTIMATORS


def _turn_credit_features() -> list[Feature]:
    """rl_config.turn_credit: turn (posttrain.algo.turn_credit), alone and where it has no meaning."""
    shown = "rl_config.turn_credit: turn"
    return [
        _on("rl_config.turn_credit", lambda v: v == "turn", shown=shown, when="turn"),
        Feature("turn_credit_single_turn", ("rl_config.turn_credit",),
                lambda c: c.rl.turn_credit == "turn" and not c.rl.multi_turn_enable, shown=shown,
                when="turn, without multi_turn_enable"),
        Feature("turn_credit_estimator", ("rl_config.turn_credit",), _turn_credit_estimator_unknown,
                shown=lambda c: f"{shown} with adv_estimator: {c.rl.adv_estimator}",
                when="turn, with an adv_estimator other than group_norm / grpo_no_std"),
    ]


def _run_features() -> dict[str, Feature]:
    """Keys of the run itself honoured in some setups only (skip_train, pretrained_checkpoint, refer_model_iter)."""
    features = [
        _on("actor_config.skip_train", when="true"),
        Feature("skip_train_without_eval", ("actor_config.skip_train",),
                lambda c: c.actor.skip_train and not c.rl.eval_data_path, when="true, without rl_config.eval_data_path"),
        Feature("critic_skip_train", ("critic_config.skip_train",), _written("critic_config.skip_train", bool),
                when="written as true"),
        _on("actor_config.refer_model_iter", lambda v: v != 1, when="not 1"),
        _on("actor_config.dpo_loss_type", lambda v: v == "kto", name="kto", when="kto"),
        Feature("critic_pretrained_checkpoint", ("critic_config.pretrained_checkpoint",),
                _written("critic_config.pretrained_checkpoint", bool), when="written"),
    ]
    return {f.name: f for f in features}


def _distill_features() -> list[Feature]:
    """rl_config.teacher_model (on-policy distillation), and its keys written without it."""
    return [
        _on("rl_config.teacher_model", lambda v: v is not None, name="teacher_model", when="set"),
        Feature("distill_without_teacher", ("rl_config.distill_mode", "rl_config.distill_coef"),
                lambda c: c.rl.teacher_model is None and (c.explicitly_set("rl_config", "distill_mode")
                                                          or c.explicitly_set("rl_config", "distill_coef")),
                shown="rl_config.distill_mode / distill_coef", when="written, without teacher_model"),
    ]


FEATURES = {**_features(), **{f.name: f for f in _judge_features()}, **_run_features(),
            **{f.name: f for f in _distill_features()}}
