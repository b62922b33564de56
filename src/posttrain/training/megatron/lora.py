"""LoRA on the Megatron-Core backend, with PEFT's parametrisation on the Hugging Face model.

PEFT puts one adapter ``(A [r, in], B [out, r])`` on each targeted HF linear and adds
``(alpha / r) * B @ A @ x`` to its output. Megatron-Core fuses several HF linears into one parallel
linear (:data:`LINEARS`), so one Megatron linear carries the adapters of the HF linears it fuses,
each kept as PEFT has it (:class:`LoraAdapters`, a child ``lora`` of the linear):

* ``linear_qkv`` (column parallel, rows interleaved per query group ``[q of the group; k; v]``) and
  ``linear_fc1`` (column parallel, rank ``t`` holds ``[gate_t; up_t]``): every ``A`` is replicated
  over the tensor-parallel ranks, every ``B`` split by its output rows (rank ``t`` holds the rows of
  the groups, or the gate/up block, it computes); each ``A`` is applied to the input, each ``B``
  writes its own rows of the fused output (interleaved as the base weight's rows are). The
  gradient of ``A @ x`` is summed over the TP ranks (each rank's ``B`` rows see part of it).
* ``linear_proj`` and ``linear_fc2`` (row parallel, the input split by features): ``A`` is split by
  its input columns, the partial products ``A_t @ x_t`` are all-reduced over TP before ``B``, which
  is replicated.

The adapter's output is added by a forward hook, so the base linear, its weights and their names
are untouched (the checkpoints, the converter and :func:`~posttrain.training.megatron.model.hf_weights`
read them as before); the base is frozen and only the adapters train. :func:`merged_state_dict`
gives a chunk's weights with ``W + (alpha / r) B @ A`` in the Megatron layout (the rollout's weight
sync); :func:`adapter_weights` gathers the adapters over TP and PP under PEFT's names (the saved
``adapter_model.safetensors``). Initialisation: PEFT's own, from the same seed as the hf backend
(:func:`peft_init`), so both backends train the same numbers. docs/lora.md.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from posttrain.models.lora import ADAPTER_CONFIG, LoraOptions, megatron_parts
from posttrain.models.mcore import mcore_files

# the Megatron linear under a decoder layer -> its kind and the HF linears it fuses, in its row order
LINEARS = {"self_attention.linear_qkv": ("qkv", ("q_proj", "k_proj", "v_proj")),
           "self_attention.linear_proj": ("row", ("o_proj",)),
           "mlp.linear_fc1": ("fc1", ("gate_proj", "up_proj")),
           "mlp.linear_fc2": ("row", ("down_proj",))}
HF_MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_LAYER = re.compile(r".*\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)$")


def from_stage(make, here: bool, source: int | None, group) -> list[torch.Tensor]:
    """The tensors ``make()`` builds on the pipeline stage whose global rank is ``source`` (``here``:
    this rank is it), broadcast to every stage of ``group``; ``source`` None: one stage, no broadcast."""
    tensors = make() if here else None
    if source is None:
        return tensors
    shapes = [[(t.shape, t.dtype) for t in tensors] if tensors is not None else None]
    dist.broadcast_object_list(shapes, src=source, group=group)
    if tensors is None:
        tensors = [torch.empty(shape, dtype=dtype) for shape, dtype in shapes[0]]
    for tensor in tensors:
        dist.broadcast(tensor, src=source, group=group)
    return tensors


def peft_key(layer: int, part: str, matrix: str) -> str:
    """The name PEFT saves an adapter matrix (``A`` or ``B``) of HF linear ``part`` under."""
    return f"base_model.model.model.layers.{layer}.{HF_MODULE[part]}.{part}.lora_{matrix}.weight"


def _fuse(kind: str, outs: list[torch.Tensor], groups: int) -> torch.Tensor:
    """The parts' outputs (last dim: their rows on this rank) as the fused linear orders its rows:
    per query group ``[q; k; v]`` for ``qkv``, one after the other otherwise."""
    if kind != "qkv":
        return torch.cat(outs, dim=-1)
    grouped = [o.reshape(*o.shape[:-1], groups, o.shape[-1] // groups) for o in outs]
    fused = torch.cat(grouped, dim=-1)
    return fused.reshape(*fused.shape[:-2], -1)


class LoraAdapters(torch.nn.Module):
    """The adapters on one Megatron linear of kind ``kind`` (:data:`LINEARS`): ``A[part]`` and
    ``B[part]`` for each targeted HF linear ``part`` (this TP rank's shard), ``widths[part]`` the
    rows each fused part has on this rank (a part without an adapter adds zeros), ``groups`` the
    query groups on this rank (``qkv``)."""

    def __init__(self, kind: str, order: tuple[str, ...], shards: dict[str, tuple[torch.Tensor, torch.Tensor]],
                 widths: dict[str, int], scaling: float, groups: int, sequence_parallel: bool = False):
        super().__init__()
        from megatron.core.tensor_parallel.layers import (
            set_tensor_model_parallel_attributes,
        )

        self.kind, self.order, self.widths, self.scaling, self.groups = kind, order, widths, scaling, groups
        self.sequence_parallel = sequence_parallel
        self.enabled = True
        self.A, self.B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        split = {"A": 1 if kind == "row" else None, "B": None if kind == "row" else 0}  # TP-split dimension
        for part, (a, b) in shards.items():
            for matrix, tensor in (("A", a), ("B", b)):
                param = torch.nn.Parameter(tensor.detach().clone().float())
                if split[matrix] is None:  # replicated over TP: counted once in the gradient norm; under
                    param.tensor_model_parallel, param.partition_dim, param.partition_stride = False, -1, 1
                    param.sequence_parallel = sequence_parallel  # SP each rank's gradient is partial: summed
                else:
                    set_tensor_model_parallel_attributes(param, True, split[matrix], 1)
                getattr(self, matrix)[part] = param

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``scaling * B @ A @ x`` of every part, in the fused linear's output layout on this rank."""
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
            reduce_from_tensor_model_parallel_region,
            reduce_scatter_to_sequence_parallel_region,
        )

        if self.kind == "row":  # the partial products summed (under SP: this rank's tokens of the sum)
            [part] = self.order
            partial = x @ self.A[part].t()
            low = reduce_scatter_to_sequence_parallel_region(partial) if self.sequence_parallel else \
                reduce_from_tensor_model_parallel_region(partial)
            return (low @ self.B[part].t()) * self.scaling
        if self.sequence_parallel:  # every token (as the base linear gathers them); the input's gradient
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True)  # reduce-scattered
        outs = []
        for part in self.order:
            if part in self.A:  # A's gradient summed over the ranks, each holding some of B's rows (under
                low = x @ self.A[part].t()  # SP by finalize_model_grads: ``sequence_parallel`` A)
                if not self.sequence_parallel:
                    low = copy_to_tensor_model_parallel_region(low)
                outs.append(low @ self.B[part].t())
            else:
                outs.append(x.new_zeros(*x.shape[:-1], self.widths[part]))
        return _fuse(self.kind, outs, self.groups) * self.scaling

    def weight_delta(self) -> torch.Tensor:
        """``scaling * B @ A`` in the layout of this rank's shard of the base weight."""
        if self.kind == "row":
            [part] = self.order
            return (self.B[part] @ self.A[part]) * self.scaling
        anchor = next(iter(self.A.values()))  # [r, in]: a part without an adapter adds zero rows
        columns = [(self.B[p] @ self.A[p]).t() if p in self.A else
                   anchor.new_zeros(anchor.shape[1], self.widths[p]) for p in self.order]  # [in, rows of p]
        return _fuse(self.kind, columns, self.groups).t() * self.scaling


