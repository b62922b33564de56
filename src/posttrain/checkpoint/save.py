"""Saving a checkpoint: everything is written into a hidden temporary directory next to the target,
fsynced and renamed; then the tracker file is replaced atomically. A failed save raises
:class:`~posttrain.errors.CheckpointError` and leaves the previous checkpoint and tracker untouched."""

from __future__ import annotations

import errno
import json
import os
import pickle
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch

from posttrain.checkpoint.files import (FORMAT, STATE_FILE, TRACKER, Part, _fsync_dir, _fsync_tree, _remove_path,
                                        _torch_save, _write_text, iter_dir_name, make_readable, rng_state)
from posttrain.checkpoint.verify import _previous, find_latest, list_checkpoints
from posttrain.errors import CheckpointError


def _save_part(out: Path, model: Any, optimizer: Any, scheduler: Any, tokenizer: Any,
               save_optim: bool, adapter_only: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)  # a PEFT model: its adapter
    if hasattr(model, "peft_config") and not adapter_only:  # and the (frozen) base in base/ (models.lora)
        save_hf_weights(model, out / "base")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    if save_optim and optimizer is not None:
        _torch_save(optimizer.state_dict(), out / "optimizer.pt")
    if save_optim and scheduler is not None:
        _torch_save(scheduler.state_dict(), out / "scheduler.pt")


def save_hf_weights(model, out: Path) -> None:
    """The base model of the PEFT ``model`` (or a plain model) as an HF directory in ``out``
    (``config.json`` and ``model.safetensors``; a tied weight once). Written from the state dict,
    without the adapter's tensors and with PEFT's ``base_layer`` names mapped back to the base
    model's own: inside a PEFT model the base's linears are wrapped in LoRA layers."""
    from safetensors.torch import save_file  # lazy: plan imports checkpoint/, reads no weights

    base = model.get_base_model() if hasattr(model, "peft_config") else model
    Path(out).mkdir(parents=True, exist_ok=True)
    base.config.save_pretrained(str(out))
    tensors, seen = {}, set()
    for name, tensor in base.state_dict().items():
        if "lora_" in name or tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        tensors[name.replace(".base_layer.", ".")] = tensor.detach().contiguous()
    save_file(tensors, str(Path(out) / "model.safetensors"), metadata={"format": "pt"})


def _write_checkpoint(tmp: Path, iteration: int, model: Any, optimizer: Any, scheduler: Any,
                      tokenizer: Any, generator: Any, sampler_state: Any, trainer_state: dict,
                      extra: dict[str, Part], save_optim: bool, save_rng: bool, adapter_only: bool,
                      files: dict[str, Any]) -> None:
    _save_part(tmp, model, optimizer, scheduler, tokenizer, save_optim, adapter_only)
    for name, obj in files.items():
        _torch_save(obj, tmp / name)
    for name, part in extra.items():
        _save_part(tmp / name, part.model, part.optimizer, part.scheduler, None, save_optim)
    if save_rng:
        _torch_save(rng_state(generator), tmp / "rng.pt")
    if sampler_state is not None:
        _torch_save(sampler_state, tmp / "sampler.pt")
    state = {"format": FORMAT, **trainer_state, "iteration": iteration, "sampler_saved": sampler_state is not None}
    _write_text(tmp / STATE_FILE, json.dumps(state, indent=2, sort_keys=True) + "\n")
    make_readable(tmp)


def disk_full(err: BaseException) -> bool:
    """Whether ``err`` is a write that ran out of space (torch's zip writer reports it as a
    RuntimeError "unexpected pos", not as ENOSPC)."""
    return getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or any(
        text in str(err) for text in ("No space left on device", "unexpected pos"))


def _write_tracker(save_dir: Path, iteration: int) -> None:
    tmp = save_dir / f".{TRACKER}.tmp-{os.getpid()}"
    _write_text(tmp, f"{iteration}\n")
    os.replace(tmp, save_dir / TRACKER)
    _fsync_dir(save_dir)


