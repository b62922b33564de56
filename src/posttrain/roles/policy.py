"""The policy role: the actor model and its training engine, the frozen reference and the rollout
engine, built once from the config and the plan.

The in-process session and every Ray actor worker (:mod:`posttrain.cluster.worker`) build a
:class:`Policy` with :func:`build_policy`; with Ray the driver holds a :class:`Policy` whose
engines are the worker group's proxies (same methods). The native rollout engine and training share
the actor's model object (the seed's integrated worker), so weight sync is free; the vLLM engine
holds its own copy, which the on-policy trainer reloads after every update (``sync_weights``).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.config.megatron import MegatronConfig
from posttrain.config.plan import Plan
from posttrain.train.options import EngineOptions
from posttrain.config.run import RunConfig
from posttrain.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class Policy:
    """What a loop drives. ``model`` is None on the Ray driver (the weights live in the workers);
    ``reference`` and ``rollout`` are None where the stage does not use them."""

    model: Any
    tokenizer: Any
    actor: Any  # TrainEngine (or the Ray group's proxy)
    reference: Any | None
    rollout: Any | None
    stop_token_ids: list[int]
    state: dict[str, Any]  # the trainer state: resumed from a checkpoint, or a fresh run's

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id


def seed_everything(seed: int) -> None:
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def model_source(actor: MegatronConfig) -> str:
    """Where the actor's initial weights come from: ``load`` (a checkpoint or HF dir), else the
    tokenizer path, which for Hugging Face models is the model directory."""
    source = actor.load or actor.tokenizer_name_or_path
    if not source:
        raise ConfigError("set actor_config.load (an HF model or checkpoint directory) or "
                          "megatron_training.tokenizer_name_or_path (an HF model directory)")
    if not Path(source).exists():
        raise ConfigError(f"actor_config.load / tokenizer_name_or_path: {source} does not exist")
    return source


def load_policy_tokenizer(actor: MegatronConfig):
    """The actor's tokenizer and the token ids its rollout stops on (the driver needs no weights)."""
    from posttrain.checkpoint import resolve_checkpoint
    from posttrain.models.loading import load_tokenizer

    tokenizer = load_tokenizer(actor.tokenizer_name_or_path or resolve_checkpoint(model_source(actor))[0])
    return tokenizer, rollout_stop_ids(tokenizer, actor)


def rollout_stop_ids(tokenizer, actor: MegatronConfig) -> list[int]:
    """eos plus the prompt template's stop words that are single tokens."""
    from posttrain.data.encoding import stop_token_ids
    from posttrain.data.templates import get_template

    path = actor.prompt_type_path if actor.prompt_type_path and Path(actor.prompt_type_path).is_file() else None
    return sorted(stop_token_ids(get_template(actor.prompt_type or "hf_chat_template", path), tokenizer))


def build_actor_model(actor: MegatronConfig, device: str):
    """The HF actor model (fp32 master weights), its tokenizer, and where it came from. With
    ``lora_target_modules``, a PEFT model: the base frozen, a LoRA adapter (the source's, when it
    holds one, else a fresh one) the only trainable weights."""
    from posttrain.checkpoint import resolve_checkpoint
    from posttrain.models import lora
    from posttrain.models.loading import check_vocab, load_causal_lm, load_tokenizer

    source = model_source(actor)
    path, _ = resolve_checkpoint(source)
    has_adapter = lora.is_adapter_dir(path)
    if has_adapter and not actor.lora_target_modules:
        raise ConfigError(f"{path} holds a LoRA adapter: set actor_config.lora_target_modules to keep training it, "
                          f"or merge it into the base first (posttrain convert --merge-lora --load-dir {path} "
                          f"--save-dir <dir>)")
    base = lora.adapter_base(path) if has_adapter else path
    model = load_causal_lm(base, device=device, dtype="float32")
    tok_path = actor.tokenizer_name_or_path or path
    tokenizer = load_tokenizer(tok_path)
    check_vocab(model, tokenizer, f"tokenizer {tok_path} vs model {base}")
    if getattr(model.config, "use_cache", None) is not None:
        model.config.use_cache = False
    if actor.lora_target_modules and has_adapter:
        lora.check_adapter_keys(path, actor, model)
        model = lora.load_adapter(model, path)
    elif actor.lora_target_modules:
        model = lora.add_adapter(model, actor)
    return model, tokenizer, source


def build_frozen_copy(model, ref_path: str | None, device: str):
    """The reference policy: a frozen copy of the initial actor, or a model loaded from ref_path."""
    import torch

    if ref_path:
        from posttrain.checkpoint import resolve_checkpoint
        from posttrain.models.lora import load_merged

        ref = load_merged(resolve_checkpoint(ref_path)[0], device=device)  # a LoRA checkpoint: merged
    else:
        ref = copy.deepcopy(model)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref.to(torch.float32)


