"""Megatron-layout checkpoints of the Megatron-Core backend, in one of Megatron's two formats:

* ``torch_dist`` (the default): Megatron-Core's ``dist_checkpointing`` writes each model's
  *sharded* state dict (global tensors, every rank its slice; the optimizer's state mapped onto
  the parameters' shards) as ``iter_XXXXXXX/{.metadata, __*.distcp, common.pt}``. It loads into
  another tensor / pipeline / virtual-stage layout: Megatron reshards on load.
* ``torch`` (legacy): ``iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt`` per model-parallel rank
  (written by data-parallel rank 0 of each), as Megatron-LM and the seed write them; loads into
  the same layout only.

Both hold the model chunks (``model``, or ``model0``, ``model1``, ... with virtual stages), Megatron's
optimizer state, the RNG states (the CPU generator, Python's, NumPy's and Megatron's tracker;
``torch_dist``: one object per rank, restored when the world size is the same), ``iteration``,
``args`` (describing the saved layout) and the caller's ``extra`` (the LR schedule, the trainer and
sampler state). A second model of the same iteration (PPO's critic) is saved in ``critic/``.
``posttrain convert --load-model-type mg`` turns either back into HF.

Nothing is half-written: the iteration is written into ``.iter_XXXXXXX.tmp`` and renamed by rank 0
once every rank has finished; only then is the tracker (``latest_checkpointed_iteration.txt``)
written (temporary name, rename). A checkpoint no tracker names is never resumed from.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from posttrain.checkpoint.save import disk_full
from posttrain.errors import CheckpointError
from posttrain.models.mcore import mcore_files
from posttrain.training.megatron.model import sharded_state_dict

FORMATS = ("torch_dist", "torch")  # Megatron-LM's --ckpt-format names; torch: the legacy per-rank files


class Part(NamedTuple):
    """One model of a checkpoint: its chunks (one per virtual stage), optimizer and extra entries;
    ``adapter_only``: a LoRA model's adapter alone (``lora_ckpt_filter``), without its frozen base."""

    chunks: list
    optimizer: Any
    extra: dict
    adapter_only: bool = False


ADAPTER_ONLY = "adapter_only"  # the entry that marks a checkpoint of a LoRA adapter without its base
VALUE_MODEL = "value_model"  # the entry that marks a critic's own checkpoint (its model ends in the value head)


def _is_adapter(key: str) -> bool:
    return ".lora." in key


def _model_state(chunk, adapter_only: bool) -> dict:
    return {k: v for k, v in chunk.state_dict().items() if not adapter_only or _is_adapter(k)}


def _load_model(chunk, state: dict, adapter_only: bool, where: Path) -> None:
    """``state`` into ``chunk``: all of it, or (``adapter_only``) the adapter, the base kept as built."""
    if not adapter_only:
        chunk.load_state_dict(state, strict=True)
        return
    result = chunk.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if _is_adapter(k)]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"{where}: the LoRA adapter does not fit this model (missing {missing[:4]}, "
                              f"unexpected {result.unexpected_keys[:4]}); resume it with the lora_* keys it was "
                              f"saved with")


def _rank_file(it_dir: Path) -> Path:
    """This rank's file in the legacy iteration directory ``it_dir``."""
    from megatron.core import parallel_state as ps

    name = mcore_files.rank_dir_name(ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                                ps.get_pipeline_model_parallel_world_size())
    return it_dir / name / mcore_files.RANK_FILE


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


def _rng_object(value):
    """This rank's RNG states as a ``dist_checkpointing`` object of its own."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject("rng_state", value, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)


def _sharded(part: Part, *, optimizer: bool, loading: bool = False) -> dict:
    """The sharded state dict of ``part``'s chunks (and optimizer)."""
    state = {mcore_files.model_key(i, len(part.chunks)): {k: v for k, v in sharded_state_dict(chunk).items()
                                                          if not part.adapter_only or _is_adapter(k)}
             for i, chunk in enumerate(part.chunks)}
    if optimizer:
        state["optimizer"] = part.optimizer.sharded_state_dict(state, is_loading=loading)
    return state


def _write(path: Path, part: Part, args, iteration: int, *, ckpt_format: str, save_optim: bool,
           save_rng: bool) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    common = {"iteration": iteration, "args": args, "checkpoint_version": mcore_files.CHECKPOINT_VERSION,
              ADAPTER_ONLY: part.adapter_only, **part.extra}
    if ckpt_format == "torch_dist":
        state = {**_sharded(part, optimizer=save_optim), **common, "world_size": dist.get_world_size()}
        if save_rng:
            state["rng_state"] = _rng_object(_rng_state())
        dist_checkpointing.save(state, str(path))
        return
    if ps.get_data_parallel_rank() == 0:
        rank_file = _rank_file(path)
        rank_file.parent.mkdir(parents=True, exist_ok=True)
        state = {mcore_files.model_key(i, len(part.chunks)): _model_state(c, part.adapter_only)
                 for i, c in enumerate(part.chunks)}
        state.update(common)
        if save_optim:
            state["optimizer"] = part.optimizer.state_dict()
        if save_rng:
            state["rng_state"] = _rng_state()
        torch.save(state, rank_file)


