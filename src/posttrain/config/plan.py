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

import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from posttrain.config.arch import model_arch
from posttrain.config.backend import ModelParallel, model_parallel
from posttrain.config.check import check_device, check_run_config, uses_ray
from posttrain.config.reward_model import RewardModelOptions, reward_model_arch, reward_model_options
from posttrain.config.run import RunConfig
from posttrain.config.stages import Stage, stage_named
from posttrain.config.validate import DeviceLayout
from posttrain.models.arch import ModelArch
from posttrain.train.options import ActorLossOptions, EngineOptions, TokenBudget

GIB = 1024**3
# the seed's dispatch sizes are rows per data-parallel rank; the driver reads them for all DP ranks
# (hf: every worker; megatron: workers // (TP x PP x CP)); the critic is colocated with the actor
ACTOR_DISPATCH_KEYS = ("actor_rollout_dispatch_size", "actor_logprob_dispatch_size", "ref_dispatch_size",
                       "actor_update_dispatch_size", "critic_update_dispatch_size", "critic_value_dispatch_size")
PHASES = ("ref", "actor", "update")  # token-budget phases of use_dynamic_bsz


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per worker process. Formulas in :func:`estimate_memory`."""

    weights: float
    gradients: float
    optimizer: float
    reference: float
    critic: float
    activations: float
    kv_cache: float
    reward_model: float = 0.0  # the frozen reward model of reward_config (0 when none, or its size is unknown)
    rollout_copy: float = 0.0  # megatron: the whole model in HF layout for the native rollout (replica leaders)

    @property
    def total(self) -> float:
        return (self.weights + self.gradients + self.optimizer + self.reference + self.critic
                + self.activations + self.kv_cache + self.reward_model + self.rollout_copy)


@dataclass(frozen=True)
class Plan:
    stage: Stage
    layout: DeviceLayout
    device: str
    train_dtype: str
    rollout_dtype: str
    cpu_linear: str  # the fp32 nn.Linear kernel on a CPU: blas or onednn (posttrain.models.cpu_linear)
    use_ray: bool
    workers: int  # actor worker processes (1 in process)
    sharding: str  # ddp or fsdp2 (several workers)
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
    dynamic_sampling: bool
    skip_old_logprobs: bool  # the seed's on-policy skip: one mini-batch, one epoch, no KL in reward
    actor_loss: ActorLossOptions  # the actor loss's hyperparameters (on-policy stages; defaults otherwise)
    actor_engine: EngineOptions
    ref_engine: EngineOptions
    max_num_seqs: int  # rows the rollout engine decodes at once
    offload_optimizer: bool = False  # the optimizer state on the host between updates (GPU only; actor, critic)
    offload_grads: bool = False  # the gradients freed between updates (actor, critic)
    lora: bool = False  # the actor trains a LoRA adapter (lora_target_modules; hf backend)
    multi_turn: str = ""  # multi_turn_enable: the tools and limits, in words (posttrain plan prints it)
    off_policy_rollout: str = ""  # async_staleness, separated rollout, partial rollout: in words (docs/async.md)
    warnings: tuple[str, ...] = ()
    arch: ModelArch | None = None
    num_params: int | None = None
    memory: MemoryEstimate | None = field(default=None)
    reward_model: RewardModelOptions | None = None  # reward_config's model, scoring in the loop
    parallel: ModelParallel = ModelParallel()  # the training backend and the actor's TP/PP/DP layout

    @property
    def name(self) -> str:
        return self.stage.name


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
    if rl.async_staleness is not None or not rl.use_integrated_worker:
        where = "a Ray rollout worker process" if not rl.use_integrated_worker else "a rollout thread on a weight copy"
        k = rl.async_staleness or 0
        parts.append(f"{where}; iteration i samples with the weights of iteration max(0, i - 1 - {k})")
    if rl.partial_rollout_max_split > 1:
        max_tokens = cfg.generate.sampling_config.max_tokens
        parts.append(f"partial rollout: rounds of {max(1, max_tokens // rl.partial_rollout_max_split)} tokens, "
                     f"a sample waits at most {rl.partial_rollout_max_split - 1} iterations")
    if rl.rollout_correction != "none":
        parts.append(f"{rl.rollout_correction} correction, C = {rl.rollout_correction_cap}")
    return "; ".join(parts)


def resolve_plan(cfg: RunConfig, arch: ModelArch | None = None, *, device: str | None = None) -> Plan:
    """Check ``cfg`` (the one check of ``plan`` and ``train``) and derive its plan.

    ``arch`` defaults to :func:`model_arch` (the model yaml keys, else the ``config.json`` of
    ``load`` / ``tokenizer_name_or_path``); with one, the plan carries a memory estimate, which
    :func:`check_memory` compares with this machine's memory. ``device`` defaults to
    ``rl_config.device`` (checked by :func:`~posttrain.config.check.check_device`)."""
    from posttrain.device import device_type, resolve_device

    if device is None:
        check_device(cfg.rl.device)
        device = resolve_device(cfg.rl.device)
    if arch is None:
        arch = model_arch(cfg)
    layout, warnings = check_run_config(cfg, device_type=device_type(device), arch=arch)
    plan = build_plan(cfg, layout, arch, device=device, warnings=tuple(warnings))
    extra = check_memory(cfg, plan)
    return _replace(plan, warnings=plan.warnings + tuple(extra)) if extra else plan


def machine_memory_bytes() -> int | None:
    """This machine's memory (MemTotal of /proc/meminfo), or None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_memory(cfg: RunConfig, plan: Plan) -> list[str]:
    """Compare the memory estimate with this machine's memory when the run executes here (on the
    CPU, workers not sent to a Ray cluster): above it, a warning; above twice it, a ConfigError
    unless ``rl_config.ignore_memory_estimate``."""
    from posttrain.errors import ConfigError

    if not cfg.rl.ignore_memory_estimate:
        check_rollout_fits(plan)
    if plan.memory is None or not plan.device.startswith("cpu"):
        return []
    if plan.use_ray and (cfg.rl.ray_address or os.environ.get("RAY_ADDRESS")):
        return []  # the workers run on the cluster's nodes
    ram = machine_memory_bytes()
    if not ram:
        return []
    need = plan.memory.total * plan.workers
    if need <= ram:
        return []
    what = (f"the plan's memory estimate, {need / GIB:,.2f} GiB ({plan.workers} process(es) x "
            f"{plan.memory.total / GIB:,.2f} GiB), is {need / ram:,.1f}x this machine's memory ({ram / GIB:,.2f} "
            f"GiB, MemTotal in /proc/meminfo)")
    fix = ("lower actor_config.micro_batch_size, rl_config.n_samples_per_prompt, generate_config.max_num_seqs or "
           "generate_config.sampling_config.max_tokens (posttrain plan prints the estimate's parts)")
    if need > 2 * ram and not cfg.rl.ignore_memory_estimate:
        raise ConfigError(f"{what}: the run would be killed or swap for hours. To fit, {fix}; or set "
                          f"rl_config.ignore_memory_estimate: true to run anyway")
    return [f"{what}: the run may be killed or swap. To fit, {fix}"]


