"""The plan's memory estimate per worker process, and its comparison with the machine.

:func:`estimate_memory` gives first-order bytes per worker for the layout that runs (formulas in
its docstring); :func:`check_memory` compares them with this machine when the run executes here,
and :func:`check_rollout_fits` refuses a rollout copy that no device holds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from posttrain.config.reward_model import reward_model_arch
from posttrain.config.run import RunConfig
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
    rollout_copy: float = 0.0  # megatron: the whole model in HF layout for the native rollout (replica leaders)

    @property
    def total(self) -> float:
        return (self.weights + self.gradients + self.optimizer + self.reference + self.critic
                + self.activations + self.kv_cache + self.reward_model + self.rollout_copy)


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
    unless ``rl_config.ignore_memory_estimate``."""
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
    """The megatron backend's native rollout holds the whole model in one process: refuse a model
    whose HF copy alone does not fit one device (it needs a rollout engine sharded over devices);
    with vLLM, a model whose share per vLLM device does not fit one."""
    if plan.memory is None or not plan.memory.rollout_copy or plan.parallel.backend != "megatron":
        return
    available = device_memory_bytes(plan.device)
    if available and plan.memory.rollout_copy > available and plan.rollout.vllm is not None:
        raise ConfigError(
            f"the vLLM rollout holds 1/generate_config.infer_tensor_parallel_size of the model on each of its "
            f"devices: {plan.memory.rollout_copy / GIB:,.1f} GiB of weights do not fit one device "
            f"({available / GIB:,.1f} GiB); raise infer_tensor_parallel_size (now "
            f"{plan.rollout.vllm.tensor_parallel_size}), or set rl_config.ignore_memory_estimate: true to run anyway")
    if available and plan.memory.rollout_copy > available:
        raise ConfigError(
            f"the native rollout samples from a whole copy of the model in one process (the first rank of each "
            f"data-parallel replica): {plan.memory.rollout_copy / GIB:,.1f} GiB of weights do not fit one device "
            f"({available / GIB:,.1f} GiB). A model larger than one device needs a rollout engine sharded over "
            f"devices: rl_config.rollout_engine: vllm with generate_config.infer_tensor_parallel_size; or "
            f"train a smaller model, or use backend megatron for an offline stage (sft, dpo), or set "
            f"rl_config.ignore_memory_estimate: true to run anyway")


def estimate_memory(cfg: RunConfig, plan: "Plan", arch: ModelArch) -> MemoryEstimate:
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
      (counted for every process: an upper bound for the others); vLLM (``rollout_engine: vllm``)
      holds the model in the rollout dtype split over ``infer_tensor_parallel_size`` processes (one
      device each): its share per device.
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
    seqs = min(plan.responses_per_iteration // par.dp, plan.rollout.max_num_seqs) if plan.rollout else 0
    rollout_copy = 4 * params if plan.stage.on_policy and par.backend == "megatron" else 0.0
    if rollout_copy and plan.rollout.vllm is not None:  # vLLM's share of the model on one of its devices
        rollout_copy = (2 if plan.rollout_dtype == "bfloat16" else 4) * params / plan.rollout.vllm.tensor_parallel_size
    kv = seqs * plan.max_tokens_per_sequence * arch.kv_cache_bytes_per_token(2 if plan.rollout_dtype == "bfloat16"
                                                                             else 4)
    rm_arch = reward_model_arch(cfg) if plan.reward_model is not None else None
    rm_bytes = 2 if plan.reward_model is not None and plan.reward_model.dtype == "bfloat16" else 4
    weights, trained = shard, shard
    reference = params / split - ep_saving if plan.uses_reference and not cfg.rl.offload_reference else 0.0
    if plan.lora:  # LoRA: gradients and moments for the adapter only
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