def save_megatron_checkpoint(save_dir: str | Path, iteration: int, parts: dict[str, Part], args: argparse.Namespace,
                             *, ckpt_format: str = "torch_dist", save_optim: bool = True,
                             save_rng: bool = True, write_more=None) -> Path:
    """Write iteration ``iteration`` of ``parts`` (``""``: the policy, at the top of the iteration;
    other names: subdirectories) in ``ckpt_format``; returns the iteration directory. Every rank
    calls it (barriers inside). ``save_optim`` / ``save_rng``: the seed's ``no_save_*`` negated;
    ``write_more(directory)``: called on every rank to add files to the iteration before it is
    published (a LoRA actor's PEFT adapter)."""
    if ckpt_format not in FORMATS:
        raise CheckpointError(f"unknown Megatron checkpoint format {ckpt_format!r}; use {' or '.join(FORMATS)}")
    save_dir = Path(save_dir)
    final, tmp = save_dir / f"iter_{iteration:07d}", save_dir / f".iter_{iteration:07d}.tmp"
    error = None
    try:
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
    except OSError as err:
        error = err
    _agree(error, final, save_dir, tmp)
    for name, part in parts.items():
        path = tmp / name if name else tmp
        if dist.get_rank() == 0 and name:
            path.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        try:
            _write(path, part, args, iteration, ckpt_format=ckpt_format, save_optim=save_optim,
                   save_rng=save_rng and not name)
        except (OSError, RuntimeError, ValueError, CheckpointException) as err:  # a full disk: torch raises
            error = err  # RuntimeError or OSError; dist_checkpointing a CheckpointException (a BaseException)
        _agree(error, final, save_dir, tmp)
    if write_more is not None:
        try:
            write_more(tmp)
        except (OSError, RuntimeError, ValueError) as err:
            error = err
        _agree(error, final, save_dir, tmp)
    if dist.get_rank() == 0:
        try:
            _publish(tmp, final, save_dir, iteration)
        except OSError as err:
            error = err
    _agree(error, final, save_dir, tmp)
    return final


def _agree(error: BaseException | None, final: Path, save_dir: Path, tmp: Path) -> None:
    """A collective: when any rank failed, rank 0 removes the temporary directory and every rank
    raises the same :class:`CheckpointError` (the previous checkpoint and the tracker are untouched)."""
    if isinstance(error, CheckpointException):  # the ranks' own errors (a full disk: "unexpected pos")
        first = next(iter(error.failures.values()), (error,))  # (exception, its traceback)
        error = first[0] if isinstance(first, tuple) else first
    mine = None
    if error is not None:
        text = str(error).splitlines()[0][:300] if str(error) else ""
        mine = ("the disk is full: " if disk_full(error) else "") + f"{type(error).__name__}: {text}"
    said: list = [None] * dist.get_world_size()
    dist.all_gather_object(said, mine)
    why = next((s for s in said if s is not None), None)
    if why is None:
        return
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    tracker = save_dir / mcore_files.TRACKER
    kept = tracker.read_text(encoding="utf-8").strip() if tracker.is_file() else None
    previous = f"the previous checkpoint {save_dir / f'iter_{int(kept):07d}'} is intact" if kept and kept.isdigit() \
        else "nothing was saved"
    raise CheckpointError(f"saving checkpoint {final} failed ({why}); {previous} and the tracker unchanged. Free "
                          f"disk space or change `save`")


