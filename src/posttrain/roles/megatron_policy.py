"""One rank's share of the policy on the Megatron-Core backend (``plan.parallel.backend ==
"megatron"``), built by each Ray actor worker (:mod:`posttrain.cluster.megatron_worker`).

* **Parallel state**: Megatron's tensor, pipeline and data-parallel groups over the worker group's
  torch.distributed world (``parallel_state.initialize_model_parallel``), and its RNG tracker.
* **The actor**: this rank's ``GPTModel`` chunk (from an HF directory through the converter's
  mapping, or from a Megatron checkpoint of the same layout), in Megatron's
  ``DistributedDataParallel`` (in ``Float16Module`` for bf16, CUDA only), with Megatron's optimizer
  (Adam, ``clip_grad``; fp32 main parameters with bf16) and posttrain's LR
  schedule (:func:`posttrain.training.optim.build_lr_scheduler`, which writes the learning rate into
  the optimizer's parameter groups), trained by :class:`~posttrain.training.megatron.engine.MegatronEngine`.
* **The reference**: a frozen chunk of the same layout (forward only).
* **The critic** (PPO): a chunk of the same layout with a scalar value head in place of the output
  layer (:func:`~posttrain.training.megatron.model.attach_value_head`), its own optimizer and LR
  schedule (``critic_config``), saved in ``iter_XXXXXXX/critic/`` of the policy's checkpoints, or
  with ``critic_config.save`` naming a directory of its own as checkpoints of its own there (the
  same Megatron layout, at the actor's iterations), which ``critic_config.load`` resumes.
* **The rollout**: on the first rank of each data-parallel replica (TP rank 0, PP rank 0: the
  replica's *leader*). The native engine needs the whole model in one process, so the leader holds a
  Hugging Face copy of the actor for sampling. After every update all ranks gather the trained
  shards into the HF layout one layer at a time (:func:`~posttrain.training.megatron.model.hf_weights`)
  and the leader copies them in: the seed's resharding, timed as ``timing/resharding_to_infer``.
  With ``rollout_engine: vllm`` there is no HF copy: the leader's vLLM engine (in processes of its
  own, with ``infer_tensor_parallel_size`` workers) starts from a checkpoint written one layer at a
  time from that stream and reloads the stream after every update, through a view of the sharded
  actor (:class:`~posttrain.roles.megatron_view.MegatronView`: the stream, and the probe's
  log-probs by a forward over the replica); the other ranks follow each request's collectives.
* **A vision-language model** (``rl_config.is_multimodal``, a Qwen2.5-VL): the chunks are its
  language model; every rank also holds the frozen HF VLM (:mod:`posttrain.roles.megatron_vlm`):
  its tower feeds the engine's passes (each batch row carries its images), and on the leader it is
  the native rollout's copy, its language model refreshed after every update.
* **Checkpoints**: Megatron's legacy layout (:mod:`posttrain.training.megatron.checkpoint`), with the
  LR schedule and the trainer state in every rank file; ``posttrain convert`` turns them into HF.

Every method runs inside Megatron's CPU shims on a CPU (the worker enters them); the rollout does not.
"""

from __future__ import annotations

import logging
import math
import re
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from posttrain.checkpoint import resolve_checkpoint
from posttrain.config.backend import check_vlm_load
from posttrain.errors import ConfigError
from posttrain.models.arch import arch_from_hf_config
from posttrain.models.mcore import mcore_files
from posttrain.models.mcore.mcore_files import is_mcore_checkpoint
from posttrain.models.lora import AdapterOff, adapter_base, is_adapter_dir
from posttrain.roles.critic import critic_source
from posttrain.roles.megatron_vlm import load_vlm, save_hf_vlm, vlm_source
from posttrain.roles.megatron_view import MegatronView, replica_gpus
from posttrain.roles.policy import Policy, build_rollout, model_source, offloaded_reference, reference_source
from posttrain.training.megatron import lora as megatron_lora
from posttrain.training.megatron.checkpoint import (VALUE_MODEL, Part, load_megatron_checkpoint,
                                                 save_megatron_checkpoint, saved_adapter_only, saved_value_model)