def device_memory_bytes(device: str) -> int | None:
    """The memory of one device of this run as seen here: the GPU's (when CUDA is visible in this
    process), the machine's on a CPU; None when unknown (e.g. the GPUs are on the Ray cluster)."""
    if device.startswith("cpu"):
        return machine_memory_bytes()
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    return None


def check_rollout_fits(plan: Plan) -> None:
    """The megatron backend's native rollout holds the whole model in one process: refuse a model
    whose HF copy alone does not fit one device (it needs a rollout engine sharded over devices)."""
    from posttrain.errors import ConfigError

    if plan.memory is None or not plan.memory.rollout_copy or plan.parallel.backend != "megatron":
        return
    available = device_memory_bytes(plan.device)
    if available and plan.memory.rollout_copy > available:
        raise ConfigError(
            f"the native rollout samples from a whole copy of the model in one process (the first rank of each "
            f"data-parallel replica): {plan.memory.rollout_copy / GIB:,.1f} GiB of weights do not fit one device "
            f"({available / GIB:,.1f} GiB). A model larger than one device needs a rollout engine sharded over "
            f"devices (vLLM with generate_config.infer_tensor_parallel_size), which posttrain does not have yet; "
            f"train a smaller model, or use backend megatron for an offline stage (sft, dpo), or set "
            f"rl_config.ignore_memory_estimate: true to run anyway")