def _publish(tmp: Path, final: Path, save_dir: Path, iteration: int) -> None:
    """Rank 0: rename ``tmp`` to ``final`` (an older copy of the iteration moved aside, removed once the
    tracker names the new one), then replace the tracker."""
    aside = save_dir / f".{final.name}.tmp-old"
    shutil.rmtree(aside, ignore_errors=True)
    had_old = final.exists()
    if had_old:
        os.replace(final, aside)
    try:
        os.replace(tmp, final)
        tracker = save_dir / mcore_files.TRACKER
        tracker_tmp = tracker.with_name(tracker.name + ".tmp")
        with open(tracker_tmp, "w", encoding="utf-8") as f:
            f.write(f"{iteration}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tracker_tmp, tracker)
    except OSError:
        if final.exists() and not tmp.exists():
            os.replace(final, tmp)  # removed by _agree
        if had_old:
            os.replace(aside, final)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def load_megatron_checkpoint(load_dir: str | Path, chunks: list, optimizer, *, load_optim: bool = True,
                             load_rng: bool = True, subdir: str | None = None) -> dict:
    """Load this rank's part of the checkpoint ``load_dir`` names (a save directory's latest, or an
    ``iter_*`` directory; ``subdir``: the model saved there, e.g. ``critic``) into ``chunks`` and
    (unless told not to) ``optimizer`` and the RNG states; returns the other entries (``iteration``
    and the saver's ``extra``). A ``torch_dist`` checkpoint reshards into this run's layout; its
    RNG states are restored when the world size is the one it was saved with."""
    it_dir = mcore_files.iteration_dir(Path(load_dir))
    if not it_dir.name.startswith("iter_"):
        raise CheckpointError(f"{it_dir}: a converted (release) checkpoint holds no optimizer state; load it as "
                              f"the initial model instead of resuming from it")
    path = it_dir / subdir if subdir else it_dir
    if mcore_files.is_dist_checkpoint(path):
        return _load_dist(path, chunks, optimizer, load_optim=load_optim, load_rng=load_rng)
    rank_file = _rank_file(path)
    if not rank_file.is_file():
        raise CheckpointError(f"{rank_file} is missing: this rank's shard of {path} (a legacy checkpoint loads into "
                              f"the layout it was saved with; convert it to HF and start from that)")
    state = mcore_files.load_rank_file(rank_file, mmap=False)  # weights_only, with the converter's allow-list
    adapter_only = bool(state.pop(ADAPTER_ONLY, False))
    for i, chunk in enumerate(chunks):
        _load_model(chunk, state.pop(mcore_files.model_key(i, len(chunks))), adapter_only, rank_file)
    for key, wanted, load in (("optimizer", load_optim, optimizer.load_state_dict),
                              ("rng_state", load_rng, _set_rng_state)):
        if wanted and key not in state:
            raise CheckpointError(f"{rank_file} holds no {key} (saved with no_save_optim / no_save_rng); set "
                                  f"no_load_optim / no_load_rng to resume without it")
        value = state.pop(key, None)
        if wanted:
            load(value)
    return state


def saved_adapter_only(load_dir: str | Path) -> bool:
    """The checkpoint ``load_dir`` names holds a LoRA adapter without its base (``lora_ckpt_filter``)."""
    return _saved_entry(load_dir, ADAPTER_ONLY)


def saved_value_model(load_dir: str | Path) -> bool:
    """The checkpoint ``load_dir`` names is a critic's own (saved with the entry :data:`VALUE_MODEL`)."""
    return _saved_entry(load_dir, VALUE_MODEL)


def _saved_entry(load_dir: str | Path, key: str) -> bool:
    """The saved entry ``key`` of the checkpoint ``load_dir`` names (False when it has none)."""
    it_dir = mcore_files.iteration_dir(Path(load_dir))
    if mcore_files.is_dist_checkpoint(it_dir):
        return bool(mcore_files.load_common(it_dir).get(key, False))
    first = next(iter(sorted(it_dir.glob(f"mp_rank_*/{mcore_files.RANK_FILE}"))), None)
    return first is not None and bool(mcore_files.load_rank_file(first, mmap=True, verify=False).get(key))


def _load_dist(path: Path, chunks: list, optimizer, *, load_optim: bool, load_rng: bool) -> dict:
    from megatron.core import dist_checkpointing

    common = mcore_files.load_common(path)
    adapter_only = bool(common.get(ADAPTER_ONLY, False))
    part = Part(chunks, optimizer, {}, adapter_only)
    state = _sharded(part, optimizer=load_optim, loading=True)
    same_world = common.get("world_size") == dist.get_world_size()
    if load_rng and same_world:
        state["rng_state"] = _rng_object(None)
    try:
        with torch.serialization.safe_globals(mcore_files.safe_globals()):  # args, the RNG and trainer states
            loaded = dist_checkpointing.load(state, str(path))
    except Exception as err:  # noqa: BLE001 - Megatron raises several kinds; name the checkpoint
        raise CheckpointError(f"{path}: the torch_dist checkpoint does not load into this model "
                              f"({type(err).__name__}: {str(err).splitlines()[0][:300]}); if it was saved with "
                              f"no_save_optim / no_save_rng, set no_load_optim / no_load_rng") from None
    for i, chunk in enumerate(chunks):
        _load_model(chunk, loaded.pop(mcore_files.model_key(i, len(chunks))), adapter_only, path)
    loaded.pop(ADAPTER_ONLY, None)
    if load_optim:
        optimizer.load_state_dict(loaded.pop("optimizer"))
    if "rng_state" in loaded:
        _set_rng_state(loaded.pop("rng_state"))
    return {k: v for k, v in loaded.items() if k not in ("optimizer", "rng_state")}
