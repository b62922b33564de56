"""``megatron_training`` / ``actor_config`` / ``ref_config`` / ``reward_config`` / ``critic_config``.

Every key the seed's MegatronConfig knows, with its default and its status (:mod:`posttrain.config.fields`):
honoured, refused (a feature posttrain does not have yet: :func:`posttrain.config.features.check_features`
raises), or ignored (no effect on this hardware: one start-up warning,
:func:`posttrain.config.features.startup_warnings`). Architecture keys describe the model: they feed
``posttrain plan`` and ``posttrain init-model``; a run that starts from a Hugging Face directory takes the
architecture from its ``config.json``.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from posttrain.config.fields import (ARCH_WHY, DEVICES, HONOURED, F, Rule, Section, Status, field_rule, ignored,
                                     refused)

Opt = Optional
MP_NOTE = "1 means no model parallelism"
BACKENDS = Literal["hf", "megatron"]
CKPT_FORMATS = Literal["torch_dist", "torch"]  # posttrain.training.megatron.checkpoint.FORMATS

HF = "posttrain trains Hugging Face models with PyTorch kernels"
# describes the model: posttrain.models.arch reads it into the model init-model builds and plan sizes
# (tests/unit/docs/test_reference_claims.py changes each such key and checks that the model changes)
ARCH = Rule(Status.HONOURED, ARCH_WHY)
MCORE = ignored("the backend key picks the model classes (megatron: Megatron-Core GPTModel; hf: Hugging Face models)")
SPEC = ignored(f"{HF}; Megatron layer specs are not used", active="set")
KERNEL = ignored(f"a Megatron/MindSpeed kernel switch; {HF}")
ASCEND = ignored("Ascend NPUs only")
MEGATRON_MEM = ignored("a Megatron/MindSpeed memory or communication optimisation; posttrain does not implement it "
                       "(the numerics are the same)")
MEGATRON_MEM_SET = ignored("a Megatron/MindSpeed memory or communication optimisation; posttrain does not "
                           "implement it (the numerics are the same)", active="set")
PARALLEL_LAYOUT = ignored("a Megatron/MindSpeed rank-order or ring-attention option the megatron backend does "
                          "not read (it keeps Megatron-Core's rank order; context parallel sizes > 1 are refused)")
MOE_KERNEL = ignored("a Megatron/MindSpeed MoE kernel switch: the megatron backend runs the experts one after the "
                     "other (Megatron-Core's SequentialMLP) and dispatches tokens by all-gather (the same numerics); "
                     "the hf backend runs the Hugging Face model's experts")
MOE_KERNEL_SET = ignored("a Megatron/MindSpeed MoE kernel switch: the megatron backend runs the experts one after "
                         "the other (Megatron-Core's SequentialMLP) and dispatches tokens by all-gather (the same "
                         "numerics); the hf backend runs the Hugging Face model's experts", active="set")
PP_LAYOUT = ignored("the megatron backend splits the layers evenly over the pipeline stages (uneven or padded stages "
                    "are not built yet)", active="set")
CP_ALGO = ignored("only matters with context parallelism (context_parallel_size > 1 is refused)")
SEQ_PARALLEL = ignored("only matters with tensor parallelism, on the megatron backend (which honours it there)",
                       megatron=True, megatron_with="tensor_model_parallel_size")
FLASH = ignored("attention always runs through PyTorch sdpa, which picks flash kernels on CUDA by itself; "
                "there are none on CPU", devices=("cpu",))
SOFTMAX_FP32 = ignored("sdpa keeps the softmax in fp32 whatever the key says", ok=(True,))
DROPOUT = ignored("dropout comes from the model's Hugging Face config.json (0 for the shipped models)",
                  ok=(0.0,))
INIT_STD = ignored("new weights are initialised by the Hugging Face model (its initializer_range)")
AUX_LOSS = ignored("backend hf: the MoE router load-balancing loss is not added (Hugging Face MoE models train "
                   "without router logits); the megatron backend adds it as Megatron-Core does", megatron=True)
LOSS_SCALE = ignored("posttrain trains in fp32 or bf16, never fp16, so there is no loss scaling")
DIST_OPT = ignored("backend hf: one process has nothing to shard; Ray workers shard optimizer state with "
                   "rl_config.ray_sharding: fsdp2 (the megatron backend refuses it on a CPU: Megatron-Core's "
                   "distributed optimizer needs CUDA buffers)", megatron=True)
NAN_CHECK = ignored("the NaN check of loss and gradients always runs (a NaN stops the run)")
BACKEND = ignored("torch.distributed uses gloo on CPU and nccl on CUDA", active="backend")
MASK_TYPE = ignored("attention is always causal", ok=("causal",))
POSITIONS = ignored("packed rows (use_remove_padding) always restart positions per sequence")
RECOMPUTE_DETAIL = ignored("backend hf: activation checkpointing (recompute_granularity) covers every layer",
                           active="set", megatron=True)
EVAL = ignored("Megatron's validation-split evaluation is not run; RL stages evaluate with rl_config.eval_data_path "
               "and rl_config.eval_interval")
LOG_INTERVAL = ignored("metrics are logged every iteration")
LOG_THROUGHPUT = ignored("throughput metrics (e2e_tps, update_tps) are always logged")
DATALOADER = ignored("batches are read by the training process itself (no Megatron data loader)")
INSTRUCTION = ignored("the stage picks the dataset (sft reads instruction data, dpo pairwise data)")
PADDING = ignored("batches are padded to their longest sequence, never to seq_length", ok=(True,))
MEGATRON_INFERENCE = ignored("Megatron inference switches; rollout sampling is set by generate_config.sampling_config")
SLOW_TOKENIZER = ignored("the fast Hugging Face tokenizer is always used")
PADDING_SIDE = ignored("posttrain pads batches itself; the tokenizer's padding side is not used")
SHARED_STORAGE = ignored("checkpoints are written by one process (rank 0) to megatron_training.save")
CKPT_FORMAT = ignored("the hf backend saves Hugging Face directories; only the megatron backend writes Megatron "
                      "checkpoints", megatron=True)
LOOSE_LOAD = ignored("checkpoints always load strictly (a missing key is an error)")

# TP, PP and virtual stages select the megatron backend (posttrain.config.backend); only an explicit
# `backend: hf` meets these refusals
MP_WHY = "tensor/pipeline/expert parallelism needs backend megatron, and backend is hf (data parallel only)"
MODEL_PARALLEL = refused(MP_WHY, "set it to 1, or remove backend: hf (null picks megatron)", active="gt1",
                         group="model parallelism", megatron=True)
VPP = refused(MP_WHY, "remove the key, or remove backend: hf (null picks megatron)", active="set",
              group="model parallelism", megatron=True)
CONTEXT_PARALLEL = refused("context parallelism is not verified on the megatron backend yet",
                           "set context_parallel_size 1", active="gt1")
BUILT = ("posttrain's models are Hugging Face Llama, Qwen2, Qwen3, Qwen3-MoE and DeepSeek-V3 models: "
         "RMSNorm, a SwiGLU MLP, rotary position embeddings, no bias but the QKV projection's (add_qkv_bias)")
NO_BIAS = refused(f"{BUILT}; bias on every linear layer (Megatron's default) is not built",
                  "set it to true, as the seed's model yamls do", ok=(True,), explicit=True)
ATTENTION_BIAS = refused(f"{BUILT}; bias on every attention projection (the output's too) is not built",
                         "remove the key (add_qkv_bias puts bias on the QKV projection)", explicit=True)
ROPE = refused(f"{BUILT}; other position embeddings are not built", "set it to rope", ok=("rope",), explicit=True)
ROPE_SWITCH = refused(f"{BUILT}; other position embeddings are not built", "set it to true", ok=(True,),
                      explicit=True)
RMSNORM = refused(f"{BUILT}; LayerNorm is not built", "set it to RMSNorm", ok=("RMSNorm",), explicit=True)
SWIGLU = refused(f"{BUILT}; a GeLU MLP is not built", "set it to true", ok=(True,), explicit=True)
EXTRA_IDS = refused("extra sentinel ids (T5-style <extra_id_N> tokens) are not added: the vocabulary is the "
                    "tokenizer's (init-model trains it, tokenizer_vocab_size), padded by make_vocab_size_divisible_by",
                    "remove the key or set it to 0")
PACKING = ignored("packed rows (use_remove_padding) always attend within their own sequence, and without packing "
                  "there is nothing to reset; attention across the sequences of a row is not built (the seed "
                  "refuses false with remove padding too, its rule 6)", ok=(True,))
EXPERT_PARALLEL = MODEL_PARALLEL  # experts split over ranks (mixture-of-experts models)
LORA = HONOURED  # the hf backend's LoRA through PEFT (posttrain.models.lora); refused on megatron
LORA_KERNEL = ignored("MindSpeed's fused CCLoRA kernels; PEFT's LoRA layers compute the same")
AI_FRAMEWORK = refused("posttrain runs on PyTorch only", "remove the key")
TOKENIZER_TYPE = refused("posttrain builds PretrainedFromHF (HuggingFaceTokenizer), GPT2BPETokenizer (vocab_file + "
                         "merge_file) and SentencePieceTokenizer (tokenizer_model)", "set it to PretrainedFromHF (a Hugging "
                         "Face tokenizer directory), GPT2BPETokenizer or SentencePieceTokenizer",
                         ok=(None, "PretrainedFromHF", "HuggingFaceTokenizer", "GPT2BPETokenizer",
                             "SentencePieceTokenizer"))
MULTIMODAL_MODEL = refused("posttrain reads the vision-language model from its Hugging Face directory "
                           "(actor_config.load / tokenizer_name_or_path), not from MindSpeed-MM's model json",
                           "remove the key", active="set")
VISION_MODEL = HONOURED  # the model yaml's tower sizes: init-model and the plan's parameter count read them


class MegatronConfig(Section):
    # ---- architecture (usually from configs/model/<name>.yaml) -----------------------------------
    model: Opt[str] = F(None, "model yaml name whose architecture keys this section takes first", HONOURED)
    hf_model_type: Opt[str] = F(None, "posttrain: HF model_type of a random-init model (qwen2, qwen3, qwen3_moe, "
                                      "llama; deepseek_v3 with multi_latent_attention)", ARCH)
    tokenizer_vocab_size: Opt[int] = F(None, "posttrain: vocab size of the tokenizer init-model trains", HONOURED,
                                       ge=1)
    vision_tower: Opt[dict] = F(None, "posttrain: a vision-language model's vision tower sizes (hf_model_type "
                                      "qwen2_5_vl; init-model builds it)", VISION_MODEL)
    use_mcore_models: bool = F(False, "Megatron-Core model classes", MCORE)
    spec: Any = F(None, "Megatron layer spec", SPEC)
    num_layers: Opt[int] = F(None, "transformer layers", ARCH, ge=1)
    hidden_size: Opt[int] = F(None, "hidden size", ARCH, ge=1)
    ffn_hidden_size: Opt[int] = F(None, "MLP intermediate size", ARCH, ge=1)
    num_attention_heads: Opt[int] = F(None, "attention heads", ARCH, ge=1)
    kv_channels: Opt[int] = F(None, "head dimension (default hidden/heads)", ARCH, ge=1)
    group_query_attention: bool = F(False, "grouped-query attention", ARCH)
    num_query_groups: int = F(1, "KV heads when group_query_attention", ARCH, ge=1)
    untie_embeddings_and_output_weights: bool = F(False, "separate output projection", ARCH)
    add_qkv_bias: bool = F(False, "bias on the QKV projection (Qwen2)", ARCH)
    disable_bias_linear: bool = F(False, "no bias on other linear layers", NO_BIAS)
    attention_bias: bool = F(False, "bias on attention projections", ATTENTION_BIAS)
    qk_layernorm: bool = F(False, "RMSNorm on queries and keys (Qwen3)", ARCH)
    position_embedding_type: str = F("learned_absolute", "rope or learned_absolute", ROPE)
    use_rotary_position_embeddings: bool = F(False, "RoPE", ROPE_SWITCH)
    rotary_base: float = F(10000, "RoPE theta", ARCH, gt=0, finite=True)
    max_position_embeddings: Opt[int] = F(None, "maximum positions", ARCH, ge=1)
    rope_scaling_type: Opt[str] = F(None, "RoPE scaling (llama3, yarn): the HF rope_scaling of the model built", ARCH)
    rope_scaling_factor: float = F(1.0, "RoPE scaling factor (with rope_scaling_type)", ARCH, gt=0, finite=True)
    low_freq_factor: Opt[float] = F(None, "llama3 RoPE scaling", ARCH, gt=0, finite=True)
    high_freq_factor: Opt[float] = F(None, "llama3 RoPE scaling", ARCH, gt=0, finite=True)
    original_max_position_embeddings: Opt[int] = F(None, "llama3 RoPE scaling: the pre-training context", ARCH, ge=1)
    beta_fast: float = F(32, "yarn", ARCH)
    beta_slow: float = F(1, "yarn", ARCH)
    rope_scaling_mscale: float = F(1.0, "yarn", ARCH)
    rope_scaling_mscale_all_dim: float = F(0.0, "yarn", ARCH)
    rope_scaling_original_max_position_embeddings: Opt[int] = F(None, "yarn: the pre-training context", ARCH, ge=1)
    normalization: str = F("LayerNorm", "LayerNorm or RMSNorm", RMSNORM)
    norm_epsilon: float = F(1e-5, "norm epsilon", ARCH, gt=0, finite=True)
    swiglu: bool = F(False, "SwiGLU MLP", SWIGLU)
    attention_dropout: float = F(0.1, "attention dropout", DROPOUT)
    hidden_dropout: float = F(0.1, "hidden dropout", DROPOUT)
    init_method_std: float = F(0.02, "init std", INIT_STD)
    make_vocab_size_divisible_by: int = F(128, "pad the vocabulary to a multiple of this", HONOURED, ge=1)
    padded_vocab_size: Opt[int] = F(None, "padded vocabulary size", ARCH, ge=1)
    vocab_extra_ids: int = F(0, "extra vocab ids", EXTRA_IDS, ge=0)
    multi_latent_attention: bool = F(False, "multi-latent attention: the model is DeepSeek-V3 (HF deepseek_v3; refused on the megatron backend)", ARCH)
    qk_pos_emb_head_dim: Opt[int] = F(None, "MLA: query/key features with RoPE per head (default 64)", ARCH, ge=1)
    qk_head_dim: Opt[int] = F(None, "MLA: query/key features without RoPE per head (default kv_channels)", ARCH, ge=1)
    q_lora_rank: Opt[int] = F(None, "MLA: query latent rank (null: a full query projection)", ARCH, ge=1)
    kv_lora_rank: Opt[int] = F(None, "MLA: key-value latent rank (needed with MLA)", ARCH, ge=1)
    v_head_dim: Opt[int] = F(None, "MLA: value features per head (default kv_channels)", ARCH, ge=1)
    # ---- MoE ------------------------------------------------------------------------------------
    num_experts: Opt[int] = F(None, "MoE experts", ARCH, ge=1)
    n_shared_experts: Opt[int] = F(None, "MoE shared experts (DeepSeek-V3 only)", ARCH, ge=0)
    moe_ffn_hidden_size: Opt[int] = F(None, "expert MLP size", ARCH, ge=1)
    moe_router_topk: int = F(2, "experts per token", ARCH, ge=1)
    moe_grouped_gemm: bool = F(False, "Megatron MoE kernel", MOE_KERNEL)
    moe_permutation_async_comm: bool = F(False, "Megatron MoE kernel", MOE_KERNEL)
    moe_tp_extend_ep: bool = F(False, "Megatron MoE layout (TP extends EP; refused on the megatron backend)",
                               PARALLEL_LAYOUT)
    moe_alltoall_overlap_comm: bool = F(False, "Megatron MoE kernel", MOE_KERNEL)
    use_fused_moe_token_permute_and_unpermute: bool = F(False, "Megatron MoE kernel", MOE_KERNEL)
    moe_token_dispatcher_type: Opt[str] = F(None, "Megatron MoE token dispatcher (alltoall, allgather)",
                                            MOE_KERNEL_SET)
    seq_aux: bool = F(False, "MoE aux loss per sequence", AUX_LOSS)
    first_k_dense_replace: Opt[int] = F(None, "dense layers before MoE (HF Qwen3-MoE: mlp_only_layers)", ARCH, ge=0)
    moe_layer_freq: Opt[int] = F(None, "MoE layer frequency: layer i has experts when i % freq == 0 (Qwen3-MoE; 1 for DeepSeek-V3)", ARCH, ge=1)
    moe_router_load_balancing_type: str = F("aux_loss", "router balancing", AUX_LOSS)
    moe_router_num_groups: Opt[int] = F(None, "router groups (DeepSeek-V3 only)", ARCH, ge=1)
    moe_router_group_topk: Opt[int] = F(None, "router group top-k (DeepSeek-V3 only)", ARCH, ge=1)
    moe_router_topk_scaling_factor: Opt[float] = F(None, "routing weights scale (DeepSeek-V3 only)", ARCH, gt=0, finite=True)
    norm_topk_prob: bool = F(False, "normalise top-k probabilities", ARCH)
    moe_router_score_function: str = F("softmax", "router score: softmax (Qwen3-MoE) or sigmoid (DeepSeek-V3)", ARCH)
    moe_router_enable_expert_bias: bool = F(False, "router expert bias (DeepSeek-V3: true)", ARCH)
    moe_aux_loss_coeff: float = F(0.001, "aux loss weight", AUX_LOSS)
    # ---- kernels / fusions ----------------------------------------------------------------------
    sequence_parallel: bool = F(False, "Megatron sequence parallelism (with TP)", SEQ_PARALLEL)
    use_flash_attn: bool = F(False, "flash attention kernels", FLASH)
    use_fused_rmsnorm: bool = F(False, "fused kernel", KERNEL)
    use_fused_swiglu: bool = F(False, "fused kernel", KERNEL)
    use_fused_rotary_pos_emb: bool = F(False, "fused kernel", KERNEL)
    shape_order: str = F("SBH", "Megatron activation layout", KERNEL)
    no_bias_dropout_fusion: bool = F(False, "fused kernel", KERNEL)
    no_masked_softmax_fusion: bool = F(False, "fused kernel", KERNEL)
    attention_softmax_in_fp32: bool = F(False, "attention softmax in fp32", SOFTMAX_FP32)
    no_gradient_accumulation_fusion: bool = F(False, "fused kernel", KERNEL)
    gemm_gradient_accumulation_fusion: bool = F(False, "fused kernel", KERNEL)
    transformer_impl: str = F("local", "Megatron transformer implementation (local, transformer_engine)", KERNEL)
    # ---- precision / optimizer ------------------------------------------------------------------
    bf16: bool = F(True, "bf16 training (hf: autocast; on a CPU only with AMX/AVX512-BF16, else fp32; megatron: "
                         "bf16 weights with fp32 main parameters on CUDA, float32 on a CPU)", HONOURED)
    optimizer: Literal["adam", "sgd"] = F("adam", "adam (AdamW with decoupled weight decay) or sgd (torch.optim.SGD "
                                                  "with sgd_momentum and L2 weight_decay)", HONOURED)
    sgd_momentum: float = F(0.9, "posttrain (Megatron's --sgd-momentum): momentum of optimizer sgd", HONOURED, ge=0,
                            finite=True)
    lr: Opt[float] = F(None, "peak learning rate", HONOURED, gt=0, finite=True, note="the peak learning rate")
    # posttrain.training.optim.lr_decay_styles()
    lr_decay_style: Literal["constant", "linear", "cosine"] = F("linear", "constant, linear or cosine", HONOURED)
    min_lr: float = F(0.0, "final learning rate", HONOURED, ge=0, finite=True)
    weight_decay: float = F(0.01, "weight decay (adam: decoupled, AdamW; sgd: L2)", HONOURED, ge=0, finite=True)
    lr_warmup_fraction: Opt[float] = F(None, "fraction of steps for linear warmup", HONOURED, ge=0, le=1)
    clip_grad: float = F(1.0, "gradient-norm clip", HONOURED, finite=True,
                           note="the gradient-norm clip; 0 or less turns clipping off")
    adam_beta1: float = F(0.9, "Adam beta1", HONOURED, ge=0, lt=1)
    adam_beta2: float = F(0.999, "Adam beta2", HONOURED, ge=0, lt=1)
    initial_loss_scale: float = F(2**32, "fp16 initial loss scale", LOSS_SCALE)
    use_distributed_optimizer: bool = F(False, "Megatron ZeRO-1 optimizer sharding", DIST_OPT)
    overlap_grad_reduce: bool = F(False, "overlap the gradient all-reduce with the backward pass", MEGATRON_MEM)
    overlap_param_gather: bool = F(False, "overlap the parameter all-gather with the forward pass", MEGATRON_MEM)
    accumulate_allreduce_grads_in_fp32: bool = F(False, "all-reduce gradients in fp32", MEGATRON_MEM)
    ddp_bucket_size: Opt[int] = F(None, "Megatron DDP bucket size", MEGATRON_MEM_SET)
    no_check_for_nan_in_loss_and_grad: bool = F(False, "skip the NaN check of loss and gradients", NAN_CHECK)
    reuse_fp32_param: bool = F(False, "MindSpeed: share fp32 master weights with bf16 weights", MEGATRON_MEM)
    swap_optimizer: bool = F(False, "MindSpeed: swap optimizer state to the host", MEGATRON_MEM)
    # ---- parallelism ----------------------------------------------------------------------------
    backend: Opt[BACKENDS] = F(None, "posttrain: training backend: hf (Hugging Face models, PyTorch; data parallel "
                                     "with DDP or FSDP2), megatron (Megatron-Core in Ray worker groups: TP, PP, "
                                     "virtual stages, distributed optimizer), or null: megatron when the actor asks "
                                     "for tensor, pipeline, context or expert parallelism > 1 or virtual pipeline "
                                     "stages, else hf. Reference and critic follow the actor's "
                                     "(posttrain.config.backend)",
                               HONOURED, note="null: megatron when tensor/pipeline/context/expert parallelism is "
                                              "asked, else hf")
    tensor_model_parallel_size: int = F(1, "tensor parallel size (> 1 selects the megatron backend)", MODEL_PARALLEL,
                                        ge=1, note=MP_NOTE)
    pipeline_model_parallel_size: int = F(1, "pipeline parallel size (> 1 selects the megatron backend)",
                                          MODEL_PARALLEL, ge=1, note=MP_NOTE)
    expert_model_parallel_size: int = F(1, "expert parallel size", EXPERT_PARALLEL, ge=1, note=MP_NOTE)
    num_layers_per_virtual_pipeline_stage: Opt[int] = F(None, "layers per virtual pipeline stage (the "
                                                              "interleaved schedule; needs PP > 1; selects the "
                                                              "megatron backend)", VPP, ge=1)
    num_layer_list: Any = F(None, "layers per pipeline stage", PP_LAYOUT)
    noop_layers: Any = F(None, "no-op layers for pipeline balance", PP_LAYOUT)
    context_parallel_size: int = F(1, "context parallel size", CONTEXT_PARALLEL, ge=1, note=MP_NOTE)
    context_parallel_algo: str = F("ulysses_cp_algo", "ulysses_cp_algo or megatron_cp_algo", CP_ALGO)
    attention_mask_type: str = F("causal", "attention mask type (causal)", MASK_TYPE)
    reset_attention_mask: bool = F(True, "per-sequence attention in packed rows (use_remove_padding needs it; "
                                         "posttrain's default: true, with remove padding on; the seed's: false)",
                                   PACKING)
    reset_position_ids: bool = F(False, "per-document positions in packed data", POSITIONS)
    use_cp_send_recv_overlap: bool = F(False, "ring attention: overlap send/recv", PARALLEL_LAYOUT)
    use_fused_ring_attention_update: bool = F(False, "ring attention: fused update kernel", PARALLEL_LAYOUT)
    use_tp_pp_dp_mapping: bool = F(False, "Megatron rank order tp-cp-ep-pp-dp", PARALLEL_LAYOUT)
    distributed_backend: str = F("nccl", "torch.distributed backend", BACKEND)
    use_ascend_coc: bool = F(False, "Ascend-only", ASCEND)
    coc_mode: int = F(-1, "Ascend-only", ASCEND)
    coc_parallel_num: int = F(1, "Ascend-only", ASCEND)
    coc_fused_kernel: bool = F(False, "Ascend-only", ASCEND)
    # ---- recompute ------------------------------------------------------------------------------
    recompute_granularity: Opt[Literal["full", "selective"]] = F(None, "full or selective: activation checkpointing",
                                                                 HONOURED)
    recompute_method: Opt[Literal["uniform", "block"]] = F(None, "uniform or block: which layers recompute",
                                                           RECOMPUTE_DETAIL)
    recompute_num_layers: Opt[int] = F(None, "layers to recompute", RECOMPUTE_DETAIL, ge=1)
    recompute_activation_function: bool = F(False, "MindSpeed: recompute the MLP activation", MEGATRON_MEM)
    swap_attention: bool = F(False, "MindSpeed: swap attention activations to the host", MEGATRON_MEM)
    # ---- data / loop ----------------------------------------------------------------------------
    global_batch_size: Opt[int] = F(None, "prompts per iteration", HONOURED, ge=1, note="prompts per iteration")
    micro_batch_size: Opt[int] = F(None, "sequences per forward/backward", HONOURED, ge=1,
                                     note="sequences per forward/backward")
    seq_length: Opt[int] = F(None, "maximum prompt+response length: checked against generate_config.max_model_len; "
                                     "DPO/SFT samples are cut to it", HONOURED, ge=1, note="tokens")
    train_iters: Opt[int] = F(None, "iterations to run", HONOURED, ge=1, note="iterations to run")
    eval_iters: int = F(100, "Megatron validation-split evaluation iterations", EVAL)
    eval_interval: int = F(1000, "Megatron validation-split evaluation interval", EVAL)
    log_interval: int = F(100, "Megatron log interval", LOG_INTERVAL)
    log_throughput: bool = F(False, "Megatron throughput logging", LOG_THROUGHPUT)
    data_path: Opt[str] = F(None, "indexed dataset prefix", HONOURED)
    split: Opt[str] = F(None, "train,valid,test weights, e.g. 100,0,0", HONOURED)
    dataloader_type: Opt[str] = F(None, "Megatron data loader: single or cyclic", DATALOADER)
    no_shuffle: bool = F(False, "read the dataset in order", HONOURED)
    full_shuffle_instruction_dataset: bool = F(False, "shuffle across epochs as one permutation", HONOURED)
    is_instruction_dataset: bool = F(False, "SFT (instruction) data", INSTRUCTION)
    is_pairwise_dataset: bool = F(False, "DPO/reward-model data", HONOURED)
    variable_seq_lengths: bool = F(False, "do not pad to seq_length", PADDING)
    no_pad_to_seq_lengths: bool = F(False, "do not pad to seq_length", PADDING)
    dataset_additional_keys: list[str] = F([], "extra dataset columns (labels for rule rewards)", HONOURED)
    num_workers: int = F(2, "Megatron data loader workers", DATALOADER)
    seed: int = F(1234, "random seed", HONOURED)
    skip_train: bool = F(False, "no training: evaluate the loaded model on rl_config.eval_data_path and exit "
                                "(no update, no checkpoint; on-policy stages)", HONOURED)
    stage: Opt[str] = F(None, "ray_grpo, ray_dapo, ray_ppo, dpo or sft", HONOURED)
    algorithm: Opt[str] = F(None, "alias of stage", HONOURED)
    do_sample: bool = F(False, "Megatron inference: sampling", MEGATRON_INFERENCE)
    use_kv_cache: bool = F(False, "Megatron inference: KV cache", MEGATRON_INFERENCE)
    npu_deterministic: bool = F(False, "deterministic kernels (torch.use_deterministic_algorithms)", HONOURED)
    enable_high_availability: bool = F(False, "Ascend-only", ASCEND)
    ai_framework: Opt[str] = F(None, "None (PyTorch) or mindspore", AI_FRAMEWORK)
    # ---- tokenizer / templates ------------------------------------------------------------------
    tokenizer_type: Opt[str] = F(None, "PretrainedFromHF (Hugging Face tokenizer), GPT2BPETokenizer (GPT-2 BPE from "
                                       "vocab_file + merge_file) or SentencePieceTokenizer (tokenizer_model; "
                                       "posttrain.data.tokenizer_files)", TOKENIZER_TYPE)
    vocab_file: Opt[str] = F(None, "posttrain (Megatron's --vocab-file): GPT-2 vocab.json of tokenizer_type "
                                   "GPT2BPETokenizer", HONOURED)
    merge_file: Opt[str] = F(None, "posttrain (Megatron's --merge-file): GPT-2 merges.txt of tokenizer_type "
                                   "GPT2BPETokenizer", HONOURED)
    tokenizer_model: Opt[str] = F(None, "posttrain (Megatron's --tokenizer-model): the SentencePiece .model file of "
                                        "tokenizer_type SentencePieceTokenizer", HONOURED)
    tokenizer_name_or_path: Opt[str] = F(None, "HF tokenizer directory (default: the model's)", HONOURED)
    tokenizer_not_use_fast: bool = F(False, "use the slow (Python) tokenizer", SLOW_TOKENIZER)
    tokenizer_padding_side: str = F("right", "tokenizer padding side", PADDING_SIDE)
    prompt_type: Opt[str] = F(None, "chat template name", HONOURED)
    prompt_type_path: str = F("configs/model/templates.json", "chat templates file", HONOURED)
    # ---- checkpoints ----------------------------------------------------------------------------
    load: Opt[str] = F(None, "checkpoint or HF model directory to start from", HONOURED)
    save: Opt[str] = F(None, "checkpoint directory", HONOURED)
    save_interval: Opt[int] = F(None, "save every N iterations (0 or null: only the final save)", HONOURED, ge=0,
                                  note="save every N iterations; 0 or null: only the final save")
    keep_last: Opt[int] = F(None, "posttrain: keep only the newest N checkpoints in save (older iter_* deleted "
                                  "after each save; never the latest); null keeps all", HONOURED, ge=1,
                                note="checkpoints to keep; null keeps all")
    finetune: bool = F(False, "load weights only; start at iteration 0", HONOURED)
    no_load_optim: Opt[bool] = F(None, "do not load the optimizer state", HONOURED)
    no_load_rng: Opt[bool] = F(None, "do not load RNG states", HONOURED)
    no_save_optim: Opt[bool] = F(None, "do not save the optimizer state", HONOURED)
    no_save_rng: Opt[bool] = F(None, "do not save RNG states", HONOURED)
    no_shared_storage: bool = F(False, "nodes do not share storage", SHARED_STORAGE)
    load_checkpoint_loosely: bool = F(False, "load checkpoints allowing missing keys", LOOSE_LOAD)
    pretrained_checkpoint: Opt[str] = F(None, "checkpoint (posttrain's or Megatron's) whose weights only a fresh run "
                                              "starts from (iteration 0, new optimizer and RNG) while load holds no "
                                              "checkpoint to resume", HONOURED)
    ckpt_format: CKPT_FORMATS = F("torch_dist", "posttrain: the megatron backend's checkpoint format (Megatron-LM's "
                                              "--ckpt-format): torch_dist (Megatron-Core dist_checkpointing; reshards "
                                              "on load) or torch (per-rank files; same layout only)", CKPT_FORMAT,
                                  note="the megatron backend's; the hf backend saves Hugging Face directories")
    # ---- DPO ------------------------------------------------------------------------------------
    dpo_loss_type: str = F("sigmoid", "sigmoid, hinge, ipo, kto_pair, orpo (posttrain: reference-free) or kto "
                                      "(posttrain: KTO on unpaired rows, UnpairedPreferenceHandler data)", HONOURED)
    dpo_beta: float = F(0.1, "DPO beta", HONOURED, gt=0, finite=True, note="the seed's default is 0.1")
    dpo_label_smoothing: float = F(0.0, "DPO label smoothing", HONOURED, ge=0, lt=0.5,
                                    note="the probability that a preference label is flipped")
    pref_ftx: float = F(0.0, "SFT loss weight on chosen responses", HONOURED, ge=0, finite=True,
                         note="the weight of the SFT term")
    kto_desirable_weight: float = F(1.0, "posttrain: KTO's lambda_D, the weight of the desirable rows' loss "
                                         "(dpo_loss_type: kto)", HONOURED, gt=0, finite=True,
                                    note="lambda_D; the paper advises lambda_D n_D / (lambda_U n_U) in [1, 4/3]")
    kto_undesirable_weight: float = F(1.0, "posttrain: KTO's lambda_U, the weight of the undesirable rows' loss "
                                           "(dpo_loss_type: kto)", HONOURED, gt=0, finite=True,
                                      note="lambda_U; the paper advises lambda_D n_D / (lambda_U n_U) in [1, 4/3]")
    ref_model: Opt[str] = F("", "reference model path (DPO)", HONOURED)
    refer_model_iter: int = F(1, "DPO: the iteration of ref_model's checkpoint directory the reference loads "
                                 "(posttrain.config.dpo_reference)", HONOURED)
    # ---- LoRA / multimodal ----------------------------------------------------------------------
    lora_r: int = F(8, "LoRA rank", LORA, ge=1, note="the LoRA rank")
    lora_alpha: int = F(16, "LoRA alpha", LORA, gt=0, note="updates scale by lora_alpha / lora_r")
    lora_fusion: bool = F(False, "CCLoRA fused kernels", LORA_KERNEL)
    lora_target_modules: Any = F(None, "LoRA target modules (Megatron names linear_qkv, linear_proj, linear_fc1, "
                                       "linear_fc2, or Hugging Face names such as q_proj); set: LoRA through PEFT",
                                 LORA)
    lora_ckpt_filter: bool = F(False, "save only LoRA weights", LORA)
    mm_model: Opt[str] = F(None, "multimodal model", MULTIMODAL_MODEL)


def ignored_keys_in(data: dict[str, Any]) -> list[str]:
    """The keys of a merged Megatron section ``data`` that have no effect on any hardware and are set
    (the device-dependent ones are in :func:`posttrain.config.features.startup_warnings`)."""
    out = []
    for key, value in data.items():
        if key not in MegatronConfig.model_fields:
            continue
        rule = field_rule(MegatronConfig, key)
        if (rule is not None and rule.status is Status.IGNORED and rule.devices == DEVICES
                and rule.is_active(value, MegatronConfig.model_fields[key].default)):
            out.append(key)
    return sorted(out)