def build_plan(cfg: RunConfig, layout: DeviceLayout, arch: ModelArch | None = None, *, device: str = "cpu",
               warnings: tuple[str, ...] = ()) -> Plan:
    """The derivation alone (``resolve_plan`` checks first)."""
    from posttrain.device import precision
    from posttrain.models.cpu_linear import resolve_cpu_linear

    stage = stage_named(cfg.actor.stage or cfg.actor.algorithm)
    a, rl, gen = cfg.actor, cfg.rl, cfg.generate
    on_policy = stage.on_policy
    n = rl.n_samples_per_prompt if on_policy else 1
    gbs = a.global_batch_size
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
        device, bf16=bool(a.bf16) and (hf or device.startswith("cuda")), rollout_dtype=gen.dtype)
    temperature = gen.sampling_config.temperature or 1.0
    budgets = token_budgets(cfg)
    engine = EngineOptions(use_remove_padding=rl.use_remove_padding, share_prompt_prefix=rl.share_prompt_prefix,
                           update_budget=budgets["update"] if budgets else None,
                           loss_mask_key="chosen_response_mask" if stage.name == "dpo" else "response_mask")
    steps_per_iteration = mini_batches * epochs
    plan = Plan(
        stage=stage, layout=layout, device=device, train_dtype=train_dtype, rollout_dtype=rollout_dtype,
        cpu_linear=resolve_cpu_linear(device),
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
        logprob_temperature=temperature,
        uses_reference=stage.uses_reference(cfg), uses_critic=stage.uses_critic, lora=bool(a.lora_target_modules),
        dynamic_sampling=dynamic,
        skip_old_logprobs=on_policy and mini == update_prompts and epochs == 1 and not rl.use_kl_in_reward
        and not off_policy(cfg),
        actor_loss=actor_loss_options(cfg, stage, temperature) if on_policy else ActorLossOptions(),
        actor_engine=_with_forward(engine, budgets, "actor"), ref_engine=_with_forward(engine, budgets, "ref"),
        max_num_seqs=gen.max_num_seqs if cfg.explicitly_set("generate_config", "max_num_seqs") else 256,
        offload_optimizer=on_policy and gen.offload_train_optimizer and not device.startswith("cpu"),
        offload_grads=on_policy and gen.offload_train_grad,
        warnings=warnings, arch=arch, reward_model=reward_model_options(cfg, device, on_policy=on_policy),
        parallel=parallel, multi_turn=_multi_turn_line(cfg) if on_policy else "",
        off_policy_rollout=_off_policy_line(cfg) if on_policy else "",
    )
    if arch is not None:
        plan = _replace(plan, num_params=arch.num_params(), memory=estimate_memory(cfg, plan, arch))
    return plan


def _replace(plan: Plan, **changes) -> Plan:
    from dataclasses import replace

    return replace(plan, **changes)


def _with_forward(engine: EngineOptions, budgets: dict[str, TokenBudget] | None, phase: str) -> EngineOptions:
    from dataclasses import replace

    return replace(engine, forward_budget=budgets[phase] if budgets else None)


