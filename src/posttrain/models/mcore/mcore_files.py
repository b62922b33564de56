"""Megatron's legacy checkpoint layout on disk, as MindSpeed-LLM writes and reads it.

::

    <dir>/latest_checkpointed_iteration.txt        "release", or the iteration number
    <dir>/release/                                 converted weights (or iter_0000100/ for a saved run)
        mp_rank_00/model_optim_rng.pt              TP rank 0 (one pipeline stage)
        mp_rank_01_001/model_optim_rng.pt          TP rank 1, pipeline stage 1 (when PP > 1)
        mp_rank_00_000_002/...                     ... expert parallel rank 2 (when EP > 1)

Each ``model_optim_rng.pt`` is a pickled dict: ``model`` (the rank's state dict; ``model0``,
``model1``, ... with virtual pipeline stages), ``checkpoint_version`` (3.0), ``iteration`` and
``args``, an ``argparse.Namespace`` of Megatron's argument names (:data:`ARGS_KEYS` is what
posttrain writes; a saved training run adds optimizer and RNG states, which the converter ignores).

Legacy files pickle more than tensors, so they are read with ``weights_only=True`` and an explicit
allowlist (:func:`load_rank_file`); anything else is refused with the file named.
"""

from __future__ import annotations

import argparse
import pickle
import re
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from posttrain.errors import CheckpointError, ConfigError
from posttrain.models.arch import ModelArch, arch_from_model_yaml

TRACKER = "latest_checkpointed_iteration.txt"
RANK_FILE = "model_optim_rng.pt"
RELEASE = "release"
DIST_METADATA, DIST_COMMON = ".metadata", "common.pt"  # Megatron-Core dist_checkpointing (torch_dist)
CHECKPOINT_VERSION = 3.0
SLOT_KEY = "posttrain_slot"  # {"tp_rank", "pp_rank"}: the slot posttrain convert wrote a rank file for
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")

# The args posttrain writes (Megatron's names); documented in docs/checkpoints.md.
ARGS_KEYS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "group_query_attention", "kv_channels", "max_position_embeddings", "seq_length", "padded_vocab_size",
    "vocab_size", "make_vocab_size_divisible_by", "add_qkv_bias", "add_bias_linear", "qk_layernorm", "swiglu",
    "normalization", "norm_epsilon", "position_embedding_type", "rotary_base", "rotary_percent",
    "rotary_interleaved", "untie_embeddings_and_output_weights", "tensor_model_parallel_size",
    "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "num_layers_per_virtual_pipeline_stage", "num_layer_list", "expert_model_parallel_size", "num_experts",
    "moe_ffn_hidden_size", "moe_router_topk", "norm_topk_prob", "params_dtype", "bf16", "fp16", "use_mcore_models",
    "transformer_impl", "orm", "hf_model_type",
    "iteration", "consumed_train_samples", "consumed_valid_samples",
)


@dataclass(frozen=True)
class Parallel:
    """How a checkpoint is split: sizes, and the global layers of each (stage, virtual chunk)."""

    tp: int
    pp: int
    ep: int
    stages: tuple[tuple[tuple[int, ...], ...], ...]  # stages[pp_rank][chunk] -> global layer ids

    @property
    def chunks(self) -> int:
        return len(self.stages[0])

    def locate(self, layer: int) -> tuple[int, int, int]:
        """``(pp_rank, chunk, local index)`` of a global layer."""
        for pp_rank, chunks in enumerate(self.stages):
            for chunk, layers in enumerate(chunks):
                if layer in layers:
                    return pp_rank, chunk, layers.index(layer)
        raise KeyError(layer)

    def is_first(self, pp_rank: int, chunk: int) -> bool:
        return pp_rank == 0 and chunk == 0

    def is_last(self, pp_rank: int, chunk: int) -> bool:
        return pp_rank == self.pp - 1 and chunk == self.chunks - 1


