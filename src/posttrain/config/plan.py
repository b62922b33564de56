"""The plan: every value a run derives from its config, computed once, frozen, read by the run.

:func:`resolve_plan` runs the one config check (:func:`posttrain.config.check.check_run_config`)
and derives the training backend and its parallel layout (``parallel``, :mod:`posttrain.config.backend`),
the batch arithmetic, the dispatch sizes, the optimizer step counts, the precision,
the loss and engine options and a memory estimate of the layout that will actually run.
``posttrain plan`` prints it; ``posttrain train`` builds the run from it. The config the user
wrote is never written to.

Vocabulary (as the seed): ``global_batch_size`` (gbs) and ``mini_batch_size`` count prompts;
``micro_batch_size`` counts sequences (responses); ``n`` is ``n_samples_per_prompt``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping

from posttrain.algo.truncation import Truncation
from posttrain.config import options
from posttrain.config.multimodal import MultimodalOptions, multimodal_options
from posttrain.config.arch import model_arch
from posttrain.config.backend import ModelParallel, model_parallel
from posttrain.config.check import Refusals, check_device, collect_checks, uses_ray
from posttrain.config.distill import DistillOptions, distill_options
from posttrain.config.files import check_run_files
from posttrain.config.memory import GIB, MemoryEstimate, check_memory, estimate_memory
from posttrain.config.options import (AdvantageOptions, ClusterOptions, CriticOptions, DataOptions, DPOOptions,
                                      DynamicSamplingOptions, KLOptions, LoggingOptions, OffPolicyOptions,
                                      PolicyOptions, RolloutOptions, ScheduleOptions, UpdateOptions)
from posttrain.config.judge import JudgeOptions, judge_options
from posttrain.config.reward_model import RewardModelOptions, reward_model_options
from posttrain.config.run import RunConfig
from posttrain.config.sections import QUEUE_STRATEGIES
from posttrain.config.separated import SeparatedRoles, rollout_worker, separated_options
from posttrain.config.stages import Stage, stage_named
from posttrain.config.target import Target, check_device_count, check_device_setting
from posttrain.config.validate import DeviceLayout
from posttrain.device import device_type, precision, resolve_device
from posttrain.errors import ConfigError
from posttrain.models.arch import ModelArch
from posttrain.reward.rule_reward import RuleRewardOptions
from posttrain.training.options import ActorLossOptions, EngineOptions, TokenBudget
from posttrain.metrics.dumps import DumpOptions
from posttrain.metrics.profiler import ProfilerOptions

__all__ = ["GIB", "Plan", "build_plan", "model_arch", "resolve_plan"]
# the seed's dispatch sizes are rows per data-parallel rank; the driver reads them for all DP ranks
# (hf: every worker; megatron: workers // (TP x PP x CP)); the critic is colocated with the actor
ACTOR_DISPATCH_KEYS = ("actor_rollout_dispatch_size", "actor_logprob_dispatch_size", "ref_dispatch_size",
                       "actor_update_dispatch_size", "critic_update_dispatch_size", "critic_value_dispatch_size")
PHASES = ("ref", "actor", "update")  # token-budget phases of use_dynamic_bsz


@dataclass(frozen=True)
class Plan:
    """Every value a run reads, derived once from its config (the module docstring)."""

    # what runs, where, in which precision
    stage: Stage
    layout: DeviceLayout
    device: str
    train_dtype: str
    rollout_dtype: str
    use_ray: bool
    workers: int  # actor worker processes (1 in process)
    sharding: str  # ddp or fsdp2 (several workers)
    # the batch arithmetic (prompts, rows, steps)
    n: int
    prompts_per_iteration: int
    responses_per_iteration: int
    prompts_per_update: int  # DAPO with dynamic sampling: filter_groups_train_batch_size
    rows_per_update: int
    mini_batch_rows: int
    mini_batches_per_iteration: int
    optimizer_steps_per_iteration: int
    total_optimizer_steps: int  # the LR schedule's length
    responses_per_mini_batch_per_dp: int
    micro_batch_size: int
    grad_accumulation_steps: int
    max_prompt_length: int
    max_response_tokens: int
    max_tokens_per_sequence: int
    max_tokens_per_iteration: int
    train_iters: int
    dispatch_sizes: Mapping[str, int]  # the seed's meaning: rows per data-parallel rank
    reads: Mapping[str, int]  # rows the driver reads per call (dispatch size x parallel.dp for actor roles)
    logprob_temperature: float  # the sampling temperature, 0 (greedy) meaning 1
    uses_reference: bool
    uses_critic: bool
    skip_old_logprobs: bool  # the seed's on-policy skip: one mini-batch, one epoch, no KL in reward
    guarantee_order: bool  # rl_config.guarantee_order: the TransferDock hands out rows in order
    # the components' options (posttrain.config.options, posttrain.training.options)
    actor_loss: ActorLossOptions  # the actor loss's hyperparameters (on-policy stages; defaults otherwise)
    actor_engine: EngineOptions
    ref_engine: EngineOptions
    policy: PolicyOptions
    data: DataOptions
    schedule: ScheduleOptions
    logging: LoggingOptions
    update: UpdateOptions
    kl: KLOptions = KLOptions()
    advantages: AdvantageOptions = AdvantageOptions()
    off_policy: OffPolicyOptions = OffPolicyOptions()
    rollout: RolloutOptions | None = None  # on-policy stages
    rule_reward: RuleRewardOptions | None = None  # the verifiers: training scores and/or held-out accuracy
    scores_by_rules: bool = True  # rl_config.rule_reward: the training scores include the verifiers'
    dynamic_sampling: DynamicSamplingOptions | None = None  # DAPO's filter_groups_enable
    critic: CriticOptions | None = None  # PPO
    dpo: DPOOptions | None = None
    cluster: ClusterOptions = ClusterOptions()
    # rl_config.data_strategy: "td" keeps the dock's cells in the driver, "tq" in TransferQueue's storage
    # units (posttrain.cluster.transfer_queue), transfer_queue_data_shard_num of them
    data_strategy: str = "td"
    queue_shards: int = 1
    profiler: ProfilerOptions | None = None  # profiler_config.integrated (posttrain.metrics.profiler)
    dumps: DumpOptions | None = None  # msprobe_config (posttrain.metrics.dumps)
    config_json: str = "{}"  # the config as written to the run's config.json
    offload_optimizer: bool = False  # the optimizer state on the host between updates (GPU only; actor, critic)
    offload_grads: bool = False  # the gradients freed between updates (actor, critic)
    multi_turn: str = ""  # multi_turn_enable: the tools and limits, in words (posttrain plan prints it)
    off_policy_rollout: str = ""  # async_staleness, separated rollout, partial rollout: in words (docs/async.md)
    warnings: tuple[str, ...] = ()
    arch: ModelArch | None = None
    num_params: int | None = None
    memory: MemoryEstimate | None = field(default=None)
    reward_model: RewardModelOptions | None = None  # reward_config's model, scoring in the loop
    judge: JudgeOptions | None = None  # rl_config.judge_path's LLM-as-judge, scoring in the loop
    parallel: ModelParallel = ModelParallel()  # the training backend and the actor's TP/PP/DP layout
    target: Target | None = None  # posttrain plan --target: the hardware planned for (None: this machine)
    separated: SeparatedRoles = field(default_factory=SeparatedRoles)  # roles in Ray worker groups of their own (use_integrated_worker)
    multimodal: MultimodalOptions | None = None  # rl_config.is_multimodal (docs/multimodal.md)
    distill: DistillOptions | None = None  # rl_config.teacher_model: on-policy distillation (posttrain.algo.distill)

    @property
    def name(self) -> str:
        return self.stage.name

    @property
    def frozen_dtype(self) -> str:
        """The storage dtype of the weights that never train (the reference, a LoRA base, the
        megatron leader's rollout copy takes ``rollout_dtype``): the training dtype, so bf16 where
        the device computes it natively and the config trains in bf16. Half the bytes of fp32, and
        the same numbers the bf16 autocast computes from fp32 weights up to one rounding of each
        weight; trained weights stay fp32, their own master copy for AdamW."""
        return self.train_dtype

    @property
    def lora(self) -> bool:
        """The actor trains a LoRA adapter (``lora_target_modules``)."""
        return self.policy.lora is not None


def _multi_turn_line(cfg: RunConfig) -> str:
    rl = cfg.rl
    if not rl.multi_turn_enable:
        return ""
    return (f"tools of {rl.tool_config_path}; at most {rl.max_tool_calls} calls per sample "
            f"({rl.max_parallel_calls or 'all'} per turn), {cfg.generate.sampling_config.max_tokens} tokens per turn, "
            f"{rl.max_total_response_length} per response")


def _off_policy_line(cfg: RunConfig) -> str:
    """Where the rollout runs and with which weights, when that is not the synchronous default."""
    rl = cfg.rl
    parts = []
    worker = rollout_worker(cfg)
    if rl.async_staleness is not None or worker:
        where = "a Ray rollout worker process" if worker else "a rollout thread on a weight copy"
        k = rl.async_staleness or 0
        parts.append(f"{where}; iteration i samples with the weights of iteration max(0, i - 1 - {k})")
    if rl.partial_rollout_max_split > 1:
        max_tokens = cfg.generate.sampling_config.max_tokens
        parts.append(f"partial rollout: rounds of {max(1, max_tokens // rl.partial_rollout_max_split)} tokens, "
                     f"a sample waits at most {rl.partial_rollout_max_split - 1} iterations")
    if rl.rollout_correction != "none":
        parts.append(f"{rl.rollout_correction} correction, C = {rl.rollout_correction_cap}")
    return "; ".join(parts)


def resolve_plan(cfg: RunConfig, arch: ModelArch | None = None, *, device: str | None = None,
                 files: bool = False, target: Target | None = None) -> Plan:
    """Check ``cfg`` (the one check of ``plan`` and ``train``) and derive its plan. With ``files``
    (the commands ``plan``, ``train`` and ``bench``), also what is on disk, as ``train`` finds it at
    start-up (:func:`posttrain.config.files.check_run_files`).

    ``arch`` defaults to :func:`model_arch` (the model yaml keys, else the ``config.json`` of
    ``load`` / ``tokenizer_name_or_path``); with one, the plan carries a memory estimate, which
    :func:`check_memory` compares with this machine's memory. ``device`` defaults to
    ``rl_config.device`` (checked by :func:`~posttrain.config.check.check_device`). ``target``
    (``posttrain plan --target``, :mod:`posttrain.config.target`): plan for that hardware instead of
    this machine's (its device type, precision, device count and memory per device).

    Every refusal is reported at once, in one ConfigError (one per line): the config checks
    (:func:`~posttrain.config.check.collect_checks`), then, when the seed's rules let the plan be
    derived, the device count of a target and the memory estimate."""
    refusals = Refusals()
    if target is not None:
        refusals.run(check_device_setting, cfg, target)
        device = target.device
    elif device is None:
        check_device(cfg.rl.device)
        device = resolve_device(cfg.rl.device)
    if arch is None:  # a model yaml's key the model built cannot carry is one of the refusals
        arch = refusals.run(model_arch, cfg)
    layout, warnings = collect_checks(cfg, refusals, device_type=device_type(device), arch=arch,
                                      num_nodes=target.nodes or 1 if target is not None else 1,
                                      here=target is None)
    if layout is None:
        refusals.raise_any()
    if target is not None:
        refusals.run(check_device_count, cfg, target, layout)
    plan = refusals.run(build_plan, cfg, layout, arch, device=device, warnings=tuple(warnings), target=target)
    extra = refusals.run(check_memory, cfg, plan, default=[]) if plan is not None else []
    refusals.raise_any()
    if files:
        check_run_files(plan)
    return _replace(plan, warnings=plan.warnings + tuple(extra)) if extra else plan


def build_plan(cfg: RunConfig, layout: DeviceLayout, arch: ModelArch | None = None, *, device: str = "cpu",
               warnings: tuple[str, ...] = (), target: Target | None = None) -> Plan:
    """The derivation alone (``resolve_plan`` checks first). ``target``: the precision is the target
    hardware's (:func:`posttrain.device.precision` with ``native_bf16``), not this machine's."""
    stage = stage_named(cfg.actor.stage or cfg.actor.algorithm)
    a, rl, gen = cfg.actor, cfg.rl, cfg.generate
    on_policy = stage.on_policy
    n, gbs = (rl.n_samples_per_prompt if on_policy else 1), a.global_batch_size
    mini = rl.mini_batch_size if on_policy else gbs
    epochs = rl.epochs if on_policy else 1
    dynamic = stage.dynamic_sampling(cfg)
    update_prompts = rl.filter_groups_train_batch_size if dynamic else gbs
    mini_batches = update_prompts // mini
    per_dp = mini * n // layout.actor_dp
    max_resp = gen.sampling_config.max_tokens if on_policy else 0
    if on_policy and rl.multi_turn_enable:  # a conversation: every turn and tool output together
        max_resp = rl.max_total_response_length
    max_prompt = rl.max_prompt_length - 1 if on_policy else a.seq_length
    per_seq = min(a.seq_length, max_prompt + max_resp) if max_resp else a.seq_length
    ray = uses_ray(cfg)
    workers = (rl.actor_resource.num_npus or 1) if ray else 1
    parallel = model_parallel(cfg)
    hf = parallel.backend == "hf"
    reads = {k: v * parallel.dp if k in ACTOR_DISPATCH_KEYS else v for k, v in layout.dispatch_sizes.items()}
    train_dtype, rollout_dtype = precision(  # megatron on a CPU trains in float32 (backend.py)
        device, bf16=bool(a.bf16) and (hf or device.startswith("cuda")), rollout_dtype=gen.dtype,
        native_bf16=target.bf16 if target is not None else None)
    temperature = gen.sampling_config.temperature or 1.0
    budgets = token_budgets(cfg)
    engine = EngineOptions(use_remove_padding=rl.use_remove_padding, share_prompt_prefix=rl.share_prompt_prefix,
                           compile_regions=rl.compile_regions, compile_updates=max(1, a.train_iters or 1),
                           update_budget=budgets["update"] if budgets else None,
                           loss_mask_key="chosen_response_mask" if stage.name == "dpo" and a.dpo_loss_type != "kto"
                           else "response_mask")  # KTO's rows are plain rows
    steps_per_iteration = mini_batches * epochs
    max_num_seqs = gen.max_num_seqs if cfg.explicitly_set("generate_config", "max_num_seqs") else 256
    off = options.off_policy_options(cfg) if on_policy else OffPolicyOptions()
    scored = on_policy and (rl.rule_reward or rl.eval_data_path)  # training scores, held-out accuracy
    plan = Plan(
        stage=stage, layout=layout, device=device, train_dtype=train_dtype, rollout_dtype=rollout_dtype,
        use_ray=ray, workers=workers, sharding=rl.ray_sharding, n=n,
        prompts_per_iteration=gbs, responses_per_iteration=gbs * n, prompts_per_update=update_prompts,
        rows_per_update=update_prompts * n, mini_batch_rows=mini * n,
        mini_batches_per_iteration=mini_batches, optimizer_steps_per_iteration=steps_per_iteration,
        total_optimizer_steps=max(steps_per_iteration * (a.train_iters or 0), 1),
        responses_per_mini_batch_per_dp=per_dp, micro_batch_size=a.micro_batch_size,
        grad_accumulation_steps=per_dp // a.micro_batch_size,
        max_prompt_length=max_prompt, max_response_tokens=max_resp, max_tokens_per_sequence=per_seq,
        max_tokens_per_iteration=gbs * n * per_seq, train_iters=a.train_iters or 0,
        dispatch_sizes=MappingProxyType(dict(layout.dispatch_sizes)), reads=MappingProxyType(reads),
        logprob_temperature=temperature, uses_reference=stage.uses_reference(cfg), uses_critic=stage.uses_critic,
        skip_old_logprobs=on_policy and mini == update_prompts and epochs == 1 and not rl.use_kl_in_reward
        and not off.any, guarantee_order=bool(rl.guarantee_order),
        data_strategy="tq" if rl.data_strategy in QUEUE_STRATEGIES else "td", queue_shards=rl.transfer_queue_data_shard_num,
        actor_loss=actor_loss_options(cfg, stage, temperature) if on_policy else ActorLossOptions(),
        actor_engine=_with_forward(engine, budgets, "actor", sampling_truncation(cfg)),
        ref_engine=_with_forward(engine, budgets, "ref"),
        policy=options.policy_options(cfg), data=options.data_options(cfg), schedule=options.schedule_options(cfg),
        logging=options.logging_options(cfg), update=options.update_options(cfg, on_policy=on_policy),
        kl=options.kl_options(cfg), advantages=options.advantage_options(cfg), off_policy=off,
        rollout=options.rollout_options(cfg, dtype=rollout_dtype, max_num_seqs=max_num_seqs,
                                        tools=options.tool_options(cfg)) if on_policy else None,
        rule_reward=options.rule_reward_options(cfg) if scored else None, scores_by_rules=bool(rl.rule_reward),
        dynamic_sampling=options.dynamic_sampling_options(cfg) if dynamic else None,
        critic=options.critic_options(cfg) if stage.uses_critic else None,
        dpo=options.dpo_options(cfg) if stage.name == "dpo" else None,
        cluster=options.cluster_options(cfg) if ray or off.separate_worker else ClusterOptions(),
        config_json=options.resolved_config_json(cfg), distill=distill_options(cfg) if on_policy else None,
        profiler=options.profiler_options(cfg, options.schedule_options(cfg).run_dir),
        dumps=options.dump_options(cfg), judge=judge_options(cfg, rollout_dtype, on_policy=on_policy),
        offload_optimizer=on_policy and gen.offload_train_optimizer and not device.startswith("cpu"),
        offload_grads=on_policy and gen.offload_train_grad,
        warnings=warnings, arch=arch, reward_model=reward_model_options(cfg, device, on_policy=on_policy),
        parallel=parallel, multi_turn=_multi_turn_line(cfg) if on_policy else "",
        off_policy_rollout=_off_policy_line(cfg) if on_policy else "", target=target,
        separated=separated_options(cfg) if on_policy else SeparatedRoles(), multimodal=multimodal_options(cfg, reads),
    )
    if arch is not None:
        plan = _replace(plan, num_params=arch.num_params(), memory=estimate_memory(cfg, plan, arch))
    return plan


def _replace(plan: Plan, **changes) -> Plan:
    return replace(plan, **changes)


def _with_forward(engine: EngineOptions, budgets: dict[str, TokenBudget] | None, phase: str,
                  truncation: Truncation | None = None) -> EngineOptions:
    """The phase's engine options: its token budget, and for the actor the sampling truncation of
    its log-probs (the reference keeps the full distribution)."""
    return replace(engine, forward_budget=budgets[phase] if budgets else None, truncation=truncation)


def actor_loss_options(cfg: RunConfig, stage: Stage, temperature: float) -> ActorLossOptions:
    """The actor loss's hyperparameters (the ``kl_coef`` comes from the KL controller each iteration),
    with the clip bounds resolved once: clip-higher (DAPO, Yu et al. 2025) when enabled, else the
    symmetric ``clip_ratio``."""
    rl = cfg.rl
    low, high = (rl.clip_ratio_low, rl.clip_ratio_high) if rl.clip_higher_enable else (rl.clip_ratio, rl.clip_ratio)
    agg = rl.loss_agg_mode or stage.default_loss_agg_mode(cfg)
    return ActorLossOptions(
        policy_loss=rl.policy_loss, clip_low=low, clip_high=high, clip_ratio_c=rl.clip_ratio_c,
        policy_params=(("tau_pos", rl.sapo_tau_pos or 1.0), ("tau_neg", rl.sapo_tau_neg or 1.05))
        if rl.policy_loss == "sapo" else (),
        entropy_coeff=rl.entropy_coeff, kl_penalty=rl.kl_penalty, loss_agg_mode=agg,
        norm_length=float(cfg.generate.sampling_config.max_tokens) if agg == "seq-mean-token-sum-norm" else None,
        temperature=temperature, truncation=sampling_truncation(cfg))  # norm_length: Dr. GRPO's constant


def sampling_truncation(cfg: RunConfig) -> Truncation | None:
    """The truncation the actor's log-probs are taken under (``rl_config.truncated_sampling_logprobs``;
    the reference keeps the full distribution), or None."""
    if not (cfg.rl.truncated_sampling_logprobs and cfg.stage in ("grpo", "dapo", "ppo")):
        return None
    s = cfg.generate.sampling_config
    return Truncation(top_k=s.top_k, top_p=s.top_p, min_p=s.min_p)


def token_budgets(cfg: RunConfig) -> dict[str, TokenBudget] | None:
    """Per-phase token budgets (``ref``, ``actor`` (old log-probs), ``update``) of ``use_dynamic_bsz``,
    or None when it is off. As in the seed, ``max_packing_token_size`` / ``dynamic_max_batch_size``
    are the defaults of the per-phase keys that the config does not set."""
    rl = cfg.rl
    if not rl.use_dynamic_bsz:
        return None
    out = {}
    for phase in PHASES:
        key = f"{phase}_max_packing_token_size"
        tokens = getattr(rl, key) if cfg.explicitly_set("rl_config", key) else rl.max_packing_token_size
        rows = getattr(rl, f"{phase}_dynamic_max_batch_size") or rl.dynamic_max_batch_size
        if tokens < 1 or (rows is not None and rows < 1):
            raise ConfigError(f"rl_config.{phase}_max_packing_token_size / {phase}_dynamic_max_batch_size must be "
                              f">= 1; got {tokens} / {rows}")
        out[phase] = TokenBudget(int(tokens), rows)
    return out
