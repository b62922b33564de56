"""The plan's memory estimate per worker process, and its comparison with the machine.

:func:`estimate_memory` gives first-order bytes per worker for the layout that runs (formulas
below); :func:`check_memory` compares them with this machine when the run executes here, and
:func:`check_rollout_fits` refuses a rollout copy that no device holds.

The layout: on the hf backend data parallel over ``plan.workers`` (W); on the megatron backend
each process holds 1/(TP x PP) of the model (``plan.parallel``; M = TP x PP below, 1 on hf), and
of a mixture-of-experts model's experts 1/(M x EP) (weights, gradients, optimizer, reference and
critic alike).

* weights: the trained weights in fp32, 4 bytes per parameter (they are their own master copy:
  the hf backend's bf16 autocast casts them in the forward), divided by W with FSDP2, by M on
  megatron; megatron in bf16 (CUDA: ``Float16Module``) holds them in bf16, 2 bytes, and its
  optimizer an fp32 main copy (4 bytes more, counted under optimizer);
* gradients: fp32, 4 bytes per parameter, divided by W with FSDP2, by M on megatron;
* optimizer: AdamW's two fp32 moments, 8 bytes per parameter (``optimizer: sgd``: its momentum
  buffer, 4 bytes; none with ``sgd_momentum`` 0), 4 more with megatron's bf16 main params, divided by W with FSDP2, by M on megatron (and by its DP size with
  ``use_distributed_optimizer``);
* reference: a frozen copy in the frozen dtype (``plan.frozen_dtype``: 2 bytes per parameter in
  bf16, 4 in fp32), divided by M (it takes the actor's layout), when the stage uses one; 0 with
  ``rl_config.offload_reference`` (it is on the device only during its own log-prob pass);
* the total is the larger of two peaks: the update's and the rollout's. The offload of the
  trained weights, optimizer state and gradients (``generate_config.offload_train_param``,
  ``_optimizer``, ``_grad``) frees them during the rollout only; vLLM's sleep mode (on a GPU)
  frees its copy and KV cache during the update only;
  without it the rollout's copy and cache stay through the update, whose peak then holds all;
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
* rollout copy (on-policy), in the rollout dtype's bytes: with ``rollout_engine: vllm`` vLLM's
  own copy of the weights divided by ``infer_tensor_parallel_size`` (and the KV cache too); else
  on megatron the whole HF copy of the model that each replica's leader (TP rank 0, PP rank 0)
  samples from (counted for every process: an upper bound for the others); else with FSDP2
  the full parameters gathered for the native engine (in the training dtype); else on the hf
  backend in bf16 the native engine's bf16 sampling copy of the fp32 actor (none with LoRA).
* LoRA (``lora_target_modules``): the base weights in the frozen dtype plus the adapter's in
  the trained weights' dtype (both divided by W with FSDP2, by M on megatron), gradients and
  moments (megatron: and main params) for the adapter only,
  no reference with ``rl_config.share_backbone`` (else a frozen copy of base and adapter in the
  frozen dtype), and as the rollout copy the targeted base weights that the merged rollout saves
  while it samples (with FSDP2 plus the gathered base).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from posttrain.config.reward_model import reward_model_arch
from posttrain.config.run import RunConfig
from posttrain.config.target import check_target_memory
from posttrain.errors import ConfigError
from posttrain.models.arch import ModelArch
from posttrain.models.lora import lora_sizes

if TYPE_CHECKING:
    from posttrain.config.plan import Plan

GIB = 1024**3


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
    rollout_copy: float = 0.0  # the rollout's own copy of the weights (vLLM's share, a leader's HF copy, ...)
    rollout_sleeps: bool = False  # vLLM's sleep mode (GPU): its copy and KV cache leave the device for the update
    copy_freed_for_update: bool = False  # the native engine's bf16 copy, freed by a synchronous loop for the update
    off_during_rollout: tuple[str, ...] = ()  # the training parts offloaded while the rollout runs (offload_train_*)

    @property
    def update_peak(self) -> float:
        """On the device during the update: the training state, the frozen models, one micro-batch's
        activations, and the rollout's copy and KV cache unless they sleep (or the copy is freed)."""
        copy = 0.0 if self.copy_freed_for_update else self.rollout_copy
        rollout = 0.0 if self.rollout_sleeps else self.kv_cache + copy
        return (self.weights + self.gradients + self.optimizer + self.reference + self.critic + self.reward_model
                + self.activations + rollout)

    @property
    def rollout_peak(self) -> float:
        """On the device while the rollout runs: the training state not offloaded, the frozen
        models, the rollout's copy and its KV cache."""
        train = sum(getattr(self, part) for part in ("weights", "gradients", "optimizer")
                    if part not in self.off_during_rollout)
        return train + self.reference + self.critic + self.reward_model + self.rollout_copy + self.kv_cache

    @property
    def total(self) -> float:
        """The larger of the two phases' peaks (without sleep mode the update's holds everything)."""
        return max(self.update_peak, self.rollout_peak)


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


