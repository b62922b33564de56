"""Megatron-layout checkpoints of the Megatron-Core backend (issue 17, in progress).

``save_dir/iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt`` per model-parallel rank (written by
data-parallel rank 0 of each), and ``latest_checkpointed_iteration.txt``, as Megatron-LM and the
seed write them; the model part is what ``posttrain convert --load-model-type mg`` reads, so a
saved run converts back to HF. Each rank file holds ``model`` (the chunk's state dict),
``optimizer`` (Megatron's optimizer state), ``rng_state`` (the CPU generator, Python's and
NumPy's, and Megatron's RNG tracker), ``iteration``, ``args``, ``checkpoint_version`` and the
caller's ``extra`` (the LR schedule, the trainer and sampler state of a run).

Nothing is half-written: each rank file goes to a temporary name and is renamed; all ranks wait
for each other; only then does rank 0 write the tracker (temporary name, rename). A checkpoint
without a tracker naming it is never resumed from.
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path

import numpy as np
import torch

from posttrain.errors import CheckpointError


def _rank_file(it_dir: Path) -> Path:
    """This rank's file in the iteration directory ``it_dir``."""
    from megatron.core import parallel_state as ps

    from posttrain.models.mcore import layout

    name = layout.rank_dir_name(ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                                ps.get_pipeline_model_parallel_world_size())
    return it_dir / name / layout.RANK_FILE


def _rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "tracker": get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def save_megatron_checkpoint(save_dir: str | Path, iteration: int, chunks: list, optimizer,
                             args: argparse.Namespace, *, extra: dict | None = None, save_optim: bool = True,
                             save_rng: bool = True, subdir: str | None = None) -> Path:
    """Write this rank's part of iteration ``iteration`` (its ``chunks``, one per virtual stage:
    ``model``, or ``model0``, ``model1``, ... as Megatron-LM names them); returns the iteration
    directory. Every rank calls it (a barrier inside). ``save_optim`` / ``save_rng``: the seed's ``no_save_*``
    negated. ``subdir``: another model of the same iteration (PPO's ``critic``), written into
    ``iter_XXXXXXX/<subdir>/`` before the policy, without the tracker (the policy's save writes it)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from posttrain.models.mcore import layout

    save_dir = Path(save_dir)
    it_dir = save_dir / f"iter_{iteration:07d}"
    path = _rank_file(it_dir / subdir if subdir else it_dir)
    if ps.get_data_parallel_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        state = {layout.model_key(i, len(chunks)): chunk.state_dict() for i, chunk in enumerate(chunks)}
        state.update(iteration=iteration, args=args, checkpoint_version=layout.CHECKPOINT_VERSION, **(extra or {}))
        if save_optim:
            state["optimizer"] = optimizer.state_dict()
        if save_rng:
            state["rng_state"] = _rng_state()
        torch.save(state, tmp)
        os.replace(tmp, path)
    dist.barrier()
    if subdir:
        return it_dir
    if dist.get_rank() == 0:
        tracker = save_dir / layout.TRACKER
        tmp = tracker.with_name(tracker.name + ".tmp")
        tmp.write_text(f"{iteration}\n", encoding="utf-8")
        os.replace(tmp, tracker)
    dist.barrier()
    return it_dir


def load_megatron_checkpoint(load_dir: str | Path, chunks: list, optimizer, *, load_optim: bool = True,
                             load_rng: bool = True, subdir: str | None = None) -> dict:
    """Load this rank's part of the checkpoint ``load_dir`` names (a save directory's latest, or an
    ``iter_*`` directory) into ``chunks`` and
    (unless told not to) ``optimizer`` and the RNG states; returns the rank file's other entries
    (``iteration`` and the saver's ``extra``). ``subdir``: the model saved there (``critic``)."""
    from posttrain.models.mcore import layout

    load_dir = Path(load_dir)
    it_dir = layout.iteration_dir(load_dir)
    if not it_dir.name.startswith("iter_"):
        raise CheckpointError(f"{it_dir}: a converted (release) checkpoint holds no optimizer state; load it as "
                              f"the initial model instead of resuming from it")
    path = _rank_file(it_dir / subdir if subdir else it_dir)
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: this rank's shard of {it_dir} (the checkpoint was saved with "
                              f"another tensor/pipeline layout; convert it to HF and start from that)")
    state = layout.load_rank_file(path, mmap=False)  # weights_only, with the converter's allow-list
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(state.pop(layout.model_key(i, len(chunks))), strict=True)
    for key, wanted, load in (("optimizer", load_optim, optimizer.load_state_dict), ("rng_state", load_rng,
                                                                                    _set_rng_state)):
        if wanted and key not in state:
            raise CheckpointError(f"{path} holds no {key} (saved with no_save_optim / no_save_rng); set "
                                  f"no_load_optim / no_load_rng to resume without it")
        value = state.pop(key, None)
        if wanted:
            load(value)
    return state
