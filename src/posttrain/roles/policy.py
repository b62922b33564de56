"""The policy role: the actor model and its training engine, the frozen reference and the rollout
engine, built once from the config and the plan.

The in-process session and every Ray actor worker (:mod:`posttrain.cluster.worker`) build a
:class:`Policy` with :func:`build_policy`; with Ray the driver holds a :class:`Policy` whose
engines are the worker group's proxies (same methods). The native rollout engine and training share
the actor's model object (the seed's integrated worker), so weight sync is free; the vLLM engine
holds its own copy, which the on-policy trainer reloads after every update (``sync_weights``).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import random
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from posttrain.checkpoint import load_checkpoint, resolve_checkpoint
from posttrain.checkpoint.files import CheckpointLoad
from posttrain.config.options import PolicyOptions, RolloutOptions
from posttrain.config.plan import Plan
from posttrain.data.encoding import stop_token_ids
from posttrain.data.templates import get_template
from posttrain.errors import ConfigError
from posttrain.models import lora
from posttrain.models.loading import check_vocab, load_causal_lm, load_tokenizer, resolve_model_dir, torch_dtype
from posttrain.models.lora import AdapterOff, MergedRollout, load_merged, merged
from posttrain.rollout.base import ROLLOUT_ENGINES, RolloutEngine
from posttrain.rollout.multi_turn import MultiTurnEngine, ObservationFormat, TurnLimits
from posttrain.tools.config import load_tools
from posttrain.tools.parsers import TOOL_PARSERS
from posttrain.tools.runner import ToolRunner
from posttrain.training.base import ActorEngine, ReferenceEngine
from posttrain.training.engine import TrainEngine
from posttrain.training.offload import OffloadedReference, StateOffload, weights_off_during_rollout
from posttrain.training.optim import build_role_optimizer, build_scheduler
from posttrain.training.options import EngineOptions, OptimOptions
from posttrain.paths import shipped_file

log = logging.getLogger(__name__)


@dataclass
class Policy:
    """What a loop drives, the same on every backend and placement: the actor's engine (a
    :class:`~posttrain.training.engine.TrainEngine`, a Megatron rank's
    :class:`~posttrain.training.megatron.engine.MegatronEngine`, or the Ray group's proxy), the frozen
    reference and the rollout engine. ``model`` is the HF actor model where this process holds it
    (None on the Ray driver and on the Megatron backend, whose weights are sharded); ``reference``
    and ``rollout`` are None where the stage (or the rank) does not use them; ``teacher`` (on-policy
    distillation's, :func:`build_teacher`) is None without ``rl_config.teacher_model``."""

    model: Any
    tokenizer: Any
    actor: ActorEngine
    reference: ReferenceEngine | None
    rollout: RolloutEngine | None
    stop_token_ids: list[int]
    state: dict[str, Any]  # the trainer state: resumed from a checkpoint, or a fresh run's
    processor: Any = None  # a multimodal run: the tokenizer and image processor (models.vlm.ImageTextProcessor)
    teacher: ReferenceEngine | None = None  # rl_config.teacher_model: on-policy distillation's frozen teacher
    image_token_id: int | None = None  # a multimodal run: the config's <|image_pad|> id (the Ray driver has no model)

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def model_source(policy: PolicyOptions) -> str:
    """Where the actor's initial weights come from: ``load`` (a checkpoint or HF dir), else the
    tokenizer path, which for Hugging Face models is the model directory."""
    source = policy.load or policy.tokenizer
    if not source:
        raise ConfigError("set actor_config.load (an HF model or checkpoint directory) or "
                          "megatron_training.tokenizer_name_or_path (an HF model directory)")
    if not Path(source).exists():
        raise ConfigError(f"actor_config.load / tokenizer_name_or_path: {source} does not exist")
    return source


def load_policy_tokenizer(policy: PolicyOptions, source: str | None = None):
    """The actor's tokenizer and the token ids its rollout stops on (the driver needs no weights)."""
    tokenizer = load_tokenizer(policy.tokenizer or resolve_model_dir(source or model_source(policy)))
    return tokenizer, rollout_stop_ids(tokenizer, policy)


def load_policy_processor(policy: PolicyOptions, source: str | None = None):
    """A multimodal run's processor (tokenizer and image processor) where the driver holds no weights:
    the directory :func:`multimodal_actor` reads it from."""
    from posttrain.models.vlm import load_processor

    return load_processor(policy.tokenizer or resolve_model_dir(source or model_source(policy)))


def rollout_stop_ids(tokenizer, policy: PolicyOptions) -> list[int]:
    """eos plus the prompt template's stop words that are single tokens."""
    path = policy.prompt_type_path if policy.prompt_type_path and shipped_file(policy.prompt_type_path).is_file() else None
    return sorted(stop_token_ids(get_template(policy.prompt_type or "hf_chat_template", path), tokenizer))


def build_actor_model(policy: PolicyOptions, device: str, source: str | None = None, *,
                      frozen_dtype: str = "float32"):
    """The HF actor model (fp32 master weights), its tokenizer, and where it came from (``source``,
    default :func:`model_source`). With ``lora``, a PEFT model: the base frozen and stored in
    ``frozen_dtype`` (:attr:`~posttrain.config.plan.Plan.frozen_dtype`), a LoRA adapter (the
    source's, when it holds one, else a fresh one) the only trainable weights, kept in fp32 (PEFT
    casts a bf16 adapter up)."""
    source = source or model_source(policy)
    path = resolve_model_dir(source)
    has_adapter = lora.is_adapter_dir(path)
    lora.check_adapter_wanted(path, policy.lora)
    base = lora.adapter_base(path) if has_adapter else path
    model = load_causal_lm(base, device=device, dtype=frozen_dtype if policy.lora is not None else "float32")
    tok_path = policy.tokenizer or path
    tokenizer = load_tokenizer(tok_path)
    check_vocab(model, tokenizer, f"tokenizer {tok_path} vs model {base}")
    if getattr(model.config, "use_cache", None) is not None:
        model.config.use_cache = False
    if policy.lora is not None and has_adapter:
        lora.check_adapter_keys(path, policy.lora, model)
        model = lora.load_adapter(model, path)
    elif policy.lora is not None:
        model = lora.add_adapter(model, policy.lora)
    return model, tokenizer, source


def build_frozen_copy(model, ref_path: str | None, device: str, dtype: str = "float32"):
    """The reference policy: a frozen copy of the initial actor, or a model loaded from ref_path,
    stored in ``dtype`` (:attr:`~posttrain.config.plan.Plan.frozen_dtype`)."""
    if ref_path:
        ref = load_merged(resolve_model_dir(ref_path), device=device)  # a LoRA checkpoint: merged
    else:
        ref = copy.deepcopy(model)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref.to(torch_dtype(dtype))


def offloaded_reference(engine):
    """``rl_config.offload_reference``: the reference's weights off the device between its uses
    (on a CPU they are spilled to a temporary file, removed when the process ends)."""
    spill = tempfile.mkdtemp(prefix="posttrain-reference-")
    reference = OffloadedReference(engine, spill)
    weakref.finalize(reference, shutil.rmtree, spill, True)
    return reference


def reference_engine(ref_model, plan: Plan, micro_batch_size: int, dp_group=None):
    """The frozen reference's engine (offloaded between its uses with ``offload_reference``)."""
    reference = TrainEngine(ref_model, micro_batch_size=micro_batch_size, dtype=plan.train_dtype, dp_group=dp_group,
                            options=plan.ref_engine)
    return offloaded_reference(reference) if plan.policy.offload_reference else reference


def build_reference(plan: Plan, device: str, source: str, state: dict, micro_batch_size: int | None = None):
    """The frozen reference alone (a reference worker group's, :mod:`posttrain.cluster.role_groups`):
    loaded from ``ref_config.load`` (or, after a resume, the run's initial model), else a copy of
    the actor's initial weights ``source``; ``micro_batch_size`` rows per forward (None: the actor's)."""
    p = plan.policy
    path = reference_source(p, state)
    model = None if path else build_actor_model(p, device, source, frozen_dtype=plan.frozen_dtype)[0]
    ref_model = build_frozen_copy(model, path, device, plan.frozen_dtype)
    return reference_engine(ref_model, plan, micro_batch_size or p.optim.micro_batch_size)


def build_teacher(plan: Plan, device: str, actor_model, tokenizer, dp_group=None):
    """On-policy distillation's teacher (``rl_config.teacher_model``): a frozen model loaded as the
    reference is from its own path (a LoRA checkpoint merged), in an engine of the reference's options;
    its vocabulary must be the actor's (:func:`check_teacher_vocab`)."""
    path = plan.distill.teacher
    if not Path(path).exists():
        raise ConfigError(f"rl_config.teacher_model: {path} does not exist; set it to the teacher's HF model "
                          f"directory or checkpoint")
    teacher = build_frozen_copy(None, path, device, plan.frozen_dtype)
    check_teacher_vocab(teacher, actor_model, tokenizer, path)
    return TrainEngine(teacher, micro_batch_size=plan.update.ref_micro_batch_size or plan.policy.optim.micro_batch_size,
                       dtype=plan.train_dtype, dp_group=dp_group, options=plan.ref_engine)


def check_teacher_vocab(teacher, actor_model, tokenizer, path: str) -> None:
    """The teacher scores the actor's token ids, so both must share one vocabulary: the same output
    size and, where the teacher's directory has a tokenizer, the same tokens under the same ids."""
    sizes = [m.get_output_embeddings().weight.shape[0] for m in (teacher, actor_model)]
    if sizes[0] != sizes[1]:
        raise ConfigError(f"rl_config.teacher_model: {path} has a vocabulary of {sizes[0]} tokens, the actor "
                          f"{sizes[1]}; distillation compares log-probs of the same token ids, so the teacher must "
                          f"use the actor's tokenizer")
    directory = resolve_model_dir(path)
    if not any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return
    if load_tokenizer(directory).get_vocab() != tokenizer.get_vocab():
        raise ConfigError(f"rl_config.teacher_model: the tokenizer in {directory} differs from the actor's; "
                          f"distillation compares log-probs of the same token ids, so the teacher must use the "
                          f"actor's tokenizer")


def build_train_engine(model, optim: OptimOptions, plan: Plan, options: EngineOptions, *,
                       metric_prefix: str = "actor", dp_group=None):
    """The role's optimizer (AdamW or SGD) + the LR schedule (sized for the plan's total optimizer steps) + a TrainEngine, with
    the plan's offload of the optimizer state and gradients between updates."""
    optimizer = build_role_optimizer(model, optim)
    scheduler = build_scheduler(optimizer, optim, plan.total_optimizer_steps)
    offload = None
    if plan.offload_optimizer or plan.offload_grads:  # generate_config.offload_train_*
        offload = StateOffload(optimizer, optimizer_state=plan.offload_optimizer, grads=plan.offload_grads)
    return TrainEngine(model, optimizer, scheduler, clip_grad=optim.clip_grad, micro_batch_size=optim.micro_batch_size,
                       dtype=plan.train_dtype, activation_checkpointing=optim.activation_checkpointing,
                       metric_prefix=metric_prefix, dp_group=dp_group, options=options, offload=offload)


def resume(source: str, model, engine, load: CheckpointLoad) -> dict:
    """Load a full checkpoint's state into ``model`` and ``engine`` when ``source`` is one (and
    ``finetune`` is off). Returns the trainer state: ``iteration`` (0 when starting fresh),
    ``consumed_samples``, ``sampler_state``, ``checkpoint_dir`` and ``initial_model`` (where the
    run first started, which is what a reference model must be loaded from after a resume)."""
    _, full = resolve_checkpoint(source)
    if not full or load.finetune:
        return {"iteration": 0, "consumed_samples": 0, "sampler_state": None, "initial_model": str(source)}
    state = load_checkpoint(source, model, engine.optimizer, engine.scheduler, no_load_optim=load.no_load_optim,
                            no_load_rng=load.no_load_rng)
    state.setdefault("initial_model", str(source))
    log.info("resumed from %s at iteration %d", state["checkpoint_dir"], int(state["iteration"]))
    return state


def reference_source(policy: PolicyOptions, state: dict) -> str | None:
    """Where the reference's weights come from; None means a copy of the actor's initial weights.
    DPO: ``ref_model``; on-policy: ``integrated_mode_config.ref_model_load_path``. After a resume
    the actor is no longer the initial model, so the reference is loaded from ``initial_model``."""
    path = policy.reference_load
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


def build_rollout(rollout: RolloutOptions, policy: PolicyOptions, model, tokenizer, stop_token_ids: list[int],
                  **engine_options):
    """The rollout engine of ``rl_config.rollout_engine`` (native or vLLM) sampling from ``model``;
    ``engine_options``: the caller's own arguments to the engine (the Megatron leader's vLLM runs in
    processes of its own: ``separate_process``)."""
    kwargs = dict(model=model, pad_token_id=tokenizer.pad_token_id, eos_token_ids=stop_token_ids,
                  max_num_seqs=rollout.max_num_seqs, max_num_batched_tokens=rollout.max_num_batched_tokens,
                  dtype=rollout.dtype, **engine_options)
    peft = hasattr(model, "peft_config")
    if rollout.per_request and rollout.engine == "native":  # its per-request loop (multi-turn, async_engine)
        engine = MultiTurnEngine(**turn_parts(rollout, policy, tokenizer), **kwargs)
    else:  # vLLM admits per request by itself (async_engine); its tool turns are wrapped below
        if rollout.vllm is not None:  # the generate_config keys vLLM reads
            v = rollout.vllm
            kwargs.update(max_model_len=v.max_model_len, gpu_memory_utilization=v.gpu_memory_utilization,
                          tensor_parallel_size=v.tensor_parallel_size, enforce_eager=v.enforce_eager,
                          enable_prefix_caching=v.enable_prefix_caching, trust_remote_code=v.trust_remote_code,
                          enable_expert_parallel=v.enable_expert_parallel)
        else:
            kwargs["max_model_len"] = rollout.max_model_len  # a response stops there, as on vLLM
            if rollout.speculative_tokens:  # the native engine's n-gram speculation
                kwargs["speculative_tokens"] = rollout.speculative_tokens
            if not rollout.enforce_eager:  # graph mode: CUDA graphs on a GPU (a CPU warned at start-up)
                kwargs["cuda_graphs"] = next(model.parameters()).device.type == "cuda"
        with merged(model) if peft and rollout.vllm is not None else contextlib.nullcontext():
            engine = ROLLOUT_ENGINES.get(rollout.engine)(**kwargs)  # vLLM starts from the adapted weights
        if rollout.tools is not None:  # multi-turn on vLLM: each turn a request (rollout/vllm_multi_turn.py)
            from posttrain.rollout.vllm_multi_turn import VLLMMultiTurnEngine

            engine = VLLMMultiTurnEngine(engine, **turn_parts(rollout, policy, tokenizer))
    if peft:  # LoRA: sample from the merged weights (docs/lora.md)
        return MergedRollout(engine, model)
    return engine


def turn_parts(rollout: RolloutOptions, policy: PolicyOptions, tokenizer) -> dict[str, Any]:
    """What a multi-turn engine needs beyond its model (``multi_turn_enable``): the tokenizer, the
    tool runner, the parser, the observation format and the limits; without tools (``async_engine``
    alone: the native per-request decode loop, each row ending on its own) no tool is ever called."""
    tools = rollout.tools
    if tools is not None:
        funcs = load_tools(tools.config_path)
        template = get_template(policy.prompt_type, policy.prompt_type_path)
        limits, parser, parallel = tools.limits, tools.parser, tools.max_parallel_calls
    else:
        funcs, template = {}, get_template("qwen_retool")  # never used: no tool is ever called
        limits = TurnLimits(max_tool_calls=0, max_total_response_length=rollout.sampling.max_tokens)
        parser, parallel = "hermes", 0  # never used either
    return dict(tokenizer=tokenizer, runner=ToolRunner(funcs, max_workers=max(4, parallel)),
                parser=TOOL_PARSERS.get(parser), observation=ObservationFormat(template, tokenizer), limits=limits)


def build_policy(plan: Plan, device: str, *, source: str | None = None, with_rollout: bool = True,
                 dp_group=None, with_reference: bool = True) -> Policy:
    """The policy of one process: the actor (from ``source``, default the plan's ``load``; resumed
    when it names a checkpoint), the frozen reference when the stage uses one (and ``with_reference``:
    not when it has a worker group of its own), and the native or vLLM rollout engine on the actor's
    model."""
    p = plan.policy
    model, tokenizer, source = build_actor_model(p, device, source, frozen_dtype=plan.frozen_dtype)
    warn_dropout_across_workers(model, plan.workers)
    processor = multimodal_actor(plan, model, p.tokenizer or resolve_model_dir(source)) if plan.multimodal else None
    actor = build_train_engine(model, p.optim, plan, plan.actor_engine, metric_prefix=plan.stage.metric_prefix
                               if not plan.stage.on_policy else "actor", dp_group=dp_group)
    state = resume(source, model, actor, p.checkpoint)
    reference = None
    micro = p.optim.micro_batch_size
    if plan.uses_reference and p.share_backbone:  # the actor with its adapter off: no copy
        reference = AdapterOff(TrainEngine(model, micro_batch_size=micro, dtype=plan.train_dtype,
                                           dp_group=dp_group, options=plan.ref_engine), model)
    elif plan.uses_reference and with_reference:
        ref_model = build_frozen_copy(model, reference_source(p, state), device, plan.frozen_dtype)
        reference = reference_engine(ref_model, plan, micro, dp_group)
    stops = rollout_stop_ids(tokenizer, p)
    rollout = build_rollout(plan.rollout, p, model, tokenizer, stops) if with_rollout and plan.rollout else None
    if rollout is not None and plan.rollout.offload_weights and not device.startswith("cpu"):
        rollout = weights_off_during_rollout(rollout, model)  # generate_config.offload_train_param (a CPU: no effect)
    teacher = build_teacher(plan, device, model, tokenizer, dp_group) if plan.distill is not None else None
    return Policy(model=model, tokenizer=tokenizer, actor=actor, reference=reference, rollout=rollout,
                  stop_token_ids=stops, state=state, processor=processor, teacher=teacher,
                  image_token_id=int(model.config.image_token_id) if plan.multimodal else None)


def multimodal_actor(plan: Plan, model, processor_dir):
    """A multimodal run's actor: a vision-language model (else a ConfigError), its vision tower frozen
    with ``freeze_vision_tower`` (before the optimizer is built), and its processor from ``processor_dir``."""
    from posttrain.models.vlm import load_processor
    from posttrain.training.multimodal import VIDEO_MODEL_TYPES, freeze_vision_tower

    if getattr(model.config, "image_token_id", None) is None or getattr(model.config, "vision_config", None) is None:
        raise ConfigError(f"rl_config.is_multimodal: true, but the actor ({type(model).__name__}) is a text model; "
                          "give a vision-language model (Qwen2.5-VL) in actor_config.load, or set is_multimodal: false")
    if plan.multimodal.videos_per_prompt and model.config.model_type not in VIDEO_MODEL_TYPES:
        raise ConfigError(f"generate_config.limit_mm_video_per_prompt={plan.multimodal.videos_per_prompt}: posttrain "
                          f"feeds videos to {', '.join(VIDEO_MODEL_TYPES)} only, not model_type "
                          f"{model.config.model_type}; set it to 0 and give a video's frames as images")
    if plan.multimodal.freeze_vision_tower:
        freeze_vision_tower(model)
    return load_processor(processor_dir)