def off_policy(cfg: RunConfig) -> bool:
    """Whether the rollout's policy may differ from the trainer's, so the old log-probs are computed
    (never the on-policy skip) and compared with the rollout's: asynchronous training, a rollout
    worker of its own (``use_integrated_worker: false``), partial rollout, or a rollout correction
    asked for (docs/async.md)."""
    rl = cfg.rl
    return (rl.async_staleness is not None or not rl.use_integrated_worker or rl.rollout_correction != "none"
            or rl.partial_rollout_max_split > 1)


def actor_loss_options(cfg: RunConfig, stage: Stage, temperature: float) -> ActorLossOptions:
    """The actor loss's hyperparameters (the ``kl_coef`` comes from the KL controller each iteration),
    with the clip bounds resolved once: clip-higher (DAPO, Yu et al. 2025) when enabled, else the
    symmetric ``clip_ratio``."""
    rl = cfg.rl
    low, high = (rl.clip_ratio_low, rl.clip_ratio_high) if rl.clip_higher_enable else (rl.clip_ratio, rl.clip_ratio)
    agg = rl.loss_agg_mode or stage.default_loss_agg_mode(cfg)
    return ActorLossOptions(
        policy_loss=rl.policy_loss, clip_low=low, clip_high=high, clip_ratio_c=rl.clip_ratio_c,
        entropy_coeff=rl.entropy_coeff, kl_penalty=rl.kl_penalty, loss_agg_mode=agg,
        norm_length=float(cfg.generate.sampling_config.max_tokens) if agg == "seq-mean-token-sum-norm" else None,
        temperature=temperature)  # norm_length: Dr. GRPO's constant


def token_budgets(cfg: RunConfig) -> dict[str, TokenBudget] | None:
    """Per-phase token budgets (``ref``, ``actor`` (old log-probs), ``update``) of ``use_dynamic_bsz``,
    or None when it is off. As in the seed, ``max_packing_token_size`` / ``dynamic_max_batch_size``
    are the defaults of the per-phase keys that the config does not set."""
    from posttrain.errors import ConfigError

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


