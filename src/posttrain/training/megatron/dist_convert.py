"""``posttrain convert --load-model-type mg`` for ``torch_dist`` checkpoints (the megatron
backend's default format): Megatron-Core's ``dist_checkpointing`` reshards the checkpoint into a
one-rank model (TP 1, PP 1) in a child process with a gloo group of its own, and its weights are
written in the HF layout through the same mapping as every other conversion
(:func:`posttrain.training.megatron.model.hf_weights`). The whole model is held in that process (the
legacy converter streams one layer at a time).
"""

from __future__ import annotations

import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemReader

from posttrain.checkpoint.card import converted_card
from posttrain.models.mcore import mapping, mcore_files
from posttrain.models.mcore.convert import check_hf_target, hf_config, params_dtype, write_hf
from posttrain.training.megatron.cpu_shims import cpu_megatron
from posttrain.training.megatron.model import hf_weights, mcore_to_megatron


def dist_to_hf(load_dir: str | Path, out_dir: str | Path, *, template: str | Path | None = None,
               tokenizer: str | Path | None = None, dtype: str | None = None, force: bool = False) -> Path:
    """Merge the ``torch_dist`` checkpoint ``load_dir`` into the HF directory ``out_dir`` (a critic's
    ``rm_head`` becomes a sequence-classification ``score``)."""
    it_dir = mcore_files.iteration_dir(Path(load_dir))
    check_hf_target(Path(out_dir), force)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_convert, args=(port, str(it_dir), str(out_dir), template, tokenizer, dtype), nprocs=1, join=True)
    return Path(out_dir)


def _convert(rank: int, port: int, it_dir: str, out_dir: str, template, tokenizer, dtype) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        with cpu_megatron():
            ps.initialize_model_parallel()
            model_parallel_cuda_manual_seed(0)
            orm = mapping.RM_HEAD in FileSystemReader(it_dir).read_metadata().state_dict_metadata
            chunks, args = mcore_to_megatron(it_dir, value_head=orm)
            arch = mcore_files.arch_from_args(args, Path(it_dir))
            out_dtype = params_dtype(dtype)
            stored = next(chunks[0].parameters()).dtype
            config = hf_config(arch, args, Path(it_dir), stored, Path(template) if template else None, orm, out_dtype)
            with torch.no_grad():
                write_hf(Path(out_dir), hf_weights(chunks, args, value_head=orm), config, arch=arch, orm=orm,
                         template=Path(template) if template else None, tokenizer=Path(tokenizer) if tokenizer else None,
                         out_dtype=out_dtype, card=converted_card(it_dir, arch.model_type, orm))
            ps.destroy_model_parallel()
    finally:
        dist.destroy_process_group()