def offloaded_reference(engine):
    """``rl_config.offload_reference``: the reference's weights off the device between its uses
    (on a CPU they are spilled to a temporary file, removed when the process ends)."""
    import shutil
    import tempfile
    import weakref

    from posttrain.train.offload import OffloadedReference

    spill = tempfile.mkdtemp(prefix="posttrain-reference-")
    reference = OffloadedReference(engine, spill)
    weakref.finalize(reference, shutil.rmtree, spill, True)
    return reference


def build_train_engine(model, role: MegatronConfig, plan: Plan, options: EngineOptions, *,
                       metric_prefix: str = "actor", dp_group=None):
    """AdamW + the LR schedule (sized for the plan's total optimizer steps) + a TrainEngine, with
    the plan's offload of the optimizer state and gradients between updates."""
    from posttrain.train.engine import TrainEngine
    from posttrain.train.optim import build_lr_scheduler, build_optimizer

    optimizer = build_optimizer(model, role.lr, role.weight_decay, role.adam_beta1, role.adam_beta2)
    scheduler = build_lr_scheduler(optimizer, lr=role.lr, min_lr=role.min_lr, lr_decay_style=role.lr_decay_style,
                                   lr_warmup_fraction=role.lr_warmup_fraction, total_steps=plan.total_optimizer_steps)
    offload = None
    if plan.offload_optimizer or plan.offload_grads:  # generate_config.offload_train_*
        from posttrain.train.offload import StateOffload

        offload = StateOffload(optimizer, optimizer_state=plan.offload_optimizer, grads=plan.offload_grads)
    return TrainEngine(model, optimizer, scheduler, clip_grad=role.clip_grad, micro_batch_size=role.micro_batch_size,
                       dtype=plan.train_dtype, activation_checkpointing=role.recompute_granularity is not None,
                       metric_prefix=metric_prefix, dp_group=dp_group, options=options, offload=offload)


def resume(source: str, model, engine, role: MegatronConfig) -> dict:
    """Load a full checkpoint's state into ``model`` and ``engine`` when ``source`` is one (and
    ``finetune`` is off). Returns the trainer state: ``iteration`` (0 when starting fresh),
    ``consumed_samples``, ``sampler_state``, ``checkpoint_dir`` and ``initial_model`` (where the
    run first started, which is what a reference model must be loaded from after a resume)."""
    from posttrain.checkpoint import load_checkpoint, resolve_checkpoint

    _, full = resolve_checkpoint(source)
    if not full or role.finetune:
        return {"iteration": 0, "consumed_samples": 0, "sampler_state": None, "initial_model": str(source)}
    state = load_checkpoint(source, model, engine.optimizer, engine.scheduler,
                            no_load_optim=bool(role.no_load_optim), no_load_rng=bool(role.no_load_rng))
    state.setdefault("initial_model", str(source))
    log.info("resumed from %s at iteration %d", state["checkpoint_dir"], int(state["iteration"]))
    return state


def reference_source(cfg: RunConfig, state: dict) -> str | None:
    """Where the reference's weights come from; None means a copy of the actor's initial weights.
    DPO: ``ref_model``; on-policy: ``integrated_mode_config.ref_model_load_path``. After a resume
    the actor is no longer the initial model, so the reference is loaded from ``initial_model``."""
    path = cfg.actor.ref_model if cfg.stage == "dpo" else (cfg.rl.integrated_mode_config or {}).get(
        "ref_model_load_path")
    path = path or None  # the seed's default ref_model is "" (unset)
    if path is None and int(state["iteration"]) > 0:
        path = str(state["initial_model"])
    return path


def active_dropout(model_config: Any) -> dict[str, float]:
    """The nonzero dropout probabilities of an HF config (``*dropout*`` and ``*pdrop*`` keys)."""
    items = model_config.to_dict().items() if hasattr(model_config, "to_dict") else vars(model_config).items()
    return {k: float(v) for k, v in sorted(items)
            if ("dropout" in k or "pdrop" in k) and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0}


def warn_dropout_across_workers(model: Any, workers: int) -> None:
    """Dropout masks come from each process's torch generator over the rows it trains on, so with
    dropout on, a run on several workers draws other masks than the same run in one process."""
    dropout = active_dropout(model.config) if hasattr(model, "config") else {}
    if workers > 1 and dropout:
        log.warning("the model's config has dropout %s: the update's dropout masks are drawn per worker, so this "
                    "run is not identical to the same run on another number of workers (docs/cluster.md); set "
                    "them to 0 in config.json for worker-count-invariant runs", dropout)