def pipeline_stages(num_layers: int, pp: int, num_layer_list: str | list[int] | None = None,
                    layers_per_virtual_stage: int | None = None) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Assign the layers to pipeline stages: even, by ``--num-layer-list``, or interleaved in
    virtual stages of ``layers_per_virtual_stage`` layers (chunk ``c`` of stage ``r`` holds the
    layers from ``(c * pp + r) * v``)."""
    if pp < 1:
        raise ConfigError(f"--target-pipeline-parallel-size must be a positive integer, found {pp}")
    if num_layer_list and layers_per_virtual_stage:
        raise ConfigError("--num-layer-list and --num-layers-per-virtual-pipeline-stage cannot be combined; "
                          "give one of them")
    if num_layer_list:
        counts = _layer_list(num_layer_list)
        if len(counts) != pp:
            raise ConfigError(f"--num-layer-list {num_layer_list} has {len(counts)} entries for "
                              f"{pp} pipeline stages; give one layer count per stage")
        if sum(counts) != num_layers:
            raise ConfigError(f"--num-layer-list {num_layer_list} sums to {sum(counts)} layers but the model "
                              f"has {num_layers}; the counts must add up to {num_layers}")
        starts = [sum(counts[:i]) for i in range(pp)]
        return tuple((tuple(range(s, s + n)),) for s, n in zip(starts, counts))
    if layers_per_virtual_stage is not None:
        v = layers_per_virtual_stage
        if v < 1 or num_layers % (pp * v):
            raise ConfigError(f"--num-layers-per-virtual-pipeline-stage {v}: the model's {num_layers} layers "
                              f"do not split into {pp} stages of chunks of {v} layers; "
                              f"num_layers must be a multiple of PP x {v}")
        chunks = num_layers // (pp * v)
        return tuple(tuple(tuple(range((c * pp + r) * v, (c * pp + r + 1) * v)) for c in range(chunks))
                     for r in range(pp))
    if num_layers % pp:
        raise ConfigError(f"pipeline parallel size {pp} does not divide the model's {num_layers} layers; "
                          f"choose a PP size that divides {num_layers}, or give --num-layer-list")
    n = num_layers // pp
    return tuple((tuple(range(r * n, (r + 1) * n)),) for r in range(pp))


def _layer_list(value: str | list[int]) -> list[int]:
    if isinstance(value, (list, tuple)):
        counts = list(value)
    else:
        try:
            counts = [int(x) for x in str(value).split(",")]
        except ValueError:
            raise ConfigError(f"--num-layer-list {value!r}: give comma-separated layer counts, e.g. 14,14") from None
    if any(c < 1 for c in counts):
        raise ConfigError(f"--num-layer-list {value}: every stage needs at least one layer")
    return counts


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> str:
    name = f"mp_rank_{tp_rank:02d}"
    if pp > 1:
        name += f"_{pp_rank:03d}"
    if ep > 1:
        name += f"_{ep_rank:03d}"
    return name


def model_key(chunk: int, chunks: int) -> str:
    return "model" if chunks == 1 else f"model{chunk}"


# ---- reading --------------------------------------------------------------------------------------

def is_dist_checkpoint(path: str | Path) -> bool:
    """An iteration dir in Megatron-Core's ``torch_dist`` format (``dist_checkpointing``: one
    ``.metadata`` and ``common.pt`` for all ranks, ``__*.distcp`` shards; no ``mp_rank_*`` dirs)."""
    path = Path(path)
    return (path / DIST_METADATA).is_file() and (path / DIST_COMMON).is_file()


def _is_iteration(path: Path) -> bool:
    return is_dist_checkpoint(path) or any(_RANK_DIR.match(p.name) for p in path.iterdir() if p.is_dir())


def is_mcore_checkpoint(path: str | Path) -> bool:
    """True for a Megatron checkpoint: a tracker or iteration dir whose subdirs are ``mp_rank_*``,
    or that is in the ``torch_dist`` format."""
    path = Path(path)
    if not path.is_dir():
        return False
    if _is_iteration(path):
        return True
    return any(_is_iteration(p) for p in path.iterdir()
               if p.is_dir() and (p.name == RELEASE or p.name.startswith("iter_")))


def iteration_dir(load_dir: str | Path) -> Path:
    """The ``release/`` or ``iter_*`` dir that ``load_dir`` (the checkpoint root, or that dir) names."""
    load_dir = Path(load_dir)
    if _is_iteration(load_dir):
        return load_dir
    tracker = load_dir / TRACKER
    if tracker.is_file():
        text = tracker.read_text(encoding="utf-8", errors="replace").strip()
        name = RELEASE if text == RELEASE else f"iter_{int(text):07d}" if text.isdigit() else None
        if name is None:
            raise CheckpointError(f"{tracker}: expected 'release' or an iteration number, found {text!r}")
        if not (load_dir / name).is_dir():
            raise CheckpointError(f"{tracker} names {text} but {load_dir / name} does not exist")
        return load_dir / name
    found = sorted(p for p in load_dir.iterdir() if p.is_dir() and (p.name == RELEASE or p.name.startswith("iter_")))
    if len(found) != 1:
        raise CheckpointError(f"{load_dir}: no {TRACKER}, and {len(found)} iteration directories; "
                              f"write the tracker file or point --load-dir at one iter_*/release directory")
    return found[0]


def rank_dirs(it_dir: Path) -> dict[tuple[int, int, int], Path]:
    out = {}
    for p in it_dir.iterdir():
        m = _RANK_DIR.match(p.name)
        if m and p.is_dir():
            out[(int(m.group(1)), int(m.group(2) or 0), int(m.group(3) or 0))] = p
    if not out:
        raise CheckpointError(f"{it_dir}: no mp_rank_* directories; not a Megatron checkpoint")
    return out


def safe_globals() -> list:
    """What a Megatron checkpoint may hold besides tensors (``torch.serialization.safe_globals``)."""
    allowed: list = [argparse.Namespace, np.dtype, np.ndarray]
    allowed += [type(np.dtype(t)) for t in ("uint32", "int64", "float32", "float64", "bool")]
    core = getattr(np, "_core", None) or np.core
    allowed += [core.multiarray._reconstruct, core.multiarray.scalar]
    # Megatron stores args.model_type as megatron.core.enums.ModelType; read it as its name
    allowed.append((_model_type, "megatron.core.enums.ModelType"))
    return allowed


def _model_type(value: Any) -> str:
    return f"ModelType({value})"


def zip_crcs(path: Path) -> tuple[int, ...]:
    """Check every member's CRC; the CRCs of the data members, in name order (``()`` for a file
    in torch's legacy, non-zip format, which records none)."""
    if not zipfile.is_zipfile(path):
        return ()
    try:
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()
            members = sorted((i.filename.split("/", 1)[-1], i.CRC) for i in zf.infolist())
    except (zipfile.BadZipFile, zlib.error, OSError, EOFError, ValueError) as err:
        raise CheckpointError(f"{path}: a damaged zip archive ({err}); restore the file from its original save") from None
    if bad is not None:
        raise CheckpointError(f"{path}: the member {bad} fails its CRC check, so bytes of the file were changed "
                              f"after it was saved (a damaged copy or disk); restore it from the original save")
    return tuple(crc for name, crc in members if name.startswith("data/"))