def _add_adapter_output(module, args, output):
    """Forward hook of an adapted linear: its ``(output, bias)`` plus the adapter's output."""
    if not module.lora.enabled:
        return output
    out, bias = output
    return out + module.lora(args[0]).to(out.dtype), bias


def _split(kind: str, matrix: str, tensor: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """This TP rank's shard of a full PEFT matrix (see the module docstring)."""
    dim = (1 if matrix == "A" else None) if kind == "row" else (0 if matrix == "B" else None)
    return tensor if dim is None else tensor.chunk(tp, dim=dim)[rank]


def _layer_sizes(arch) -> dict[str, tuple[int, int]]:
    """``(in, out)`` of each HF linear, full size."""
    h, q, kv, ffn = arch.hidden_size, arch.num_attention_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, \
        arch.ffn_hidden_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, ffn),
            "up_proj": (h, ffn), "down_proj": (ffn, h)}


def _layers(chunk) -> list:
    return list(chunk.decoder.layers)


def attach(chunks: list, args, options: LoraOptions, init: dict | None) -> None:
    """Adapters on the targeted linears of every layer of ``chunks`` (one per virtual stage) and
    the base frozen. ``init``: PEFT's full matrices by ``(layer, part)`` (:func:`peft_init`), else
    zeros (a checkpoint's adapter is loaded next)."""
    from megatron.core import parallel_state as ps

    arch = mcore_files.arch_from_args(args, Path("<megatron model>"))
    if arch.num_experts:
        raise NotImplementedError("LoRA on a mixture-of-experts model (refused by the config check)")
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    targets, sizes = megatron_parts(options.target_modules), _layer_sizes(arch)
    scaling = float(options.alpha) / int(options.r)
    for chunk in chunks:
        chunk.requires_grad_(False)
        for layer in _layers(chunk):
            index = layer.layer_number - 1  # Megatron numbers the layers from 1, globally
            for path, (kind, order) in LINEARS.items():
                parts = [p for p in order if p in targets.get(path.rsplit(".", 1)[-1], ())]
                if not parts:
                    continue
                shards = {}
                for part in parts:
                    fan_in, fan_out = sizes[part]
                    a, b = init[(index, part)] if init is not None else (torch.zeros(options.r, fan_in),
                                                                         torch.zeros(fan_out, options.r))
                    shards[part] = (_split(kind, "A", a, tp, rank), _split(kind, "B", b, tp, rank))
                linear = layer.get_submodule(path)
                device = linear.weight.device
                linear.lora = LoraAdapters(kind, order, shards, {p: sizes[p][1] // tp for p in order}, scaling,
                                           arch.num_kv_heads // tp, chunk.config.sequence_parallel).to(device)
                linear.register_forward_hook(_add_adapter_output)
                _shard_adapter_checkpoint(linear, kind)


def _shard_adapter_checkpoint(linear, kind: str) -> None:
    """``torch_dist`` checkpoints: the linear's sharded state dict with its adapter's TP-split
    matrices sharded along their split dimension (Megatron's own treats a child's tensors as
    replicated and would keep TP rank 0's alone)."""
    from megatron.core.transformer.utils import (
        ensure_metadata_has_dp_cp_group,
        make_sharded_tensors_for_checkpoint,
    )

    own = linear.sharded_state_dict

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        state = own(prefix, sharded_offsets, metadata)
        adapter = {f"lora.{m}.{p}": t for m in ("A", "B") for p, t in getattr(linear.lora, m).items()}
        axes = {k: (1 if k.startswith("lora.A") else None) if kind == "row" else (0 if k.startswith("lora.B") else
                                                                                  None) for k in adapter}
        state.update(make_sharded_tensors_for_checkpoint(
            adapter, prefix, {k: d for k, d in axes.items() if d is not None}, sharded_offsets,
            tp_group=linear.tp_group, dp_cp_group=ensure_metadata_has_dp_cp_group(metadata)["dp_cp_group"]))
        return state

    linear.sharded_state_dict = sharded_state_dict


def adapted_linears(chunks: list) -> Iterator[LoraAdapters]:
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, LoraAdapters):
                yield module


class AdapterSwitch:
    """``disable_adapter()`` for the adapters of ``chunks``: what
    :class:`~posttrain.models.lora.AdapterOff` calls for the reference with ``share_backbone``."""

    def __init__(self, chunks: list):
        self.chunks = chunks

    @contextlib.contextmanager
    def disable_adapter(self):
        adapters = list(adapted_linears(self.chunks))
        for adapter in adapters:
            adapter.enabled = False
        try:
            yield
        finally:
            for adapter in adapters:
                adapter.enabled = True


def merged_state_dict(chunk) -> dict[str, torch.Tensor]:
    """``chunk.state_dict()`` with every adapted base weight ``W + scaling * B @ A`` (this rank's shard)."""
    state = chunk.state_dict()
    with torch.no_grad():
        for name, module in chunk.named_modules():
            if isinstance(getattr(module, "lora", None), LoraAdapters) and module.lora.enabled:
                key = f"{name}.weight"
                state[key] = state[key] + module.lora.weight_delta().to(state[key].dtype)
    return state


def peft_init(options: LoraOptions, base_dir: str | Path, seed: int) -> dict:
    """PEFT's initial adapter on the HF model in ``base_dir`` (``lora.add_adapter`` right after
    seeding with ``seed``, as the hf backend draws it), made on global rank 0 and broadcast to every
    rank: ``{(layer, part): (A, B)}``. The caller's RNG states are left as they were."""
    import random

    import numpy as np

    box = [None]
    if dist.get_rank() == 0:
        from posttrain.models.loading import load_causal_lm
        from posttrain.models.lora import add_adapter

        numpy_state, python_state = np.random.get_state(), random.getstate()
        with torch.random.fork_rng(devices=[]):
            random.seed(seed)  # the hf backend's seed_everything (roles/policy.py)
            np.random.seed(seed % 2**32)
            torch.manual_seed(seed)
            model = add_adapter(load_causal_lm(base_dir, dtype="float32"), options)
        np.random.set_state(numpy_state)
        random.setstate(python_state)
        init = {}
        for name, module in model.named_modules():
            match = _PEFT_LAYER.fullmatch(name)
            if match and hasattr(module, "lora_A") and "default" in module.lora_A:
                init[(int(match[1]), match[2])] = (module.lora_A["default"].weight.detach().cpu().clone(),
                                                   module.lora_B["default"].weight.detach().cpu().clone())
        box = [init]
        del model
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _targeted(options: LoraOptions) -> list[tuple[str, str]]:
    """``(Megatron linear path, HF part)`` of every adapter of a layer, in the order the module sends them."""
    targets = megatron_parts(options.target_modules)
    return [(path, p) for path, (_, order) in LINEARS.items() for p in order
            if p in targets.get(path.rsplit(".", 1)[-1], ())]


def adapter_weights(chunks: list, args, options: LoraOptions) -> Iterator[tuple[str, torch.Tensor]]:
    """``(PEFT name, full matrix)`` of every adapter of the model ``chunks`` are this rank's part of,
    one layer at a time: gathered over TP and broadcast from the pipeline stage that holds it, on
    every rank (a collective: all ranks iterate it together)."""
    from megatron.core import parallel_state as ps

    where = Path("<megatron model>")
    arch, par = mcore_files.arch_from_args(args, where), mcore_files.parallel_from_args(args, where)
    tp_group, pp_group = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
    pp_rank, pp_ranks = ps.get_pipeline_model_parallel_rank(), dist.get_process_group_ranks(pp_group)
    layers = {layer.layer_number - 1: layer for chunk in chunks for layer in _layers(chunk)}
    targeted = _targeted(options)

    def gather(tensor: torch.Tensor, dim: int | None) -> torch.Tensor:
        if dim is None or par.tp == 1:
            return tensor.detach().clone()
        shards = [torch.empty_like(tensor) for _ in range(par.tp)]
        dist.all_gather(shards, tensor.detach().contiguous(), group=tp_group)
        return torch.cat(shards, dim=dim)

    for index in range(arch.num_layers):
        stage, _, _ = par.locate(index)

        def make(index=index):
            out = []
            for path, part in targeted:
                lora = layers[index].get_submodule(path).lora
                row = lora.kind == "row"
                out += [gather(lora.A[part], 1 if row else None), gather(lora.B[part], None if row else 0)]
            return out

        tensors = from_stage(make, pp_rank == stage, pp_ranks[stage] if par.pp > 1 else None, pp_group)
        for (_, part), (a, b) in zip(targeted, zip(tensors[0::2], tensors[1::2])):
            yield peft_key(index, part, "A"), a
            yield peft_key(index, part, "B"), b


def check_saved_adapter(it_dir: Path, options: LoraOptions) -> None:
    """A LoRA run resumes a checkpoint of a LoRA run with the same ``lora_r``, ``lora_alpha`` and
    adapted linears (else Megatron's strict load would fail on shapes or names, or the run would
    continue another adapter than its config describes)."""
    from posttrain.errors import ConfigError
    from posttrain.models.lora import check_adapter_matches

    if not (it_dir / ADAPTER_CONFIG).is_file():
        raise ConfigError(f"actor_config.lora_target_modules: {it_dir} holds no LoRA adapter (a full-weight run of "
                          f"the megatron backend); a LoRA run starts from a Hugging Face directory (convert this "
                          f"checkpoint: posttrain convert --load-model-type mg --save-model-type hf) or resumes its "
                          f"own LoRA checkpoint")
    check_adapter_matches(it_dir, options, {part for _, part in _targeted(options)})


def write_adapter(chunks: list, args, options: LoraOptions, base_model: str, directory: Path) -> None:
    """The adapter in PEFT's format in ``directory`` (``adapter_model.safetensors`` and
    ``adapter_config.json``, HF names, each written to a temporary name, then renamed): gathered on
    every rank (a collective), written by global rank 0."""
    import tempfile

    from peft import LoraConfig
    from safetensors.torch import save_file

    tensors = dict(adapter_weights(chunks, args, options))
    if dist.get_rank() != 0:
        return
    parts = sorted({part for _, part in _targeted(options)})
    config = LoraConfig(r=int(options.r), lora_alpha=options.alpha, lora_dropout=0.0, bias="none",
                        target_modules=parts, task_type="CAUSAL_LM", base_model_name_or_path=str(base_model))
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{ADAPTER_WEIGHTS}.tmp"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, directory / ADAPTER_WEIGHTS)
    with tempfile.TemporaryDirectory(dir=directory) as staging:
        config.save_pretrained(staging)
        os.replace(Path(staging) / ADAPTER_CONFIG, directory / ADAPTER_CONFIG)
