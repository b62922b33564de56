"""Megatron-Core's ``GPTModel`` for a Hugging Face model: the model built from Megatron-LM
arguments (the ``args`` that ``posttrain convert`` writes), and this rank's weights read straight
from the HF files through the converter's mapping (:mod:`posttrain.models.mcore`), so no Megatron
checkpoint has to be written first.

Runs inside Megatron's process groups (``megatron.core.parallel_state`` initialised); on a CPU
inside :func:`posttrain.training.megatron.cpu_shims.cpu_megatron`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from posttrain.errors import CheckpointError, ConfigError
from posttrain.models.mcore import mapping, mcore_files, splits
from posttrain.models.mcore.convert import _stage_state, hf_arch
from posttrain.models.mcore.hf_files import HFWeights
from posttrain.training.megatron import vision
from posttrain.training.megatron.lora import from_stage, merged_state_dict


def arg(args: argparse.Namespace, name: str, default: Any = None) -> Any:
    """``args.name``, or ``default`` where it is missing or None."""
    value = getattr(args, name, default)
    return default if value is None else value


def transformer_config(args: argparse.Namespace, tp: int, pp: int, vpp, layers, *, initialize: bool = False,
                       ep: int = 1, **options: Any):
    """A fp32 (unless ``options`` say bf16), CPU-initialised, no-fusion ``TransformerConfig`` from
    Megatron-LM argument names; of a mixture-of-experts model (``num_experts``), its experts split
    over ``ep`` expert-parallel ranks, tokens dispatched by all-gather (Megatron's all-to-all
    dispatcher creates CUDA streams; the result is the same), the router Qwen3-MoE's (softmax over
    the top-k logits with ``norm_topk_prob``, else top-k of the softmax) without a load-balancing
    loss unless ``options`` ask for one. ``initialize``:
    Megatron initialises the weights (which marks the tensor-parallel ones, as its gradient norm
    and clipping need) before they are overwritten by loaded ones. ``options``: more
    ``TransformerConfig`` fields (the run's ``recompute_*`` and ``sequence_parallel``)."""
    from megatron.core.transformer import TransformerConfig

    if arg(args, "position_embedding_type", "rope") not in ("rope", "mrope"):
        raise NotImplementedError(f"position_embedding_type={args.position_embedding_type!r}")
    swiglu = bool(arg(args, "swiglu", False))
    gqa = bool(arg(args, "group_query_attention", False))
    layout = None
    if layers is not None:
        # mcore 0.16 expresses an arbitrary per-stage layer count only through
        # pipeline_model_parallel_layout (num_layers_in_first/last_pipeline_stage cannot express
        # e.g. "1,3,2,2"): one list per virtual stage in model order, embedding first, loss last.
        layout = [["decoder"] * n for n in layers]
        layout[0].insert(0, "embedding")
        layout[-1].append("loss")
    fields = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if gqa else None,
        kv_channels=getattr(args, "kv_channels", None),
        add_qkv_bias=bool(arg(args, "add_qkv_bias", False)),
        add_bias_linear=bool(arg(args, "add_bias_linear", False)),
        qk_layernorm=bool(arg(args, "qk_layernorm", False)),
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu,
        normalization=arg(args, "normalization", "LayerNorm"),
        layernorm_epsilon=float(arg(args, "norm_epsilon", 1e-5)),
        rotary_interleaved=bool(arg(args, "rotary_interleaved", False)),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        pipeline_model_parallel_layout=layout,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        perform_initialization=initialize,  # the loaded weights overwrite whatever it draws
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        sequence_parallel=False,
    )
    if arg(args, "position_embedding_type", "rope") == "mrope":  # a VLM's language model (training/megatron/vision.py)
        fields["mrope_section"] = list(args.mrope_section)
    if not arg(args, "num_experts", None):  # a dense model: no router options
        options = {k: v for k, v in options.items() if not k.startswith("moe_")}
    else:
        fields.update(num_moe_experts=int(args.num_experts), moe_ffn_hidden_size=int(args.moe_ffn_hidden_size),
                      moe_router_topk=int(args.moe_router_topk),
                      moe_router_pre_softmax=not bool(arg(args, "norm_topk_prob", False)),
                      moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
                      moe_aux_loss_coeff=0.0, moe_grouped_gemm=False, moe_permute_fusion=False,
                      expert_model_parallel_size=ep)
    return TransformerConfig(**{**fields, **options})


