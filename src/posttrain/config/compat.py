"""The one table of feature combinations: what is refused where, and why.

A run is placed along five dimensions (:class:`Setup`): the training backend (``hf``, ``megatron``;
:mod:`posttrain.config.backend`), the rollout engine (``rl_config.rollout_engine``: ``native``,
``vllm``, or another registered engine), the placement (one process, Ray actor workers with DDP or
with FSDP2), the device (``cpu``, ``cuda``) and the stage (grpo, dapo, ppo, dpo, sft). A
:class:`Feature` is something a config turns on (LoRA, ``async_staleness``, a vLLM key, ...). Each
:class:`Row` of :data:`ROWS` says: this feature, in these values of the dimensions (any value where a
dimension is not given), and with this other feature on too (``with_``), is refused with this message,
or has no effect there (``effect="no effect"``: named in the one start-up warning).

:func:`refusals` evaluates the table for a config; :func:`check_compat` raises one
:class:`~posttrain.errors.ConfigError` with every refusal that applies, one per line; it is part of the
one config check (:func:`posttrain.config.check.check_run_config`). :func:`no_effect` lists the keys of
the rows without effect. :mod:`posttrain.config.reference` renders the table as feature x dimension
cells (``docs/config_reference.md``; :func:`posttrain.config.reference.matrix` takes any columns).

A key refused on its own (whatever else the config holds) carries that rule on its field
(:mod:`posttrain.config.fields`); the seed's rules keep their messages in :mod:`posttrain.config.validate`.
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
from posttrain.errors import ConfigError

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
        _on("rl_config.num_threads", lambda v: v is not None, when="set"),
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
        *_diagnostics(),
        *_truncation_features(),
    ]
    return {f.name: f for f in features}


def _run_features() -> dict[str, Feature]:
    """Keys of the run itself honoured in some setups only (skip_train, pretrained_checkpoint, refer_model_iter)."""
    features = [
        _on("actor_config.skip_train", when="true"),
        Feature("skip_train_without_eval", ("actor_config.skip_train",),
                lambda c: c.actor.skip_train and not c.rl.eval_data_path, when="true, without rl_config.eval_data_path"),
        Feature("critic_skip_train", ("critic_config.skip_train",), _written("critic_config.skip_train", bool),
                when="written as true"),
        _on("actor_config.refer_model_iter", lambda v: v != 1, when="not 1"),
        Feature("critic_pretrained_checkpoint", ("critic_config.pretrained_checkpoint",),
                _written("critic_config.pretrained_checkpoint", bool), when="written"),
    ]
    return {f.name: f for f in features}


FEATURES = {**_features(), **_run_features()}


# ---- the table -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    """``feature`` (with feature ``with_`` on too) where every given dimension holds one of its
    values is refused with ``message`` (or has no effect there). ``message`` is a template: {setting}
    (the feature's ``key=value``), {key}, {other} (the other feature's setting), {other_key},
    {engine}, {stage}, {megatron} (`` (backend megatron: why)``), {tp}, {pp}, {cp}."""

    id: str
    feature: str
    message: str
    backend: tuple[str, ...] | None = None
    engine: tuple[str, ...] | None = None
    placement: tuple[str, ...] | None = None
    device: tuple[str, ...] | None = None
    stage: tuple[str, ...] | None = None
    with_: str | None = None
    effect: str = "refused"

    def __post_init__(self) -> None:
        unknown = [name for name in (self.feature, self.with_) if name is not None and name not in FEATURES]
        unknown += [f"{d}={v}" for d, values in self.where().items() for v in values if v not in DIMENSIONS[d]]
        if unknown or self.effect not in EFFECTS:
            raise ValueError(f"compatibility row {self.id}: unknown {unknown or self.effect}")

    def where(self) -> dict[str, tuple[str, ...]]:
        """The dimensions this row restricts, and the values where it applies."""
        return {d: getattr(self, d) for d in DIMENSIONS if getattr(self, d) is not None}

    def applies(self, cfg: RunConfig, setup: Setup) -> bool:
        if any(setup.value(d) not in values for d, values in self.where().items()):
            return False
        return FEATURES[self.feature].active(cfg) and (self.with_ is None or FEATURES[self.with_].active(cfg))

    def text(self, cfg: RunConfig, setup: Setup) -> str:
        feature, other = FEATURES[self.feature], FEATURES.get(self.with_ or "")
        a = cfg.actor
        return self.message.format(
            setting=feature.setting(cfg), key=feature.label(cfg),
            other=other.setting(cfg) if other else "", other_key=other.label(cfg) if other else "",
            engine=repr(cfg.rl.rollout_engine), stage=setup.stage, megatron=f" (backend megatron: {setup.reason})",
            tp=a.tensor_model_parallel_size, pp=a.pipeline_model_parallel_size, cp=a.context_parallel_size)


MEGATRON = ("megatron",)
_LAYOUT = ("{setting}: colocated roles share the actor's layout on the megatron backend; remove the key or give it "
           "the actor's value{megatron}")
_ROLLOUT_REPLICA = [  # async_staleness and use_integrated_worker: false put the rollout on a replica of the weights
    ("offline", dict(stage=OFFLINE), "{setting} is for the on-policy stages (grpo, dapo, ppo), which roll out; "
                                     "remove it"),
    ("ray", dict(placement=RAY), "{setting} with Ray actor workers is not built yet: the trainer runs in this process "
                                 "(no actor_resource.num_npus > 1, no ray_address)"),
    ("engine", dict(engine=("other",)), "{setting} runs on the native and vLLM rollout engines, not {engine}"),
    ("megatron", dict(backend=MEGATRON), "{setting} runs on the hf training backend (the rollout replica is an HF "
                                         "model)"),
    ("lora", dict(with_="lora"), "{setting} with LoRA is not supported yet (the rollout replica would merge the "
                                 "adapter); remove lora_target_modules or {setting}"),
]
_ASYNC_OWN = {("async", "ray"), ("async", "megatron")}  # built on Ray (no row); megatron: its own row (below)
_SEPARATED = [  # roles in worker groups of their own: where they are built
    ("megatron", dict(backend=MEGATRON), "{setting}: roles in worker groups of their own are built on the hf backend "
                                         "only; remove the resources (the roles stay colocated with the "
                                         "actor){megatron}"),
    ("offline", dict(stage=OFFLINE), "{setting}: roles in worker groups of their own serve the on-policy stages "
                                     "(grpo, dapo, ppo); remove the resources"),
    ("rollout-worker", dict(with_="rollout_worker"), "{setting} with {other}: the rollout worker process beside the "
                                                     "separated roles' groups is not built yet; remove one"),
    ("share-backbone", dict(with_="share_backbone"), "{setting} with {other}: with share_backbone the reference is the "
                                                     "actor's own weights (its adapter off), so it cannot run in a group "
                                                     "of its own; remove one"),
]
_VLLM_KEYS = [  # generate_config keys the vLLM adapter cannot honour (the others are passed: vllm.PASSED)
    ("infer_pipeline_parallel_size", "pipeline-parallel rollout is not built (the vLLM adapter holds the whole model "
                                     "in the trainer's process); set it to 1"),
    ("infer_expert_parallel_size", "vLLM takes no expert-parallel size (its expert parallelism spans the "
                                   "tensor-parallel ranks); set it to 1 and set "
                                   "generate_config.enable_expert_parallel: true instead"),
    ("num_scheduler_steps", "multi-step scheduling was removed in vLLM V1; remove the key or set it to 1"),
    ("torchair_graph", "torchair graph mode is vLLM-Ascend's (Ascend NPUs); the adapter runs vLLM on CUDA; remove the "
                       "key (generate_config.enforce_eager: false captures CUDA graphs)"),
    ("speculation", "the vLLM adapter does not pass speculative decoding to vLLM; set it to 0 (or use rollout_engine: "
                    "native)"),
    ("ascend_scheduler_config_enabled", "the Ascend scheduler is vLLM-Ascend's (Ascend NPUs); the adapter runs vLLM on "
                                        "CUDA, which has no such switch; remove the key"),
]

_SAMPLES_FROM_THEM = ("so they cannot leave the GPU during rollout; set rl_config.rollout_engine: vllm (its own copy "
                      "of the weights) or remove the key")
# where the rollout reads the training weights themselves (or the update runs beside it); on a GPU the native
# engine samples from a bf16 copy of the fp32 weights (the seed's rule 2 keeps generate_config.dtype bfloat16 there),
# and roles/policy.py refuses at start an engine that would not (training/offload.py)
_OFFLOAD_PARAM = [
    ("lora", dict(engine=("native",), backend=("hf",), with_="lora"), " with {other_key}: the native engine samples "
     "from the training weights themselves (the adapter merged into the base in place), " + _SAMPLES_FROM_THEM),
    ("fsdp2", dict(engine=("native",), placement=("ray-fsdp2",)), " with rl_config.ray_sharding: fsdp2: the native "
     "engine samples from the parameters FSDP2 gathers from the training shards, " + _SAMPLES_FROM_THEM),
    ("async", dict(with_="async"), " with {other}: the rollout samples from a replica while the update trains, so the "
     "training weights are never idle during a rollout; remove the key"),
    ("rollout-worker", dict(with_="rollout_worker"), " with {other}: the rollout runs on workers of its own, so the "
     "training weights are never idle during a rollout; remove the key"),
]

_TRUNCATED = [  # rl_config.truncated_sampling_logprobs: where it is built (the hf lm-head path, one process)
    ("offline", "truncated_logprobs", dict(stage=OFFLINE), "{setting}: stage {stage} does not sample; remove the key"),
    ("megatron", "truncated_logprobs", dict(backend=MEGATRON), "{setting}: the megatron backend computes its log-probs "
     "over the vocab-parallel logits, where the truncation is not built; remove the key{megatron}"),
    ("ray", "truncated_logprobs", dict(placement=RAY), "{setting} on Ray actor workers is not built yet (tested in one "
     "process only); remove the key or train in one process"),
    ("engine", "truncated_logprobs", dict(engine=("other",)), "{setting} runs on the native and vLLM rollout engines, "
     "not {engine}"),
    ("share-backbone", "truncated_logprobs", dict(with_="share_backbone"), "{setting} with {other}: the reference runs "
     "through the actor's engine, which would truncate it too (the reference keeps the full distribution); remove "
     "one"),
    ("greedy", "truncated_logprobs_greedy", {}, "{setting}: greedy sampling draws the argmax (log mu = 0); there is "
     "nothing to truncate; remove the key"),
    ("untruncated", "truncated_logprobs_untruncated", {}, "{setting}: the sampling keeps the whole vocabulary (top_k "
     "-1, top_p 1, min_p 0), so the log-probs are the full ones; set top_k or top_p, or remove the key"),
    ("vllm-min-p", "truncated_logprobs_min_p", dict(engine=("vllm",)), "{setting} with rl_config.rollout_engine: "
     "vllm: vLLM applies min_p before top_k/top_p, the trainer after them, so the kept sets could differ; set min_p "
     "to 0 or use rollout_engine: native"),
]

ROWS: tuple[Row, ...] = (
    # the megatron backend: what it runs in, and what is not built on it yet
    Row("megatron-one-process", "megatron", "{setting}: the megatron backend runs in Ray worker groups: set "
        "rl_config.actor_resource.num_npus to TP x PP x CP x DP = {tp}x{pp}x{cp}xDP (>= 2) or use backend hf{megatron}",
        backend=MEGATRON, placement=("process",)),
    Row("megatron-distributed-optimizer-cpu", "use_distributed_optimizer", "{setting}: Megatron-Core's distributed "
        "optimizer needs CUDA buffers; set use_distributed_optimizer false on a CPU{megatron}", backend=MEGATRON,
        device=("cpu",)),
    Row("megatron-bf16-cpu", "bf16", "{setting}: on a CPU the megatron backend trains in float32 (Megatron-Core's bf16 "
        "optimizer with fp32 main parameters takes CUDA tensors only)", backend=MEGATRON, device=("cpu",),
        effect="no effect"),
    Row("megatron-share-prompt-prefix", "share_prompt_prefix", "{setting}: the megatron backend packs every row's "
        "prompt (the numerics are the same; only the packed length differs)", backend=MEGATRON, effect="no effect"),
    *(Row(f"megatron-{name}", name, _LAYOUT, backend=MEGATRON) for name in FEATURES if name.startswith(
        ("ref_config.", "critic_config."))),
    Row("megatron-moe-tp-extend-ep", "moe_tp_extend_ep", "{setting}: experts split over TP x EP ranks "
        "(moe_tp_extend_ep) are not built on the megatron backend yet; set it to false (the experts split over "
        "expert_model_parallel_size ranks){megatron}", backend=MEGATRON),
    Row("megatron-fsdp2", "fsdp2", "{setting}: the megatron backend shards the model by tensor and pipeline "
        "parallelism, not FSDP2; set it to ddp (use_distributed_optimizer shards the optimizer state on "
        "CUDA){megatron}", backend=MEGATRON),
    # LoRA
    Row("lora-critic", "critic_lora", "{setting}: a LoRA critic is not built yet; set the lora_* keys in "
        "actor_config only"),
    Row("shared-backbone-offload-reference", "offload_reference", "{setting} with {other}: the reference is the "
        "actor's own weights (its adapter off), so there is nothing to offload; remove one", with_="share_backbone"),
    Row("shared-backbone-ref-model", "ref_model_load_path", "{setting} with {other}: with share_backbone the "
        "reference is the actor's base weights (its adapter off), so this reference model would never be loaded; "
        "remove one", with_="share_backbone"),
    # the vLLM rollout engine (its machine, the vllm package and a CUDA device: posttrain.config.vllm)
    *(Row(f"vllm-{name}", name, "{setting} with rl_config.rollout_engine: vllm: " + why, engine=("vllm",),
          stage=ON_POLICY) for name, why in _VLLM_KEYS),
    Row("vllm-ray-tensor-parallel", "vllm", "{other} with rl_config.rollout_engine: vllm on Ray actor workers: each "
        "worker runs its own vLLM engine in its process, on the one device it holds, so vLLM has no other devices to "
        "split the model over; set it to 1 (the rollout scales with the workers, actor_resource.num_npus)",
        placement=RAY, backend=("hf",), stage=ON_POLICY, with_="infer_tensor_parallel"),
    # the rollout on a replica of the weights, partial rollout
    *(Row(f"{name}-{suffix}", name, message, **where) for name in ("async", "rollout_worker")
      for suffix, where, message in _ROLLOUT_REPLICA if (name, suffix) not in _ASYNC_OWN),
    # async_staleness on Ray actor workers is built (each worker's rollout copy: the native engine's, or its vLLM
    # engine loaded with the snapshot of the version the pipeline asks for; cluster/rollout_copy.py); on the megatron
    # backend each replica's leader keeps a native rollout copy of its HF model (megatron_worker.py)
    Row("async-megatron", "async", "{setting} with rl_config.rollout_engine: vllm on the megatron backend is not built "
        "yet (the leaders' vLLM engines load the trained weights after every update, not the version the pipeline "
        "asks for); set rollout_engine: native, or use backend hf{megatron}", backend=MEGATRON, engine=("vllm",)),
    Row("partial-engine", "partial", "{setting} runs on the native and vLLM rollout engines, whose generate continues a "
        "response from given offsets; not on {engine}", engine=("other",)),
    Row("partial-dynamic-sampling", "partial", "{setting} with DAPO's dynamic sampling (filter_groups_enable) is not "
        "supported yet; turn one of them off", with_="dynamic_sampling"),
    # the native engine's per-request loop (async_engine, multi-turn) and its batched decode
    Row("async-engine-engine", "async_engine", "{setting} is the native engine's per-request loop here (vLLM admits "
        "each request on its own anyway); it does not exist for rollout_engine {engine}. Set rollout_engine: native or "
        "async_engine: false", engine=("other",)),
    Row("graphs-per-request", "graphs", "{setting} (CUDA graphs) with {other}: the per-request decode loop runs "
        "eagerly (its batch changes every step); remove the key or set it to true", device=("cuda",),
        engine=("native",), with_="per_request"),
    Row("multi-turn-stage", "multi_turn", "{setting} runs with GRPO and DAPO (the seed's recipe is DAPO); PPO's critic "
        "over tool tokens, DPO and SFT are not supported. Use stage grpo or dapo", stage=("ppo", *OFFLINE)),
    Row("multi-turn-engine", "multi_turn", "{setting} runs on the native and vLLM rollout engines; set "
        "rl_config.rollout_engine: native or vllm (not {engine})", engine=("other",)),
    Row("multi-turn-partial", "multi_turn", "{key} with partial_rollout_max_split > 1 is not supported: a conversation "
        "is generated whole within one iteration; set partial_rollout_max_split: 1", with_="partial"),
    Row("speculation-per-request", "speculation", "{key} with {other}: speculation is built into the batched "
        "decode, not the per-request loop; set it to 0", with_="per_request"),
    Row("speculation-graphs", "speculation", "{key} with {other}: CUDA graphs replay one token a row on a static "
        "cache, and speculation feeds several; set one of them back", device=("cuda",), with_="graphs"),
    Row("speculation-partial-ray", "speculation", "{key} with {other} on Ray actor workers: the workers decode "
        "each round a fixed number of tokens per call, while speculation emits several tokens a step, so the rounds "
        "would not end where one process's do; set it to 0 (or run partial rollout in one process)", placement=RAY,
        with_="partial"),
    # generate_config.offload_train_param on a GPU: only where the rollout samples from a copy of the weights
    *(Row(f"offload-param-{suffix}", "offload_param", "{setting}" + message, device=("cuda",), stage=ON_POLICY,
          **where) for suffix, where, message in _OFFLOAD_PARAM),
    # placement and sections
    Row("profiler-ray", "profiler", "{setting} on Ray actor workers is not built yet: the profiler records this "
        "process, and the work runs in the workers; profile in one process (no actor_resource.num_npus > 1, no "
        "ray_address), or with posttrain bench --config-name NAME --profile DIR", placement=RAY),
    Row("msprobe-ray", "msprobe", "{setting} on Ray actor workers is not built yet: the dumps record the tensors of "
        "this process, and the work runs in the workers; dump in one process (no actor_resource.num_npus > 1, no "
        "ray_address)", placement=RAY),
    Row("msprobe-infer-offline", "msprobe_actor_infer", "{setting}: the {stage} loop does not roll out; nothing to "
        "dump", stage=OFFLINE, effect="no effect"),
    Row("msprobe-critic-no-critic", "msprobe_critic_train", "{setting}: the {stage} stage has no critic (PPO's); "
        "nothing to dump", stage=("grpo", "dapo", *OFFLINE), effect="no effect"),
    Row("msprobe-reference-sft", "msprobe_reference", "{setting}: sft has no reference model; nothing to dump",
        stage=("sft",), effect="no effect"),
    Row("msprobe-separated", "msprobe", "{setting} with {other}: the separated roles run in Ray worker groups, whose "
        "tensors the dumps of this process do not see; remove one", with_="separated"),
    Row("msprobe-infer-engine", "msprobe_actor_infer", "{setting} with rl_config.rollout_engine {engine}: the rollout's "
        "modules are dumped on the native engine, which runs the model in this process; set actor_infer_dump: false "
        "or rollout_engine: native", engine=NOT_NATIVE, stage=ON_POLICY),
    Row("msprobe-infer-graphs", "msprobe_actor_infer", "{setting} with {other}: CUDA graphs replay the decode steps "
        "without calling the model's modules, whose hooks the dumps read; set generate_config.enforce_eager: true "
        "while dumping", device=("cuda",), engine=("native",), stage=ON_POLICY, with_="graphs"),
    *(Row(f"msprobe-infer-{name.replace('_', '-')}", "msprobe_actor_infer", "{setting} with {other}: the rollout runs "
          "beside the trainer (a thread or a process of its own, on a copy of the weights), so its model calls are "
          "not this loop's; set actor_infer_dump: false or remove " + "{other_key}", with_=name)
      for name in ("async", "rollout_worker")),
    Row("num-threads-ray", "num_threads", "{setting} sets the threads of one in-process run; the Ray workers take "
        "theirs from rl_config.ray_num_cpus_per_worker: set that instead", placement=RAY),
    Row("dp-batch-balance-one-process", "dp_batch_balance", "{setting}: one process has one data-parallel share, "
        "nothing to balance", placement=("process",), effect="no effect"),
    Row("ref-config", "ref_config", "ref_config configures a reference in a worker group of its own "
        "(rl_config.use_integrated_worker: false with rl_config.reference_resource); without one the reference is a "
        "frozen copy of the actor's initial weights, or rl_config.integrated_mode_config.ref_model_load_path (DPO: "
        "megatron_training.ref_model). Set reference_resource or remove ref_config"),
    # the seed's separated roles (posttrain.config.separated); blocking: false overlaps their passes
    *(Row(f"separated-{suffix}", "separated_reference" if suffix == "share-backbone" else "separated", message,
          **where) for suffix, where, message in _SEPARATED),
    Row("separated-critic-save", "separated_critic_save", "{setting} with rl_config.use_integrated_worker: false: a "
        "critic in a worker group of its own writes checkpoints of its own (the actor's checkpoints hold no critic/); "
        "set critic_config.save to a directory other than the actor's (critic_config.load resumes it)"),
    Row("blocking-integrated", "blocking_integrated", "{setting} overlaps the passes of roles in worker groups of "
        "their own (rl_config.use_integrated_worker: false with reference_resource or reward_resource); here every "
        "role shares the actor's workers, which run one call at a time, so there is nothing to overlap. Remove the "
        "key or set it to true"),
    # rl_config.data_strategy: tq (posttrain.cluster.transfer_queue)
    Row("transfer-queue-offline", "transfer_queue", "{setting}: stage {stage} has no experience table (DPO and SFT "
        "read their batches from the dataset); remove the key or set it to td", stage=OFFLINE),
    Row("transfer-queue-partial", "transfer_queue", "{setting} with {other}: the pool of unfinished samples is a "
        "TransferDock in the driver, not built on TransferQueue; set data_strategy: td or partial_rollout_max_split: 1",
        with_="partial"),
    Row("transfer-queue-shards", "queue_shards", "{setting}: only data_strategy: tq has storage units to shard; "
        "set rl_config.data_strategy: tq or remove the key"),
    # megatron_training.skip_train: the loaded model's held-out evaluation, nothing else
    Row("skip-train-offline", "skip_train", "{setting}: stage {stage} has no held-out evaluation, so a run without "
        "training would do nothing; remove the key (posttrain eval scores a model on prompts)", stage=OFFLINE),
    Row("skip-train-without-eval", "skip_train_without_eval", "{setting}: a run without training only evaluates the "
        "loaded model on rl_config.eval_data_path, which is not set; set it, or remove skip_train", stage=ON_POLICY),
    Row("skip-train-critic", "critic_skip_train", "{setting}: skip_train is the run's key (megatron_training or "
        "actor_config), not the critic's; remove it from critic_config"),
    Row("pretrained-checkpoint-critic", "critic_pretrained_checkpoint", "{setting}: pretrained_checkpoint is the "
        "actor's key (megatron_training or actor_config); the critic starts from critic_config.load or the actor's "
        "initial weights: set critic_config.load (with finetune: true for the weights only)"),
    Row("refer-model-iter-not-dpo", "refer_model_iter", "{setting} picks the iteration of DPO's ref_model, which the "
        "other stages do not read (an on-policy reference is rl_config.integrated_mode_config.ref_model_load_path or "
        "the initial weights; SFT has none); remove the key", stage=("grpo", "dapo", "ppo", "sft")),
    *(Row(f"truncated-logprobs-{suffix}", feature, message, **where) for suffix, feature, where, message in _TRUNCATED),
    Row("reward-model-offline", "reward_model", "reward_config: stage {stage} scores no responses (a reward model is "
        "read by the on-policy stages ray_grpo, ray_dapo and ray_ppo); remove reward_config", stage=OFFLINE),
)
ROW_IDS = {row.id: row for row in ROWS}


# ---- evaluation -------------------------------------------------------------------------------------
def refusals(cfg: RunConfig, setup: Setup) -> list[str]:
    """The message of every refusing row that applies to ``cfg`` in ``setup``, in table order."""
    return [row.text(cfg, setup) for row in ROWS if row.effect == "refused" and row.applies(cfg, setup)]


def check_compat(cfg: RunConfig, setup: Setup) -> None:
    """Raise one :class:`ConfigError` naming every refused combination, one per line."""
    lines = refusals(cfg, setup)
    if lines:
        raise ConfigError("\n".join(lines))


def no_effect(cfg: RunConfig, setup: Setup) -> list[str]:
    """The keys of the rows without effect that apply (for the one start-up warning)."""
    return [FEATURES[row.feature].label(cfg) for row in ROWS if row.effect == "no effect" and row.applies(cfg, setup)]


def rows_of(key: str) -> list[Row]:
    """The rows whose feature (or other feature) is turned on by ``key`` (``section.key``)."""
    return [row for row in ROWS if key in FEATURES[row.feature].keys
            or (row.with_ is not None and key in FEATURES[row.with_].keys)]