def check_memory(cfg: RunConfig, plan: "Plan") -> list[str]:
    """Compare the memory estimate with this machine's memory when the run executes here (on the
    CPU, workers not sent to a Ray cluster): above it, a warning; above twice it, a ConfigError
    unless ``rl_config.ignore_memory_estimate``. A plan for a target (``posttrain plan --target``)
    compares it with the target's device instead (:func:`posttrain.config.target.check_target_memory`)."""
    if plan.target is not None:  # posttrain plan --target: the target's devices, not this machine
        return check_target_memory(cfg, plan, plan.target, rollout_fits=check_rollout_fits)
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
    import torch  # lazy: keeps this config module free of torch

    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    return None


def check_rollout_fits(plan: "Plan") -> None:
    """The rollout's copy of the model must fit one device (the target's with ``posttrain plan
    --target``, else this machine's, :func:`device_memory_bytes`): the megatron backend's native rollout
    holds the whole model (in the rollout dtype) on each replica's leader; vLLM holds 1/``infer_tensor_parallel_size``
    of it (in the rollout dtype) on each of its ranks. Refuse a copy that no device holds, naming
    the key that changes it."""
    if plan.memory is None or not plan.memory.rollout_copy:
        return
    vllm = plan.rollout is not None and plan.rollout.vllm is not None
    if not vllm and plan.parallel.backend != "megatron":
        return
    available = plan.target.memory_bytes if plan.target is not None else device_memory_bytes(plan.device)
    if not available or plan.memory.rollout_copy <= available:
        return
    copy = f"{plan.memory.rollout_copy / GIB:,.1f} GiB of weights do not fit one device ({available / GIB:,.1f} GiB)"
    ignore = "or set rl_config.ignore_memory_estimate: true to run anyway"
    if vllm:
        tp = plan.rollout.vllm.tensor_parallel_size
        raise ConfigError(f"the vLLM rollout holds 1/{tp} of the model per device "
                          f"(generate_config.infer_tensor_parallel_size={tp}) in {plan.rollout_dtype}: {copy}; raise "
                          f"generate_config.infer_tensor_parallel_size (it must divide the attention heads and the "
                          f"devices), {ignore}")
    raise ConfigError(
        f"the native rollout samples from a whole copy of the model in one process (the first rank of each "
        f"data-parallel replica): {copy}. A model larger than one device needs a rollout sharded over devices: set "
        f"rl_config.rollout_engine: vllm with generate_config.infer_tensor_parallel_size, or train a smaller model, "
        f"or use backend megatron for an offline stage (sft, dpo), {ignore}")


def rollout_layout(plan: "Plan") -> str:
    """Where the rollout runs, in words (``posttrain plan``'s parallel layout)."""
    par = plan.parallel
    samplers = "every worker" if par.backend == "hf" else "the leader of each data-parallel replica"
    if plan.rollout is not None and plan.rollout.vllm is not None:
        tp = plan.rollout.vllm.tensor_parallel_size
        return (f"vLLM, {par.dp} engine(s) ({samplers}), each tensor parallel {tp}, {plan.rollout_dtype}; the "
                f"weights are streamed in one decoder layer at a time after each update and proven by the sync probe")
    copy = ("its own model object" if par.backend == "hf"
            else f"a whole {plan.rollout_dtype} HF copy of the model, synced one layer at a time")
    return f"native engine, {par.dp} process(es) ({samplers}) sampling from {copy}"


def _optimizer_bytes(role) -> int:
    """Bytes of optimizer state per trained parameter: AdamW's two fp32 moments, SGD's momentum buffer."""
    if role.optimizer == "sgd":
        return 4 if role.sgd_momentum > 0 else 0
    return 8