def build_rollout(cfg: RunConfig, plan: Plan, model, tokenizer, stop_token_ids: list[int]):
    """The rollout engine of ``rl_config.rollout_engine`` (native or vLLM) sampling from ``model``."""
    from posttrain.rollout.base import ROLLOUT_ENGINES

    kwargs = dict(model=model, pad_token_id=tokenizer.pad_token_id, eos_token_ids=stop_token_ids,
                  max_num_seqs=plan.max_num_seqs, max_num_batched_tokens=cfg.generate.max_num_batched_tokens,
                  dtype=plan.rollout_dtype)
    if cfg.rl.multi_turn_enable or cfg.rl.async_engine:  # the native engine's per-request loop
        engine = build_multi_turn_engine(cfg, tokenizer, **kwargs)
    else:
        if cfg.rl.rollout_engine == "vllm":  # the generate_config keys vLLM reads (posttrain.config.vllm)
            from posttrain.config.vllm import engine_kwargs

            kwargs.update(engine_kwargs(cfg))
        else:
            if cfg.generate.num_speculative_tokens:  # the native engine's n-gram speculation
                kwargs["speculative_tokens"] = cfg.generate.num_speculative_tokens
            if not cfg.generate.enforce_eager:  # graph mode: CUDA graphs on a GPU (a CPU warned at start-up)
                kwargs["cuda_graphs"] = next(model.parameters()).device.type == "cuda"
        engine = ROLLOUT_ENGINES.get(cfg.rl.rollout_engine)(**kwargs)
    if hasattr(model, "peft_config"):  # LoRA: sample from the merged weights (docs/lora.md)
        from posttrain.models.lora import MergedRollout

        return MergedRollout(engine, model)
    return engine


def build_multi_turn_engine(cfg: RunConfig, tokenizer, **engine_kwargs):
    """The native engine with tool turns (``multi_turn_enable``), or without tools (``async_engine``
    alone: the same per-request decode loop, each row ending on its own)."""
    from posttrain.config.multi_turn import DEFAULT_PARSER, load_tool_file
    from posttrain.data.templates import get_template
    from posttrain.rollout.multi_turn import MultiTurnEngine, ObservationFormat, TurnLimits
    from posttrain.tools.parsers import TOOL_PARSERS
    from posttrain.tools.runner import ToolRunner

    rl, a = cfg.rl, cfg.actor
    max_tokens = cfg.generate.sampling_config.max_tokens
    if rl.multi_turn_enable:
        tools = load_tool_file(rl.tool_config_path)
        template = get_template(a.prompt_type, a.prompt_type_path)
        limits = TurnLimits(max_tool_calls=rl.max_tool_calls, max_total_response_length=rl.max_total_response_length,
                            max_parallel_calls=rl.max_parallel_calls,
                            max_tool_response_length=rl.max_tool_response_length,
                            truncate_side=rl.tool_response_truncate_side or "left",
                            max_model_len=cfg.generate.max_model_len)
    else:
        tools, template = {}, get_template("qwen_retool")  # never used: no tool is ever called
        limits = TurnLimits(max_tool_calls=0, max_total_response_length=max_tokens)
    return MultiTurnEngine(tokenizer=tokenizer, runner=ToolRunner(tools, max_workers=max(4, rl.max_parallel_calls)),
                           parser=TOOL_PARSERS.get(rl.tool_parser_format or DEFAULT_PARSER),
                           observation=ObservationFormat(template, tokenizer), limits=limits, **engine_kwargs)


def build_policy(cfg: RunConfig, plan: Plan, device: str, *, with_rollout: bool = True, dp_group=None) -> Policy:
    """The policy of one process: the actor (resumed when ``load`` names a checkpoint), the frozen
    reference when the stage uses one, and the native or vLLM rollout engine on the actor's model."""
    from posttrain.train.engine import TrainEngine

    a = cfg.actor
    model, tokenizer, source = build_actor_model(a, device)
    warn_dropout_across_workers(model, plan.workers)
    actor = build_train_engine(model, a, plan, plan.actor_engine, metric_prefix=plan.stage.metric_prefix
                               if not plan.stage.on_policy else "actor", dp_group=dp_group)
    state = resume(source, model, actor, a)
    reference = None
    if plan.uses_reference and cfg.rl.share_backbone:  # the actor with its adapter off: no copy
        from posttrain.models.lora import AdapterOff

        reference = AdapterOff(TrainEngine(model, micro_batch_size=a.micro_batch_size, dtype=plan.train_dtype,
                                           dp_group=dp_group, options=plan.ref_engine), model)
    elif plan.uses_reference:
        ref_model = build_frozen_copy(model, reference_source(cfg, state), device)
        reference = TrainEngine(ref_model, micro_batch_size=a.micro_batch_size, dtype=plan.train_dtype,
                                dp_group=dp_group, options=plan.ref_engine)
        if cfg.rl.offload_reference:
            reference = offloaded_reference(reference)
    stops = rollout_stop_ids(tokenizer, a)
    rollout = build_rollout(cfg, plan, model, tokenizer, stops) if with_rollout else None
    return Policy(model=model, tokenizer=tokenizer, actor=actor, reference=reference, rollout=rollout,
                  stop_token_ids=stops, state=state)