from posttrain.training.megatron.engine import MegatronEngine, MegatronOffload
from posttrain.training.megatron.model import hf_to_megatron, hf_weights, mcore_to_megatron
from posttrain.training.megatron.vision import VisionInputs
from posttrain.training.megatron.vlm_weights import copy_language_model
from posttrain.training.offload import on_device
from posttrain.training.optim import build_scheduler

log = logging.getLogger(__name__)


def _is_megatron_dir(path: str) -> bool:
    return is_mcore_checkpoint(path)


def build_chunks(source: str, options: dict, device: str, *, for_training: bool, value_head: bool = False,
                 lora_actor: bool = False):
    """This rank's chunks (one per virtual stage) on ``device`` and their Megatron args: from a
    Megatron checkpoint of this layout, or an HF directory (a posttrain HF checkpoint's ``iter_*``
    included); ``value_head``: the critic's. A LoRA run's Megatron checkpoint (its files the frozen
    base, the adapter loaded later) is read by the LoRA actor (``lora_actor``) alone: anything else
    would silently be the base, not the adapted model."""
    if _is_megatron_dir(source):
        it_dir = mcore_files.iteration_dir(Path(source))
        if is_adapter_dir(it_dir) and not lora_actor:
            raise ConfigError(f"{it_dir} holds a LoRA run of the megatron backend (its Megatron files are the frozen "
                              f"base): continue it with its actor_config.lora_* keys, or merge its adapter into the "
                              f"base (posttrain convert --merge-lora --load-dir {it_dir} --save-dir <dir>) and load "
                              f"that directory")
        chunks, args = mcore_to_megatron(source, for_training=for_training, value_head=value_head, **options)
    else:
        chunks, args = hf_to_megatron(resolve_checkpoint(source)[0], for_training=for_training,
                                      value_head=value_head, **options)
    return [chunk.to(device) for chunk in chunks], args


def num_layers(source: str) -> int:
    """The layers of the model in ``source`` (a Megatron checkpoint's args, or an HF config)."""
    if _is_megatron_dir(source):
        return int(mcore_files.read_args(mcore_files.iteration_dir(Path(source))).num_layers)
    return arch_from_hf_config(str(resolve_checkpoint(source)[0])).num_layers


def hf_config_of(source: str, args):
    """The Hugging Face config of the actor's architecture: the HF directory's, or for a Megatron
    checkpoint the one its args describe."""
    if _is_megatron_dir(source):
        config = mcore_files.arch_from_args(args, Path(source)).to_hf_config()
        hf_config = AutoConfig.for_model(config.pop("model_type"), **config)
    else:
        hf_config = AutoConfig.from_pretrained(resolve_checkpoint(source)[0])
    hf_config.use_cache = False
    return hf_config


def hf_skeleton(source: str, args, device: str, dtype: str = "float32"):
    """An HF model of the actor's architecture in ``dtype`` (weights to be synced in,
    :func:`hf_config_of`): the native rollout's copy, in the rollout's dtype (bf16 halves it and
    spares the engine a second, bf16 copy to sample from)."""
    hf_config = hf_config_of(source, args)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=getattr(torch, dtype))
    return model.eval()


_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