def estimate_memory(cfg: RunConfig, plan: "Plan", arch: ModelArch) -> MemoryEstimate:
    """A first-order estimate per worker process, for the layout that runs (the formulas are in
    this module's docstring)."""
    a, par = cfg.actor, plan.parallel
    params = float(arch.num_params())
    megatron = par.backend == "megatron"
    split = par.tp * par.pp if megatron else 1  # M: the model's split over ranks
    # a rank holds 1/M of the dense part and 1/(M x EP) of the experts
    ep_saving = arch.expert_params() / split * (1 - 1 / par.ep) if megatron else 0.0
    fsdp = plan.workers > 1 and plan.sharding == "fsdp2" and not megatron
    shard = params / plan.workers if fsdp else params / split - ep_saving
    bf16_main = megatron and plan.train_dtype == "bfloat16"  # Float16Module: bf16 weights, fp32 main params
    weight_bytes, optimizer_bytes = 2 if bf16_main else 4, _optimizer_bytes(a) + (4 if bf16_main else 0)
    optimizer = optimizer_bytes * shard / (par.dp if megatron and par.use_distributed_optimizer else 1)
    critic = value_model_params(arch) / split - ep_saving
    s, b, h = plan.max_tokens_per_sequence, plan.micro_batch_size, arch.hidden_size
    per_layer = 2 * s * b * h if a.recompute_granularity == "full" else s * b * h * 34
    activations = arch.num_layers * per_layer + s * b * arch.vocab_size * 4
    rollout_copy, kv, vllm_tp = _rollout_parts(plan, arch, params, megatron=megatron, fsdp=fsdp)
    frozen_bytes = 2 if plan.frozen_dtype == "bfloat16" else 4
    on_policy = plan.stage.on_policy
    rm_arch = reward_model_arch(cfg) if plan.reward_model is not None else None
    rm_bytes = 2 if plan.reward_model is not None and plan.reward_model.dtype == "bfloat16" else 4
    weights, trained = weight_bytes * shard, 4 * shard
    own = plan.separated.devices  # roles in worker groups of their own are not in the actor's workers
    uses_reference = plan.uses_reference and not cfg.rl.offload_reference and "reference" not in own
    reference = frozen_bytes * (params / split - ep_saving) if uses_reference else 0.0
    if plan.lora:  # LoRA: a frozen base, gradients and moments for the adapter only
        adapter, targeted = (float(n) for n in lora_sizes(arch, a.lora_target_modules, int(a.lora_r)))
        shards = plan.workers if fsdp else split  # FSDP2 shards the frozen base too; megatron splits it by M
        weights = (frozen_bytes * params + weight_bytes * adapter) / shards
        trained = 4 * adapter / shards
        optimizer = optimizer_bytes * adapter / shards / (par.dp if megatron and par.use_distributed_optimizer else 1)
        if cfg.rl.share_backbone:
            reference = 0.0
        elif reference and not megatron:  # hf: a frozen copy of the PEFT model, adapter and all
            reference = frozen_bytes * (params + adapter)
        if on_policy and not vllm_tp and not megatron:  # megatron streams the merged weights to its copy
            merge_copy = frozen_bytes * targeted  # the targeted base weights, saved while the rollout samples
            rollout_copy = merge_copy + (frozen_bytes * params if fsdp else 0.0)
    on_device = not plan.device.startswith("cpu")
    weights_off = bool(plan.rollout and plan.rollout.offload_weights) and on_device
    # the loop frees an HF/FSDP2 actor's gradients after each update (OnPolicyTrainer.release_gradients; in
    # Ray workers through ActorRole), and the native engine's bf16 copy before it (drop_sampling_weights); a
    # pipelined rollout runs through the update, Megatron's buffers stay
    freed = on_policy and not megatron and not plan.off_policy.pipelined
    off = tuple(part for part, on in (("weights", weights_off), ("optimizer", plan.offload_optimizer),
                                      ("gradients", plan.offload_grads or freed)) if on)
    return MemoryEstimate(weights=weights, gradients=trained, optimizer=optimizer, reference=reference,
                          critic=16 * critic if plan.uses_critic and "critic" not in own else 0.0, activations=activations, kv_cache=kv,
                          reward_model=rm_bytes * value_model_params(rm_arch) if rm_arch is not None
                          and "reward" not in own else 0.0,
                          rollout_copy=rollout_copy, off_during_rollout=off,
                          copy_freed_for_update=freed and not (vllm_tp or fsdp or plan.lora),
                          rollout_sleeps=bool(vllm_tp) and on_policy and on_device)


def _rollout_parts(plan: "Plan", arch: ModelArch, params: float, *, megatron: bool,
                   fsdp: bool) -> tuple[float, float, int]:
    """(rollout copy, KV cache, vLLM's tensor-parallel size or 0) of :func:`estimate_memory`."""
    par = plan.parallel
    seqs = min(plan.responses_per_iteration // par.dp, plan.rollout.max_num_seqs) if plan.rollout else 0
    rollout_bytes = 2 if plan.rollout_dtype == "bfloat16" else 4
    vllm_tp = plan.rollout.vllm.tensor_parallel_size if plan.rollout and plan.rollout.vllm else 0
    kv = seqs * plan.max_tokens_per_sequence * arch.kv_cache_bytes_per_token(rollout_bytes)
    if not plan.stage.on_policy:
        return 0.0, kv, vllm_tp
    if vllm_tp:  # vLLM's own copy, split over its tensor-parallel ranks
        return rollout_bytes * params / vllm_tp, kv / vllm_tp, vllm_tp
    if megatron:  # the leader's whole HF copy
        return rollout_bytes * params, kv, 0
    if fsdp:  # the native engine samples from the full parameters, gathered for it
        return (2 if plan.train_dtype == "bfloat16" else 4) * params, kv, 0
    return (2 * params if rollout_bytes == 2 and not plan.lora else 0.0), kv, 0  # the native engine's bf16 copy

def value_model_params(arch: ModelArch) -> float:
    """Parameters of a sequence-classification model on ``arch`` (critic, reward model): no LM head
    (untied: V x h fewer), a score head (h)."""
    return float(arch.num_params()) - (0 if arch.tie_embeddings else arch.vocab_size * arch.hidden_size) \
        + arch.hidden_size
