"""Checks that a legacy Megatron rank file is intact and belongs in its slot.

A rank file is a torch zip archive: :func:`mcore_files.zip_crcs` checks every member against the CRC the zip
records (flipped or overwritten bytes), and returns the CRCs of its data members, which tell two
copies of one shard apart from two genuine TP shards. :func:`check_slot` compares a rank file with
the checkpoint it sits in: the layout in its ``args``, the slot posttrain convert recorded
(:data:`mcore_files.SLOT_KEY`), its number of layers per (virtual) stage, and its tensors' names and
shapes against TP rank 0 of the same stage.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from posttrain.errors import CheckpointError
from posttrain.models.mcore import mcore_files

# The args that fix where each tensor goes: a rank file whose args differ comes from another checkpoint.
LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers", "hidden_size",
               "ffn_hidden_size", "num_attention_heads", "num_query_groups", "padded_vocab_size",
               "num_layers_per_virtual_pipeline_stage", "num_layer_list")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def check_slot(obj: dict, path: Path, *, tp_rank: int, pp_rank: int, args: argparse.Namespace, first: Path,
               par: mcore_files.Parallel) -> None:
    """Refuse a rank file that does not belong in the slot (``tp_rank``, ``pp_rank``) of a checkpoint
    whose args (read from ``first``) are ``args`` and whose split is ``par``."""
    mine = obj.get("args")
    if isinstance(mine, argparse.Namespace):
        for key in LAYOUT_KEYS:
            a, b = getattr(mine, key, None), getattr(args, key, None)
            if a != b:
                raise CheckpointError(f"{path}: its args say {key} = {a!r} but {first} says {b!r}: the file is a "
                                      f"shard of another checkpoint or split; put this slot's own rank file back")
    slot = obj.get(mcore_files.SLOT_KEY)
    if isinstance(slot, dict) and (slot.get("tp_rank"), slot.get("pp_rank")) != (tp_rank, pp_rank):
        raise CheckpointError(f"{path}: it holds the shard of TP rank {slot.get('tp_rank')}, PP rank "
                              f"{slot.get('pp_rank')} but sits in the slot of TP rank {tp_rank}, PP rank {pp_rank}; "
                              f"the rank files were moved or copied over each other")
    for chunk, layers in enumerate(par.stages[pp_rank]):
        key = mcore_files.model_key(chunk, par.chunks)
        state = obj.get(key)
        if not isinstance(state, dict):
            raise CheckpointError(f"{path}: no {key!r} state dict; the checkpoint's args say "
                                  f"{par.chunks} model chunk(s) per stage")
        held = {int(m.group(1)) for k in state if (m := _LAYER.match(k))}
        if held != set(range(len(layers))):
            raise CheckpointError(f"{path}: its {key!r} holds {len(held)} layers but pipeline stage {pp_rank} of the "
                                  f"checkpoint's split has {len(layers)}; the file is a shard of another split")


def check_same_shapes(obj: dict, path: Path, ref: dict, ref_path: Path, chunks: int) -> None:
    """Every TP rank of a stage holds the same tensor names and shard shapes as TP rank 0."""
    for chunk in range(chunks):
        key = mcore_files.model_key(chunk, chunks)
        mine, theirs = obj.get(key) or {}, ref.get(key) or {}
        if set(mine) != set(theirs):
            odd = sorted(set(mine) ^ set(theirs))[0]
            how = "has no tensor" if odd in theirs else "has an extra tensor"
            raise CheckpointError(f"{path}: its {key!r} {how} {odd!r} (compared with TP rank 0's, {ref_path}); "
                                  f"the file is damaged or a shard of another model or split")
        for name, t in mine.items():
            if hasattr(t, "shape") and tuple(t.shape) != tuple(getattr(theirs[name], "shape", ())):
                raise CheckpointError(f"{path}: {name} has shape {tuple(t.shape)} but TP rank 0's ({ref_path}) has "
                                      f"{tuple(theirs[name].shape)}; the file is a shard of another split")