def estimate_memory(cfg: RunConfig, plan: Plan, arch: ModelArch) -> MemoryEstimate:
    """A first-order estimate per worker process, for the layout that runs: on the hf backend data
    parallel over ``plan.workers`` (W); on the megatron backend each process holds 1/(TP x PP) of
    the model (``plan.parallel``; M = TP x PP below, 1 on hf), and of a mixture-of-experts model's
    experts 1/(M x EP) (weights, gradients, optimizer, reference and critic alike).

    * weights: fp32 master weights, 4 bytes per parameter (the training dtype only changes the
      forward's autocast), divided by W with FSDP2, by M on megatron;
    * gradients: fp32, 4 bytes per parameter, divided by W with FSDP2, by M on megatron;
    * optimizer: AdamW's two fp32 moments, 8 bytes per parameter, divided by W with FSDP2, by M on
      megatron (and by its DP size with ``use_distributed_optimizer``);
    * reference: a frozen fp32 copy (4 bytes per parameter, divided by M: it takes the actor's
      layout) when the stage uses one, 0 with ``rl_config.offload_reference`` (it is on the device
      only during its own log-prob pass);
    * the offload of the optimizer state and gradients (``generate_config.offload_train_*``) frees
      them during rollout, not during the update, whose peak this estimate is: they count in full;
    * critic (PPO): the value model (the actor's backbone without the LM head, plus a bias-free
      h x 1 value head) with its gradients and moments, 16 bytes per parameter of its own; replicated
      on every worker, DDP, whatever the actor's sharding (divided by M on megatron);
    * reward model (``reward_config``): its weights only (frozen), 4 bytes per parameter (2 in
      bf16), on every worker; counted when its ``config.json`` can be read without loading it;
    * activations for one micro-batch (Korthikanti et al. 2022, memory-efficient SDPA attention):
      s*b*h*34 bytes per layer (full recompute keeps 2*s*b*h), plus fp32 logits s*b*V*4; on megatron
      counted in full too (an upper bound: tensor/sequence parallelism splits some of them, and the
      first pipeline stage holds up to PP micro-batches of its layers);
    * KV cache of the native rollout engine: the rows one data-parallel replica decodes at once
      (at most ``max_num_seqs``) x tokens per sequence x 2 x layers x kv_heads x head_dim x the
      rollout dtype's bytes;
    * rollout copy (megatron, on-policy): the native engine samples from a whole HF copy of the
      model held by each replica's leader (TP rank 0, PP rank 0), fp32, 4 bytes per parameter
      (counted for every process: an upper bound for the others).
    * LoRA (``lora_target_modules``, hf backend): the base weights plus the adapter's, gradients
      and moments for the adapter only, no reference with ``rl_config.share_backbone``, and as the
      rollout copy the adapted base weights that the merged rollout saves while it samples.
    """
    a, par = cfg.actor, plan.parallel
    params = float(arch.num_params())
    split = par.tp * par.pp if par.backend == "megatron" else 1  # M: the model's split over ranks
    # a rank holds 1/M of the dense part and 1/(M x EP) of the experts
    ep_saving = arch.expert_params() / split * (1 - 1 / par.ep) if par.backend == "megatron" else 0.0
    fsdp = plan.workers > 1 and plan.sharding == "fsdp2" and par.backend == "hf"
    shard = params / plan.workers if fsdp else params / split - ep_saving
    optimizer = 8 * shard / (par.dp if par.backend == "megatron" and par.use_distributed_optimizer else 1)
    critic = value_model_params(arch) / split - ep_saving
    s, b, h = plan.max_tokens_per_sequence, plan.micro_batch_size, arch.hidden_size
    per_layer = 2 * s * b * h if a.recompute_granularity == "full" else s * b * h * 34
    activations = arch.num_layers * per_layer + s * b * arch.vocab_size * 4
    seqs = min(plan.responses_per_iteration // par.dp, plan.max_num_seqs) if plan.stage.on_policy else 0
    rollout_copy = 4 * params if plan.stage.on_policy and par.backend == "megatron" else 0.0
    kv = seqs * plan.max_tokens_per_sequence * arch.kv_cache_bytes_per_token(2 if plan.rollout_dtype == "bfloat16"
                                                                             else 4)
    rm_arch = reward_model_arch(cfg) if plan.reward_model is not None else None
    rm_bytes = 2 if plan.reward_model is not None and plan.reward_model.dtype == "bfloat16" else 4
    weights, trained = shard, shard
    reference = params / split - ep_saving if plan.uses_reference and not cfg.rl.offload_reference else 0.0
    if plan.lora:  # LoRA: gradients and moments for the adapter only
        from posttrain.models.lora import lora_sizes

        adapter, targeted = (float(n) for n in lora_sizes(arch, a.lora_target_modules, int(a.lora_r)))
        weights, trained = params + adapter, adapter
        optimizer = 8 * adapter
        reference = 0.0 if cfg.rl.share_backbone or not reference else weights
        rollout_copy = 4 * targeted if plan.stage.on_policy else 0.0
    return MemoryEstimate(weights=4 * weights, gradients=4 * trained, optimizer=optimizer, reference=4 * reference,
                          critic=16 * critic if plan.uses_critic else 0.0, activations=activations, kv_cache=kv,
                          reward_model=rm_bytes * value_model_params(rm_arch) if rm_arch is not None else 0.0,
                          rollout_copy=rollout_copy)


def value_model_params(arch: ModelArch) -> float:
    """Parameters of a sequence-classification model on ``arch`` (critic, reward model): no LM head
    (untied: V x h fewer), a score head (h)."""
    return float(arch.num_params()) - (0 if arch.tie_embeddings else arch.vocab_size * arch.hidden_size) \
        + arch.hidden_size