def hf_param(params: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The tensor of an in-memory HF model that the weight ``name`` of its files fills: the
    parameter itself, or for a Qwen3-MoE expert its slice of the fused experts (Transformers holds
    ``experts.gate_up_proj`` ``[E, 2F, H]``, gate rows first, and ``experts.down_proj`` ``[E, H, F]``)."""
    if name in params:
        return params[name]
    match = _EXPERT.fullmatch(name)
    if match is None:
        raise KeyError(f"{name}: no such parameter in the rollout's Hugging Face model")
    prefix, expert, which = match[1], int(match[2]), match[3]
    if which == "down":
        return params[f"{prefix}.down_proj"][expert]
    fused = params[f"{prefix}.gate_up_proj"][expert]
    half = fused.shape[0] // 2
    return fused[:half] if which == "gate" else fused[half:]


class MegatronPolicy:
    """The actor (and reference) shards of this rank, the leader's rollout copy, and the trainer
    state (resumed or fresh); :attr:`policy` is the :class:`~posttrain.roles.policy.Policy` a loop
    drives (its ``model`` is None: the weights are this rank's chunks)."""

    def __init__(self, plan, device: str, tokenizer, stop_token_ids: list[int], *, source: str | None = None):
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        a, par = plan.policy, plan.parallel
        self.plan, self.device = plan, device
        source = source or model_source(a)
        if plan.multimodal:  # a VLM starts from its HF directory or resumes (roles/megatron_vlm.py)
            check_vlm_load(str(source), a.checkpoint.finetune)
        vpp = num_layers(source) // (par.pp * par.vpp_layers) if par.vpp_layers else None  # chunks per rank
        vpp = vpp if vpp and vpp > 1 else None
        # the parallel-state groups wait as long as the Ray calls (rl_config.ray_timeout_s), not Megatron's 30 min
        ps.initialize_model_parallel(tensor_model_parallel_size=par.tp, pipeline_model_parallel_size=par.pp,
                                     virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=par.ep,
                                     distributed_timeout_minutes=max(1, math.ceil(plan.cluster.timeout_s / 60)))
        model_parallel_cuda_manual_seed(a.seed)
        self.leader = ps.get_tensor_model_parallel_rank() == 0 and ps.get_pipeline_model_parallel_rank() == 0
        self.dp_rank = ps.get_data_parallel_rank()
        options = {"recompute_granularity": par.recompute_granularity, "recompute_method": par.recompute_method,
                   "recompute_num_layers": par.recompute_num_layers,
                   "sequence_parallel": par.sequence_parallel}
        # the router's load-balancing loss (read by mixture-of-experts models only)
        options.update(moe_router_load_balancing_type=a.moe_router_load_balancing_type,
                       moe_aux_loss_coeff=a.moe_aux_loss_coeff)
        if par.recompute_granularity == "full":  # Megatron needs a method and a count with full recompute
            options["recompute_method"] = par.recompute_method or "uniform"
            options["recompute_num_layers"] = par.recompute_num_layers or 1
        self.bf16 = plan.train_dtype == "bfloat16"  # CUDA only (Megatron's bf16 optimizer): bf16 weights,
        if self.bf16:  # fp32 main parameters in the optimizer
            options.update(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
        self.options = {k: v for k, v in options.items() if v is not None}
        resuming = _is_megatron_dir(source) and not a.checkpoint.finetune and _has_iteration(source)
        # a LoRA checkpoint saved with lora_ckpt_filter holds the adapter alone: the base is its HF base model
        built_from = adapter_base(mcore_files.iteration_dir(Path(source))) \
            if a.lora is not None and resuming and saved_adapter_only(source) else source
        self.chunks, self.args = build_chunks(str(built_from), self.options, device, for_training=True,
                                              lora_actor=a.lora is not None)
        if a.lora is not None:  # adapters on the frozen base, before Megatron's DDP and optimizer see it
            self._attach_lora(source, resuming)
        # a VLM: its frozen HF model on every rank (the tower's features, the leader's rollout copy)
        self.vlm = load_vlm(vlm_source(str(source)), device, plan.rollout_dtype) if plan.multimodal else None
        self.vision = VisionInputs(self.vlm) if self.vlm is not None else None
        self.models, self.optimizer, self.scheduler = self._trainable(a.optim, plan, self.chunks)
        self.engine = self._engine(self.models, self.optimizer, self.scheduler, plan.stage.metric_prefix
                                   if not plan.stage.on_policy else "actor", a.optim, plan.actor_engine)
        self.state = {"iteration": 0, "consumed_samples": 0, "sampler_state": None, "initial_model": str(source)}
        if resuming:
            self.state = self._resume(source, a.checkpoint)
        self.critic = self._critic(plan, source if resuming else None) if plan.uses_critic else None
        self.reference = None
        if plan.uses_reference and a.share_backbone:  # LoRA: the actor's chunks with their adapters off
            self.reference = AdapterOff(self._engine([self._precision(c) for c in self.chunks], None, None, "ref",
                                                     a.optim, plan.ref_engine),
                                        megatron_lora.AdapterSwitch(self.chunks))
        elif plan.uses_reference:
            ref_source = reference_source(a, self.state) or str(source)
            ref_chunks, _ = build_chunks(ref_source, self.options, device, for_training=False)
            for chunk in ref_chunks:
                chunk.eval().requires_grad_(False)
            self.reference = self._engine([self._precision(c) for c in ref_chunks], None, None, "ref", a.optim,
                                          plan.ref_engine)
            if a.offload_reference:
                self.reference = offloaded_reference(self.reference)
        self._build_rollout(tokenizer, stop_token_ids)
        self.policy = Policy(model=None, tokenizer=tokenizer, actor=self.engine, reference=self.reference,
                             rollout=self.rollout, stop_token_ids=stop_token_ids, state=self.state,
                             image_token_id=int(self.vlm.config.image_token_id) if self.vlm is not None else None)

    # ---- set-up ---------------------------------------------------------------------------------
    def _build_rollout(self, tokenizer, stop_token_ids: list[int]) -> None:
        """The leader's rollout: vLLM started from the stream of layers (the other ranks follow), or
        the native engine on an HF copy (a VLM's: its frozen HF model), synced from the chunks."""
        plan, a, device = self.plan, self.plan.policy, self.device
        self.rollout = self.view = None
        if plan.stage.on_policy and plan.rollout.engine == "vllm":  # vLLM started from the stream of layers
            self.view = MegatronView(self.chunks, self.args, self.engine, hf_config_of(self.state["initial_model"],
                                     self.args), device, "bfloat16" if self.bf16 else "float32")
            options = {"separate_process": True}  # this process belongs to the trainer's torch.distributed world
            tp = plan.rollout.vllm.tensor_parallel_size
            if torch.device(device).type == "cuda" and tp > 1:  # its workers on the replica's GPUs (a collective)
                options["visible_devices"] = replica_gpus(tp)
            if self.leader:
                self.rollout = build_rollout(plan.rollout, a, self.view, tokenizer, stop_token_ids, **options)
            else:
                self.view.follow()
        elif plan.stage.on_policy:
            if self.leader:
                self.hf_model = self.vlm if self.vlm is not None else hf_skeleton(self.state["initial_model"],
                                                                                  self.args, device, plan.rollout_dtype)
                self.rollout = build_rollout(plan.rollout, a, self.hf_model, tokenizer, stop_token_ids)
            self.sync_rollout()

    def _attach_lora(self, source: str, resuming: bool) -> None:
        """``actor_config.lora_*``: PEFT's adapters on the Megatron linears (docs/lora.md), the base
        frozen; a fresh run's drawn by PEFT on the HF model ``source`` with the run's seed (the hf
        backend's numbers), a resumed run's loaded with the optimizer by :meth:`_resume`."""
        a = self.plan.policy
        init = None
        if resuming:
            megatron_lora.check_saved_adapter(mcore_files.iteration_dir(Path(source)), a.lora)
        else:
            if _is_megatron_dir(source):
                raise ConfigError(f"actor_config.load={source}: a LoRA run on the megatron backend starts from a "
                                  f"Hugging Face model directory (PEFT draws the adapter on it; convert this "
                                  f"checkpoint first: posttrain convert --save-model-type hf) or resumes its own "
                                  f"LoRA checkpoint")
            init = megatron_lora.peft_init(a.lora, resolve_checkpoint(source)[0], a.seed)
        megatron_lora.attach(self.chunks, self.args, a.lora, init)

    def _trainable(self, optim, plan, chunks: list):
        """Megatron's DDP over each of ``chunks``, their optimizer and posttrain's LR schedule, from
        the role's :class:`~posttrain.training.options.OptimOptions` ``optim``."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        par = plan.parallel
        ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            use_distributed_optimizer=par.use_distributed_optimizer)
        models = [DistributedDataParallel(chunk.config, ddp, self._precision(chunk),
                                          disable_bucketing=index > 0)  # as Megatron-LM builds virtual stages
                  for index, chunk in enumerate(chunks)]
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer=optim.optimizer, sgd_momentum=optim.sgd_momentum, lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
            adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, clip_grad=optim.clip_grad, bf16=self.bf16,
            params_dtype=torch.bfloat16 if self.bf16 else torch.float32,
            use_distributed_optimizer=par.use_distributed_optimizer), models)
        scheduler = build_scheduler(optimizer, optim, plan.total_optimizer_steps)
        return models, optimizer, scheduler

    def _precision(self, chunk):
        """``chunk`` in Megatron's ``Float16Module`` for bf16 (inputs cast in, outputs cast back to
        float32 on the last stage), else as it is."""
        if not self.bf16:
            return chunk
        from megatron.core.transformer.module import Float16Module

        return Float16Module(chunk.config, chunk)

    def _engine(self, model, optimizer, scheduler, prefix: str, optim, options=None, value_head: bool = False):
        """An engine; a trained one with the plan's offload of its optimizer state and gradients."""
        engine = MegatronEngine(model, optimizer, scheduler, vocab_size=int(self.args.vocab_size),
                                micro_batch_size=optim.micro_batch_size or 1, metric_prefix=prefix,
                                value_head=value_head, options=options, vision=None if value_head else self.vision)
        plan = self.plan
        if optimizer is not None and (plan.offload_optimizer or plan.offload_grads):
            engine.offload = MegatronOffload(engine.models, optimizer, optimizer_state=plan.offload_optimizer,
                                             grads=plan.offload_grads)
            engine.offload.to_host()  # nothing is needed until the first update
        return engine

    def _critic(self, plan, resume_dir: str | None):
        """PPO's critic (a value head on the backbone), colocated with the same layout: from
        ``critic_config.load`` (a reward model, HF or ``--orm`` Megatron, or the critic's own
        checkpoint, which it resumes unless ``finetune``) or the actor's initial weights with a
        zero head; without a save directory of its own, resumed from ``critic/`` of the actor's
        checkpoint."""
        options = plan.critic
        path, from_actor = critic_source(plan)
        self.critic_chunks, _ = build_chunks(str(self.state["initial_model"]) if from_actor else path, self.options,
                                             self.device, for_training=True, value_head=True)
        models, optimizer, scheduler = self._trainable(options.optim, plan, self.critic_chunks)
        critic = self._engine(models, optimizer, scheduler, "critic", options.optim, value_head=True)
        load, subdir = None, None
        if not from_actor and _is_own_critic_checkpoint(path) and not options.checkpoint.finetune:
            load = path  # no_load_optim keeps its weights only; the RNG is the actor's to restore
        elif resume_dir is not None and options.save_dir is None:  # finetune / no_load_optim: the weights only
            load, subdir = resume_dir, "critic"
        if load is not None:
            keep_optim = options.checkpoint.restores_optimizer
            saved = load_megatron_checkpoint(load, self.critic_chunks, optimizer, load_optim=keep_optim,
                                             load_rng=False, subdir=subdir)
            if keep_optim and "scheduler" in saved:
                scheduler.load_state_dict(saved["scheduler"])
            log.info("critic: resumed from %s%s at iteration %d", load, f" ({subdir}/)" if subdir else "",
                     int(saved["iteration"]))
        return critic

    def _resume(self, source: str, load) -> dict:
        saved = load_megatron_checkpoint(source, self.chunks, self.optimizer, load_optim=not load.no_load_optim,
                                         load_rng=not load.no_load_rng)
        if "scheduler" in saved and not load.no_load_optim:
            self.scheduler.load_state_dict(saved["scheduler"])
        state = dict(saved.get("trainer_state") or {})
        state.update(iteration=int(saved["iteration"]), sampler_state=saved.get("sampler_state"),
                     checkpoint_dir=str(mcore_files.iteration_dir(source)))  # the loop's files are there
        state.setdefault("initial_model", str(source))
        log.info("resumed from the Megatron checkpoint %s at iteration %d", source, state["iteration"])
        return state

    # ---- roles ----------------------------------------------------------------------------------
    def sync_rollout(self) -> float:
        """The trained weights into the leader's rollout, one layer at a time (all ranks take part):
        the native engine's HF copy, or the vLLM engine (then proven by its probe, a forward over the
        replica); returns the seconds it took."""
        start = time.perf_counter()
        if self.vlm is not None:  # a VLM: its language model, on every rank (roles/megatron_vlm.py)
            copy_language_model(self.chunks, self.args, self.vlm)
            return time.perf_counter() - start
        if self.view is not None:
            if self.rollout is not None:
                self.rollout.sync_weights(self.view)
            else:
                self.view.follow()
            return time.perf_counter() - start
        params = dict(self.hf_model.named_parameters()) if self.rollout is not None else None
        for name, tensor in hf_weights(self.chunks, self.args):
            if params is not None:
                with torch.no_grad():
                    hf_param(params, name).copy_(tensor)
        return time.perf_counter() - start

    def pop_rollout_metrics(self) -> dict[str, float]:
        """The leader's rollout metrics since the last call (vLLM: ``rollout/sync_probe_diff``); {} elsewhere."""
        return self.rollout.pop_metrics() if self.rollout is not None else {}

    def save(self, save_dir: str, iteration: int, *, sampler_state, trainer_state: dict, save_optim: bool,
             save_rng: bool, files: dict | None = None) -> Path:
        """Every rank writes its shard; rank 0 also ``files`` (the loop's objects by file name: partial
        rollout's dock), inside the iteration before it is published."""
        with on_device(self.engine, self.critic):  # an offloaded optimizer state is saved too
            parts = {"": Part(self.chunks, self.optimizer, {"scheduler": self.scheduler.state_dict(),
                                                            "trainer_state": dict(trainer_state),
                                                            "sampler_state": sampler_state},
                              adapter_only=self.plan.policy.lora is not None and self.plan.schedule.adapter_only)}
            if self.critic is not None and self.plan.critic.save_dir is None:  # else its own: save_critic
                parts["critic"] = Part(self.critic_chunks, self.critic.optimizer,
                                       {"scheduler": self.critic.scheduler.state_dict()})
            return save_megatron_checkpoint(save_dir, iteration, parts, self.args,
                                            ckpt_format=self.plan.policy.ckpt_format, save_optim=save_optim,
                                            save_rng=save_rng,
                                            write_more=lambda directory: self._write_more(directory, files or {}))

    def save_critic(self, iteration: int, trainer_state: dict) -> Path | None:
        """The critic's own checkpoint in ``critic_config.save`` (a collective: every rank writes
        its shard), in the actor's format with the critic's ``no_save_optim`` / ``no_save_rng``;
        None when it has no directory of its own (it is then ``critic/`` of :meth:`save`)."""
        options = self.plan.critic
        if self.critic is None or options.save_dir is None:
            return None
        with on_device(self.critic):  # an offloaded optimizer state is saved too
            part = Part(self.critic_chunks, self.critic.optimizer, {"scheduler": self.critic.scheduler.state_dict(),
                                                                    "trainer_state": dict(trainer_state),
                                                                    VALUE_MODEL: True})
            return save_megatron_checkpoint(options.save_dir, iteration, {"": part}, self.args,
                                            ckpt_format=self.plan.policy.ckpt_format, save_optim=options.save_optim,
                                            save_rng=options.save_rng)

    def _write_more(self, directory: Path, files: dict) -> None:
        """A LoRA actor's adapter in PEFT's format next to the Megatron files (a collective; base
        model: the HF directory the run started from), a VLM's Hugging Face directory (``hf/``, a
        collective), and rank 0 ``files``."""
        lora = self.plan.policy.lora
        if self.vlm is not None:  # the trained VLM as a Hugging Face directory (roles/megatron_vlm.py)
            save_hf_vlm(self.chunks, self.args, self.vlm, directory, resolve_checkpoint(self.state["initial_model"])[0])
        if lora is not None:
            base = resolve_checkpoint(self.state["initial_model"])[0]
            megatron_lora.write_adapter(self.chunks, self.args, lora, str(Path(base).resolve()), directory)
        if files and torch.distributed.get_rank() == 0:
            for name, obj in files.items():
                torch.save(obj, directory / name)


def _is_own_critic_checkpoint(path: str) -> bool:
    """``critic_config.load`` names a critic's own Megatron checkpoint that a run saved
    (``critic_config.save``), not a converted ``--orm`` model or an actor's checkpoint (whose
    backbone starts the critic)."""
    return _is_megatron_dir(path) and _has_iteration(path) and saved_value_model(path)


def _has_iteration(source: str) -> bool:
    """A Megatron checkpoint that a run saved (``iter_*``), not a converted ``release``."""
    return mcore_files.iteration_dir(Path(source)).name.startswith("iter_")