def attach_value_head(chunk) -> None:
    """On the last stage, replace ``chunk``'s output layer by a scalar value head ``rm_head``
    (zeros): Megatron's row-parallel linear hidden -> 1, the layout ``posttrain convert --orm``
    reads and writes, called as ``GPTModel`` calls its output layer, so the model returns
    ``[B, T, 1]`` values instead of logits (the PPO critic, as the seed's reward-model head); under
    sequence parallelism on the gathered sequence."""
    from megatron.core.tensor_parallel import RowParallelLinear, gather_from_sequence_parallel_region

    if not chunk.post_process:
        return
    del chunk.output_layer
    sequence_parallel = chunk.config.sequence_parallel  # the head sees the whole sequence (gathered)
    chunk.rm_head = head = RowParallelLinear(chunk.config.hidden_size, 1,
                                             config=dataclasses.replace(chunk.config, sequence_parallel=False),
                                             init_method=torch.nn.init.zeros_, bias=False, input_is_parallel=False,
                                             skip_bias_add=False)
    with torch.no_grad():
        head.weight.zero_()

    def value_head(hidden, weight=None, runtime_gather_output=None):
        if sequence_parallel:  # every rank computes the head alike: its gradient is split back, not summed
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return head(hidden)

    chunk.output_layer = value_head