def load_rank_file(path: Path, *, mmap: bool = True, verify: bool = True) -> dict:
    """Read one ``model_optim_rng.pt`` safely (see the module doc), its zip CRCs checked first
    unless ``verify`` is off; names the file on any error."""
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory, not a rank file; put the rank's model_optim_rng.pt back")
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the checkpoint lacks this rank's shard")
    if verify:
        zip_crcs(path)
    try:
        with torch.serialization.safe_globals(safe_globals()):
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{path}: refused to unpickle it: {str(err).splitlines()[0]} (only tensors, "
                              f"argparse.Namespace and numpy arrays/scalars are read from Megatron checkpoints)") from None
    except (RuntimeError, OSError, EOFError, ValueError) as err:
        raise CheckpointError(f"{path}: not a readable torch checkpoint ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''})") from None
    if not isinstance(obj, dict) or not any(k.startswith("model") for k in obj):
        raise CheckpointError(f"{path}: a Megatron rank file holds a dict with a 'model' state dict; found "
                              f"{type(obj).__name__} with keys {sorted(obj)[:6] if isinstance(obj, dict) else '-'}")
    return obj


def load_common(it_dir: Path) -> dict:
    """The entries every rank shares of a ``torch_dist`` checkpoint (``common.pt``: iteration, args,
    the LR schedule and trainer state), read safely."""
    path = Path(it_dir) / DIST_COMMON
    try:
        with torch.serialization.safe_globals(safe_globals()):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError, ValueError) as err:
        raise CheckpointError(f"{path}: not a readable torch checkpoint ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a dict, found {type(obj).__name__}")
    return obj