def _publish(tmp: Path, target: Path, aside: Path, save_dir: Path, iteration: int) -> None:
    """Rename ``tmp`` to ``target`` and update the tracker; on failure restore the old state.

    Re-saving an existing iteration moves the old directory aside first and deletes it only
    once the tracker is written.
    """
    had_old = os.path.lexists(target)
    if had_old:
        os.rename(target, aside)
    try:
        os.rename(tmp, target)
        _fsync_dir(save_dir)
        _write_tracker(save_dir, iteration)
    except BaseException:
        if target.exists() and not tmp.exists():
            shutil.rmtree(target, ignore_errors=True)
        if had_old:
            os.rename(aside, target)
        raise
    if had_old:
        _remove_path(aside)  # a moved-aside symlink is unlinked, its target untouched


def _remove_stale_temps(save_dir: Path) -> None:
    """Remove temporary dirs (and moved-aside links) left by a save that was killed; a run holds
    the save dir's lock (:mod:`posttrain.loops.session`), so no live save owns them."""
    for path in save_dir.glob(".iter_*.tmp*"):
        _remove_path(path)


def save_checkpoint(save_dir: str | Path, iteration: int, model: Any, optimizer: Any = None,
                    scheduler: Any = None, *, tokenizer: Any = None,
                    generator: torch.Generator | None = None, sampler_state: Any = None,
                    trainer_state: dict | None = None, extra: dict[str, Part] | None = None,
                    save_optim: bool = True, save_rng: bool = True,
                    keep_last: int | None = None, adapter_only: bool = False,
                    files: dict[str, Any] | None = None) -> Path:
    """Write ``<save_dir>/iter_XXXXXXX`` atomically and point the tracker file at it.

    Args:
        model: an HF ``PreTrainedModel`` (saved with ``save_pretrained``, safetensors).
        tokenizer: saved next to the weights so the directory loads with ``from_pretrained``.
        generator: a ``torch.Generator`` whose state is saved with the global RNG states.
        sampler_state: the data sampler's state (tensors, numbers, lists, dicts).
        trainer_state: JSON-serialisable loop state (consumed samples, KL coefficient...).
        extra: more modules to save in subdirectories, e.g. ``{"critic": Part(critic, opt)}``.
        save_optim / save_rng: the seed's ``no_save_optim`` / ``no_save_rng`` negated.
        keep_last: if set, delete older ``iter_*`` directories beyond the newest ``keep_last``.
        adapter_only: a PEFT (LoRA) model's adapter alone (``lora_ckpt_filter``); without it the
            frozen base model is saved in ``base/``, so the directory stands alone.
        files: more objects, each ``torch.save``-d to its file name (the loop's in-flight samples).
    Returns the checkpoint directory. Call it on one process (rank 0) with full weights.
    """
    save_dir = Path(save_dir)
    target = save_dir / iter_dir_name(iteration)
    trainer_state = dict(trainer_state or {})
    try:
        json.dumps(trainer_state)
    except TypeError as err:
        raise CheckpointError(f"trainer_state must be JSON-serialisable: {err}") from err
    tmp = save_dir / f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        save_dir.mkdir(parents=True, exist_ok=True)
        _remove_stale_temps(save_dir)
        tmp.mkdir()
    except OSError as err:
        raise CheckpointError(f"cannot create the checkpoint directory {save_dir}: {err}") from err
    previous = _previous(save_dir)
    aside = save_dir / f".{target.name}.tmp-old-{os.getpid()}"
    try:
        _write_checkpoint(tmp, iteration, model, optimizer, scheduler, tokenizer, generator,
                          sampler_state, trainer_state, extra or {}, save_optim, save_rng, adapter_only, files or {})
        _fsync_tree(tmp)
        _publish(tmp, target, aside, save_dir, iteration)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(err, (OSError, RuntimeError, ValueError, pickle.PicklingError)):
            raise
        kept = f"the previous checkpoint {previous} is intact" if previous else "nothing was saved"
        why = f"the disk is full ({err})" if disk_full(err) else str(err)
        raise CheckpointError(f"saving checkpoint iteration {iteration} to {target} failed: "
                              f"{why}; {kept}. Free disk space or change `save`.") from err
    if keep_last:
        prune_checkpoints(save_dir, keep_last)
    return target


def prune_checkpoints(save_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` checkpoints (never the tracker's); returns the deleted."""
    latest = find_latest(save_dir)
    doomed = [p for _, p in list_checkpoints(save_dir)[:-keep_last] if p != latest]
    for path in doomed:
        shutil.rmtree(path)
    return doomed