def build_chunks(args: argparse.Namespace, config, vpp, *, value_head: bool = False) -> list:
    """This rank's ``GPTModel`` chunks (one per virtual stage); ``value_head``: with the critic's
    scalar head (:func:`attach_value_head`) and no output layer."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    _without_transformer_engine()
    layer = _with_norm(get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                                qk_layernorm=config.qk_layernorm, normalization=config.normalization))
    tied = not bool(arg(args, "untie_embeddings_and_output_weights", False)) and not value_head
    rope_kwargs = {}
    if getattr(args, "use_rope_scaling", False):
        rope_kwargs = dict(rope_scaling=True, rope_scaling_factor=float(arg(args, "rope_scaling_factor", 8.0)))
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        spec = TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=stage),
                                          layer_norm=SequenceParallelNorm)
        chunks.append(
            GPTModel(
                config,
                spec,
                vocab_size=args.padded_vocab_size,
                max_sequence_length=args.max_position_embeddings,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                parallel_output=True,
                share_embeddings_and_output_weights=tied,
                position_embedding_type=arg(args, "position_embedding_type", "rope"),
                rotary_percent=float(arg(args, "rotary_percent", 1.0)),
                rotary_base=int(arg(args, "rotary_base", 10000)),
                vp_stage=stage,
                **rope_kwargs,
            )
        )
        if value_head:
            attach_value_head(chunks[-1])
    return chunks


class SequenceParallelNorm:
    """The local spec's norm (``torch.nn.RMSNorm`` or ``LayerNorm``, as Megatron-Core's
    ``WrappedTorchNorm`` builds it) that also runs under sequence parallelism: a norm is per token,
    so it works on a sequence shard as on the whole; its weights are marked ``sequence_parallel`` so
    that ``finalize_model_grads`` sums their gradients over the tensor-parallel ranks (what Apex's
    and TransformerEngine's norms do, the only ones ``WrappedTorchNorm`` allows with it)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        norm_class = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}[config.normalization]
        norm = norm_class(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def _with_norm(spec):
    """``spec`` (a ``ModuleSpec`` tree) with :class:`SequenceParallelNorm` for every ``WrappedTorchNorm``."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if spec is WrappedTorchNorm:
        return SequenceParallelNorm
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(spec, module=_with_norm(spec.module), submodules=_with_norm(spec.submodules))
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(spec, **{f.name: _with_norm(getattr(spec, f.name))
                                            for f in dataclasses.fields(spec) if f.init})
    return spec


def _without_transformer_engine() -> None:
    """Megatron-Core 0.16's MoE router reads ``moe_utils.te_general_gemm``, a name the module defines
    only when TransformerEngine imports; None selects its ``torch.mm`` path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def sharded_state_dict(chunk) -> dict:
    """Megatron-Core's sharded state dict of ``chunk`` (``dist_checkpointing``), also for a chunk
    with a value head, in which ``LanguageModule`` would look for the output layer it replaced."""
    if not hasattr(chunk, "rm_head"):
        return chunk.sharded_state_dict()
    post_process, chunk.post_process = chunk.post_process, False
    try:
        return chunk.sharded_state_dict()
    finally:
        chunk.post_process = post_process


def _value_head_state(state: dict, chunk) -> dict:
    """``state`` for a value-head chunk: no output layer; the checkpoint's ``rm_head`` (a reward
    model's), else the zeros the new head starts with."""
    state = {k: v for k, v in state.items() if not k.startswith(mapping.OUTPUT_LAYER.split(".")[0] + ".")}
    if chunk.post_process and mapping.RM_HEAD not in state:
        state[mapping.RM_HEAD] = torch.zeros_like(chunk.rm_head.weight)
    return state


def is_reward_model_dir(hf_dir: Path) -> bool:
    """An HF sequence-classification (reward model) directory."""
    config = json.loads((Path(hf_dir) / "config.json").read_text(encoding="utf-8"))
    return any(a.endswith("ForSequenceClassification") for a in config.get("architectures") or [])


def hf_to_megatron(hf_dir: str | Path, *, divisor: int = 128, for_training: bool = False, value_head: bool = False,
                   **options: Any) -> tuple[list, argparse.Namespace]:
    """This rank's ``GPTModel`` chunks (one per virtual stage) holding its share of the HF model in
    ``hf_dir``, in fp32, for the TP, PP and virtual-stage sizes ``parallel_state`` was initialised
    with; and the Megatron arguments that describe it. ``for_training``: built so that Megatron's
    optimizer can tell the tensor-parallel parameters from the replicated ones (see
    :func:`transformer_config`); ``value_head``: the critic (:func:`attach_value_head`; a reward
    model's ``score`` head is loaded into it); ``options``: more ``TransformerConfig`` fields. A
    Qwen2.5-VL directory gives its language model, with multimodal rotary positions
    (:mod:`posttrain.training.megatron.vision`; its tower stays with the Hugging Face model)."""
    from megatron.core import parallel_state as ps

    tp, pp, vpp, ep = _sizes()
    weights = HFWeights(Path(hf_dir))
    orm = value_head and is_reward_model_dir(Path(hf_dir))
    vlm = vision.is_vlm_dir(hf_dir)
    if vlm:  # a Qwen2.5-VL: its language model, with multimodal rotary positions
        if value_head:
            raise ConfigError(f"{hf_dir}: a vision-language model has no critic or reward head on the megatron "
                              f"backend; use stage ray_grpo or ray_dapo")
        vision.check_layout(bool(options.get("sequence_parallel")))
        weights, arch = vision.LanguageModelWeights(weights), vision.language_arch(hf_dir)
    else:
        arch = hf_arch(Path(hf_dir), weights, orm=orm, moe=True)
    padded = splits.padded_vocab_size(arch.vocab_size, divisor, tp)
    splits.check_tp(tp, heads=arch.num_attention_heads, groups=arch.num_kv_heads,
                    ffn=arch.moe_ffn_hidden_size if arch.num_experts else arch.ffn_hidden_size, padded_vocab=padded)
    if arch.num_experts and arch.num_experts % ep:
        raise ConfigError(f"{hf_dir}: its {arch.num_experts} experts do not split over expert parallel size {ep}; "
                          f"choose an expert_model_parallel_size that divides them")
    per_chunk = arch.num_layers // (pp * vpp) if vpp else None
    par = mcore_files.Parallel(tp, pp, ep, mcore_files.pipeline_stages(arch.num_layers, pp, None, per_chunk))
    args = mcore_files.make_args(arch, par, padded_vocab=padded, divisor=divisor, params_dtype=torch.float32,
                            num_layer_list=None, layers_per_virtual_stage=per_chunk, orm=False)
    if vlm:
        args = vision.with_mrope(args, hf_dir)
    chunks = build_chunks(args, transformer_config(args, tp, pp, vpp, None, initialize=for_training, ep=ep,
                                                   **options), vpp, value_head=value_head)
    for index, chunk in enumerate(chunks):
        state = _stage_state(weights, arch, par, mapping.layer_params(arch), ps.get_pipeline_model_parallel_rank(),
                             index, ps.get_tensor_model_parallel_rank(), padded, orm,
                             ep_rank=ps.get_expert_model_parallel_rank())
        _load(chunk, _value_head_state(state, chunk) if value_head else state)
    return chunks, args


def _sizes() -> tuple[int, int, int | None, int]:
    """TP, PP, the virtual stages per rank (None without) and EP of ``parallel_state``."""
    from megatron.core import parallel_state as ps

    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    return (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            vpp if vpp and vpp > 1 else None, ps.get_expert_model_parallel_world_size())


def _load(chunk, state: dict) -> None:
    """``state`` (a converter or checkpoint state dict, with None ``_extra_state`` entries) into
    ``chunk``, every weight cast to the chunk's dtype, strictly. A LoRA checkpoint's adapter
    (``.lora.`` entries) is left out: the chunk is built without adapters, which the LoRA code
    attaches and then loads with the optimizer (:mod:`posttrain.training.megatron.lora`)."""
    chunk.load_state_dict({k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
                           for k, v in state.items() if ".lora." not in k}, strict=True)


def mcore_to_megatron(load_dir: str | Path, *, for_training: bool = False, value_head: bool = False,
                      **options: Any) -> tuple[list, argparse.Namespace]:
    """This rank's ``GPTModel`` chunks holding its shard of the Megatron checkpoint ``load_dir`` (a
    ``posttrain convert`` output or a Megatron-backend save), and args describing this layout. A
    ``torch_dist`` checkpoint loads into the layout ``parallel_state`` was initialised with
    (Megatron reshards it); a legacy one must have been saved with it (TP, PP, virtual stages;
    evenly split): another layout is converted to HF first (``posttrain convert``).
    ``value_head``: as in :func:`hf_to_megatron` (an ``--orm`` checkpoint's head is loaded)."""
    from megatron.core import parallel_state as ps

    tp, pp, vpp, ep = _sizes()
    it_dir = mcore_files.iteration_dir(Path(load_dir))
    args = mcore_files.read_args(it_dir)
    layers = int(args.num_layers)
    per_chunk = layers // (pp * vpp) if vpp else None
    if mcore_files.is_dist_checkpoint(it_dir):
        args = _with_layout(args, tp, pp, ep, per_chunk, it_dir)
        chunks = build_chunks(args, transformer_config(args, tp, pp, vpp, None, initialize=for_training, ep=ep,
                                                       **options), vpp, value_head=value_head)
        _load_dist_model(it_dir, chunks)
        return chunks, args
    saved = mcore_files.parallel_from_args(args, it_dir)
    wanted = mcore_files.pipeline_stages(layers, pp, None, per_chunk)
    if (saved.tp, saved.pp, saved.ep, saved.stages) != (tp, pp, ep, wanted):
        raise CheckpointError(
            f"{it_dir} was saved at TP {saved.tp} x PP {saved.pp} with {saved.chunks} virtual stage(s) (stages "
            f"{saved.stages}) in the legacy format; this run is TP {tp} x PP {pp} with {vpp or 1}, evenly split. "
            f"Convert it to HF first (posttrain convert --load-model-type mg --save-model-type hf --load-dir "
            f"{load_dir} --save-dir <hf dir>) and load that directory (torch_dist checkpoints reshard on load).")
    path = it_dir / mcore_files.rank_dir_name(ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                                         pp) / mcore_files.RANK_FILE
    chunks = build_chunks(args, transformer_config(args, tp, pp, vpp, None, initialize=for_training, **options),
                          vpp, value_head=value_head)
    saved_state = mcore_files.load_rank_file(path, mmap=False)
    for index, chunk in enumerate(chunks):
        state = saved_state[mcore_files.model_key(index, len(chunks))]
        _load(chunk, _value_head_state(state, chunk) if value_head else state)
    return chunks, args


def _with_layout(args: argparse.Namespace, tp: int, pp: int, ep: int, per_chunk: int | None,
                 where: Path) -> argparse.Namespace:
    """A copy of a checkpoint's ``args`` describing this run's layout (the padded vocabulary kept:
    the embedding's global shape), for a checkpoint that reshards on load."""
    if int(args.padded_vocab_size) % tp:
        raise CheckpointError(f"{where}: its padded vocabulary ({args.padded_vocab_size} rows) does not split into "
                              f"TP {tp} shards; choose a tensor-parallel size that divides it")
    out = argparse.Namespace(**vars(args))
    if int(getattr(args, "num_experts", None) or 0) % ep:
        raise CheckpointError(f"{where}: its {args.num_experts} experts do not split over expert parallel size {ep}; "
                              f"choose an expert_model_parallel_size that divides them")
    out.tensor_model_parallel_size, out.pipeline_model_parallel_size = tp, pp
    out.expert_model_parallel_size = ep
    out.num_layers_per_virtual_pipeline_stage, out.num_layer_list = per_chunk, None
    return out


def _load_dist_model(it_dir: Path, chunks: list) -> None:
    """The model part of a ``torch_dist`` checkpoint into ``chunks`` (resharded by Megatron); a
    value head the checkpoint lacks (a critic started from a policy) keeps its zeros, and a policy's
    output layer is not read into one."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader  # lazy: ~0.7 s (sympy); torch_dist checkpoints only

    saved = set(FileSystemReader(str(it_dir)).read_metadata().state_dict_metadata)
    state = {}
    for index, chunk in enumerate(chunks):
        key = mcore_files.model_key(index, len(chunks))
        sharded = sharded_state_dict(chunk)
        state[key] = {k: v for k, v in sharded.items() if "_extra_state" in k or getattr(v, "key", k) in saved}
    with torch.serialization.safe_globals(mcore_files.safe_globals()):
        loaded = dist_checkpointing.load(state, str(it_dir))
    for index, chunk in enumerate(chunks):
        result = chunk.load_state_dict(loaded[mcore_files.model_key(index, len(chunks))], strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state") and k != mapping.RM_HEAD]
        if missing or result.unexpected_keys:
            raise CheckpointError(f"{it_dir}: the checkpoint does not hold this model (missing {missing[:4]}, "
                                  f"unexpected {result.unexpected_keys[:4]})")


def hf_weights(chunks: list, args: argparse.Namespace, *, value_head: bool = False):
    """Yield ``(HF name, full tensor)`` for every weight of the model that ``chunks`` (one per
    virtual stage) are this rank's part of, one layer at a time, on every rank: each tensor's TP shards are all-gathered and
    merged back into the HF layout (the converter's mapping), then broadcast from the pipeline
    stage that holds it. A LoRA actor's adapted weights are merged, ``W + (alpha / r) B @ A``
    (:func:`posttrain.training.megatron.lora.merged_state_dict`). This is the weight sync from the
    trained model to the rollout's HF model;
    the peak is one layer, not the model. All ranks must iterate it together (collectives). Each
    expert of a mixture-of-experts model is gathered over the expert tensor-parallel group on the
    expert-parallel rank that holds it, then broadcast over the expert-parallel group."""
    from megatron.core import parallel_state as ps

    where = Path("<megatron model>")
    arch, par = mcore_files.arch_from_args(args, where), mcore_files.parallel_from_args(args, where)
    vocab = int(args.vocab_size)
    states = [merged_state_dict(chunk) for chunk in chunks]
    tp_group, pp_group = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
    pp_rank, pp_ranks = ps.get_pipeline_model_parallel_rank(), dist.get_process_group_ranks(pp_group)

    def tp_shards(name: str, chunk: int = 0) -> list[torch.Tensor]:
        local = states[chunk][name].detach().contiguous()
        shards = [torch.empty_like(local) for _ in range(par.tp)]
        dist.all_gather(shards, local, group=tp_group)
        return shards

    experts_per_rank = (arch.num_experts or 0) // par.ep

    def expert_shards(p: mapping.Param, expert: int, local: int, chunk: int) -> tuple[mapping.Param, list]:
        """``p`` of the (global) ``expert`` in layer ``local`` of ``chunk``, and its expert-TP shards."""
        owner, index = divmod(expert, experts_per_rank)
        name = mapping.mcore_layer_name(local, p.for_expert(index, expert).mcore)
        local_state = states[chunk][name].detach().contiguous()  # this rank's expert ``index``: the shape
        shards = [torch.empty_like(local_state) for _ in range(etp_group.size())]
        dist.all_gather(shards, local_state, group=etp_group)
        for shard in shards:
            dist.broadcast(shard, src=ep_ranks[owner], group=ep_group)
        return p.for_expert(index, expert), shards

    if arch.num_experts:
        ep_group, etp_group = ps.get_expert_model_parallel_group(), ps.get_expert_tensor_parallel_group()
        ep_ranks = dist.get_process_group_ranks(ep_group)

    def stage_tensors(stage: int, make) -> list[torch.Tensor]:
        return from_stage(make, pp_rank == stage, pp_ranks[stage] if par.pp > 1 else None, pp_group)

    [embedding] = stage_tensors(0, lambda: [splits.merge_vocab(tp_shards(mapping.EMBEDDING), vocab)])
    yield mapping.HF_EMBEDDING, embedding
    params = mapping.layer_params(arch)
    for layer in range(arch.num_layers):
        stage, chunk, local = par.locate(layer)
        for p in params:
            for expert in range(arch.num_experts or 0) if p.expert else [None]:
                if expert is None:
                    names = p.hf
                    merged = stage_tensors(stage, lambda: mapping.merge_param(
                        p, tp_shards(mapping.mcore_layer_name(local, p.mcore), chunk), arch))
                else:
                    names = p.for_expert(0, expert).hf
                    merged = stage_tensors(stage, lambda: mapping.merge_param(
                        *expert_shards(p, expert, local, chunk), arch))
                for name, tensor in zip(names, merged):
                    yield mapping.hf_layer_name(layer, name), tensor
    last = par.pp - 1
    [norm] = stage_tensors(last, lambda: [states[-1][mapping.FINAL_NORM].detach().clone()])
    yield mapping.HF_FINAL_NORM, norm
    if value_head:  # the critic's scalar head: HF's score, split over TP along the hidden dimension
        [head] = stage_tensors(last, lambda: [splits.merge_dim(tp_shards(mapping.RM_HEAD, -1), 1)])
        yield mapping.HF_SCORE, head
    elif not arch.tie_embeddings:
        [head] = stage_tensors(last, lambda: [splits.merge_vocab(tp_shards(mapping.OUTPUT_LAYER, -1), vocab)])
        yield mapping.HF_LM_HEAD, head