def read_args(it_dir: Path) -> argparse.Namespace:
    """The ``args`` of the first rank file of ``it_dir`` (``common.pt`` for ``torch_dist``)."""
    if is_dist_checkpoint(it_dir):
        first = Path(it_dir) / DIST_COMMON
        args = load_common(it_dir).get("args")
    else:
        dirs = rank_dirs(it_dir)
        first = dirs[min(dirs)] / RANK_FILE
        args = load_rank_file(first).get("args")
    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(f"{first}: has no 'args' namespace, so its architecture and splits are unknown; "
                              f"it was not written by Megatron/MindSpeed-LLM or posttrain convert")
    return args


def parallel_from_args(args: argparse.Namespace, where: Path) -> Parallel:
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
    try:
        stages = pipeline_stages(int(args.num_layers), pp, getattr(args, "num_layer_list", None),
                                 getattr(args, "num_layers_per_virtual_pipeline_stage", None))
    except ConfigError as err:
        raise CheckpointError(f"{where}: its args describe an impossible split: {err}") from None
    return Parallel(tp=tp, pp=pp, ep=ep, stages=stages)


def arch_from_args(args: argparse.Namespace, where: Path) -> ModelArch:
    """The model of a checkpoint's args (Megatron names), with posttrain's ``hf_model_type`` if present."""
    keys = dict(vars(args))
    if not keys.get("group_query_attention"):
        keys["num_query_groups"] = None
    try:
        return arch_from_model_yaml(str(where), keys, vocab_size=keys.get("vocab_size") or keys.get("padded_vocab_size"))
    except ConfigError as err:
        raise CheckpointError(f"{where}: {err}") from None


def check_vocab_padding(args: argparse.Namespace, tp: int, where: Path) -> None:
    divisor = getattr(args, "make_vocab_size_divisible_by", 128)
    padded = getattr(args, "padded_vocab_size", None)
    if divisor is None or int(divisor) < 1:
        raise CheckpointError(f"{where}: make_vocab_size_divisible_by is {divisor}; it must be a positive integer")
    if padded is None or int(padded) % (int(divisor) * tp):
        raise CheckpointError(f"{where}: the padded vocabulary {padded} is not a multiple of "
                              f"make_vocab_size_divisible_by x TP = {divisor} x {tp}; the checkpoint is inconsistent")


def make_args(arch: ModelArch, par: Parallel, *, padded_vocab: int, divisor: int, params_dtype: Any,
              num_layer_list: str | None, layers_per_virtual_stage: int | None, orm: bool) -> argparse.Namespace:
    """The ``args`` namespace posttrain writes into each rank file (:data:`ARGS_KEYS`)."""
    values = dict(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads, num_query_groups=arch.num_kv_heads,
        group_query_attention=arch.num_kv_heads != arch.num_attention_heads, kv_channels=arch.head_dim,
        max_position_embeddings=arch.max_position_embeddings, seq_length=arch.max_position_embeddings,
        padded_vocab_size=padded_vocab, vocab_size=arch.vocab_size, make_vocab_size_divisible_by=divisor,
        add_qkv_bias=arch.qkv_bias, add_bias_linear=False, qk_layernorm=arch.qk_norm, swiglu=True,
        normalization="RMSNorm", norm_epsilon=arch.norm_eps, position_embedding_type="rope",
        rotary_base=arch.rope_theta, rotary_percent=1.0, rotary_interleaved=False,
        untie_embeddings_and_output_weights=not arch.tie_embeddings, tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.chunks if par.chunks > 1 else None,
        num_layers_per_virtual_pipeline_stage=layers_per_virtual_stage, num_layer_list=num_layer_list,
        expert_model_parallel_size=par.ep, num_experts=arch.num_experts,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size if arch.num_experts else None,
        moe_router_topk=arch.moe_router_topk if arch.num_experts else None,
        norm_topk_prob=arch.norm_topk_prob if arch.num_experts else None, params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16, use_mcore_models=True,
        transformer_impl="local", orm=orm, hf_model_type=arch.model_type, iteration=0,
        consumed_train_samples=0, consumed_valid_samples=0,
    )
    assert tuple(values) == ARGS_KEYS
    return argparse.Namespace(**values)
