"""The batch plan a config implies, and a memory estimate per device, without loading weights.

Vocabulary (as the seed): ``global_batch_size`` (gbs) and ``mini_batch_size`` count prompts;
``micro_batch_size`` counts sequences (responses); ``n`` is ``n_samples_per_prompt``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.config.run import RunConfig
from posttrain.config.validate import Layout
from posttrain.models.arch import ModelArch

GIB = 1024**3


@dataclass
class MemoryEstimate:
    """Bytes per device for the actor. Formulas in :func:`estimate_memory`."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    kv_cache: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.kv_cache


@dataclass
class Plan:
    stage: str
    num_devices: int
    prompts_per_iteration: int
    responses_per_iteration: int
    prompts_per_update: int
    mini_batches_per_iteration: int
    optimizer_steps_per_iteration: int
    responses_per_mini_batch: int
    responses_per_mini_batch_per_dp: int
    micro_batch_size: int
    grad_accumulation_steps: int
    actor_dp: int
    infer_dp: int
    tp: int
    pp: int
    cp: int
    infer_tp: int
    max_prompt_length: int
    max_response_tokens: int
    max_tokens_per_sequence: int
    max_tokens_per_iteration: int
    train_iters: int | None
    total_prompts: int | None
    dispatch_sizes: dict[str, int] = field(default_factory=dict)
    arch: ModelArch | None = None
    num_params: int | None = None
    memory: MemoryEstimate | None = None


def build_plan(cfg: RunConfig, layout: Layout, arch: ModelArch | None) -> Plan:
    a, rl, gen = cfg.actor, cfg.rl, cfg.generate
    n = rl.n_samples_per_prompt if cfg.stage not in ("dpo", "sft") else 1
    gbs = a.global_batch_size
    mini = rl.mini_batch_size if cfg.stage not in ("dpo", "sft") else gbs
    # DAPO's dynamic sampling updates on filter_groups_train_batch_size prompts, not on gbs
    filtering = cfg.stage == "dapo" and rl.filter_groups_enable
    update_prompts = rl.filter_groups_train_batch_size if filtering else gbs
    mini_batches = update_prompts // mini
    per_dp = mini * n // layout.actor_dp
    max_resp = gen.sampling_config.max_tokens if cfg.stage not in ("dpo", "sft") else 0
    max_prompt = rl.max_prompt_length - 1 if cfg.stage not in ("dpo", "sft") else a.seq_length
    per_seq = min(a.seq_length, max_prompt + max_resp) if max_resp else a.seq_length
    dispatch = {k: getattr(rl, k) for k in type(rl).model_fields
                if k.endswith("_dispatch_size") and getattr(rl, k) is not None}
    plan = Plan(
        stage=cfg.stage, num_devices=layout.num_devices,
        prompts_per_iteration=gbs, responses_per_iteration=gbs * n, prompts_per_update=update_prompts,
        mini_batches_per_iteration=mini_batches, optimizer_steps_per_iteration=mini_batches * rl.epochs,
        responses_per_mini_batch=mini * n, responses_per_mini_batch_per_dp=per_dp,
        micro_batch_size=a.micro_batch_size, grad_accumulation_steps=per_dp // a.micro_batch_size,
        actor_dp=layout.actor_dp, infer_dp=layout.infer_dp,
        tp=a.tensor_model_parallel_size, pp=a.pipeline_model_parallel_size, cp=a.context_parallel_size,
        infer_tp=gen.infer_tensor_parallel_size, max_prompt_length=max_prompt, max_response_tokens=max_resp,
        max_tokens_per_sequence=per_seq, max_tokens_per_iteration=gbs * n * per_seq,
        train_iters=a.train_iters, total_prompts=a.train_iters * gbs if a.train_iters else None,
        dispatch_sizes=dispatch, arch=arch,
    )
    if arch is not None:
        plan.num_params = arch.num_params()
        plan.memory = estimate_memory(cfg, plan, arch)
    return plan


def estimate_memory(cfg: RunConfig, plan: Plan, arch: ModelArch) -> MemoryEstimate:
    """A first-order estimate per device.

    * weights: P/(TP*PP) x 2 bytes in bf16 (4 in fp32);
    * gradients: fp32 main grads, 4 bytes per parameter shard;
    * optimizer: AdamW moments (8 bytes) plus an fp32 master copy in bf16 (4 bytes), divided by DP
      when use_distributed_optimizer;
    * activations for one micro-batch (Korthikanti et al. 2022): per layer s*b*h*34 bytes with flash
      attention (plus 5*a*s^2*b without it), divided by TP; full recompute keeps 2*s*b*h per layer;
      plus fp32 logits s*b*V*4/TP;
    * KV cache for rollout: the responses one inference DP rank decodes at once (at most max_num_seqs),
      times tokens per sequence, times 2 x layers x kv_heads x head_dim x 2 bytes, divided by infer TP.
    """
    a, gen = cfg.actor, cfg.generate
    shard = plan.num_params / (plan.tp * plan.pp)
    bf16 = a.bf16
    weights = shard * (2 if bf16 else 4)
    grads = shard * 4
    optim = shard * (12 if bf16 else 8)
    if a.use_distributed_optimizer:
        optim /= plan.actor_dp
    s, b, h = plan.max_tokens_per_sequence / plan.cp, plan.micro_batch_size, arch.hidden_size
    layers_here = arch.num_layers / plan.pp
    if a.recompute_granularity == "full":
        per_layer = 2 * s * b * h
    else:
        per_layer = s * b * h * 34 / plan.tp
        if not a.use_flash_attn:
            per_layer += 5 * arch.num_attention_heads * s * s * b / plan.tp
    activations = layers_here * per_layer + s * b * arch.vocab_size * 4 / plan.tp
    seqs = min(plan.responses_per_iteration // max(plan.infer_dp, 1), max(gen.max_num_seqs, 1))
    kv = seqs * plan.max_tokens_per_sequence * arch.kv_cache_bytes_per_token(2) / plan.infer_tp
    return MemoryEstimate(weights=weights, gradients=grads, optimizer=optim, activations=activations, kv_cache=kv)
