"""Loading a checkpoint: weights (always), and for a resume the optimizer, LR schedule, RNG,
sampler and trainer state, with the seed's ``finetune`` / ``no_load_optim`` / ``no_load_rng``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from posttrain.checkpoint.files import Part, set_rng_state
from posttrain.checkpoint.verify import (_load_file, _read_json_object, _read_weights, read_trainer_state,
                                         resolve_checkpoint)
from posttrain.errors import CheckpointError

log = logging.getLogger(__name__)


def load_adapter_weights(path: str | Path, model) -> None:
    """The adapter weights saved in ``path`` (``adapter_model.safetensors``) into the PEFT ``model``."""
    from peft import set_peft_model_state_dict  # lazy: peft (seconds), LoRA only
    from safetensors.torch import load_file  # lazy: plan imports checkpoint/, reads no weights

    file = Path(path) / "adapter_model.safetensors"
    if not file.is_file():
        raise CheckpointError(f"{file} is missing: {path} holds no LoRA adapter, but this run trains one "
                              f"(actor_config.lora_target_modules); load a LoRA checkpoint or start from the base")
    result = set_peft_model_state_dict(model, load_file(str(file)))
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    missing = [k for k in getattr(result, "missing_keys", []) or [] if "lora_" in k]
    if unexpected or missing:
        raise CheckpointError(f"{file}: its adapter does not fit this model (unexpected {unexpected[:4]}, missing "
                              f"{missing[:4]}); check lora_target_modules and the base model")


def load_weights(path: str | Path, model: torch.nn.Module) -> None:
    """Copy the HF weights saved in ``path`` into ``model`` in place (tied weights allowed); into a
    PEFT (LoRA) model, its adapter (the base is the one it was built on)."""
    path = Path(path)
    if hasattr(model, "peft_config"):
        load_adapter_weights(path, model)
        return
    config = path / "config.json"
    if config.is_file():
        _read_json_object(config)
    state = _read_weights(path)
    own = model.state_dict()
    if getattr(getattr(model, "config", None), "vision_config", None) is not None and not set(state) <= set(own):
        # a vision-language model: Transformers saves it under the original checkpoint's names (its
        # conversion mapping), which its own loader maps back to the module's
        state = type(model).from_pretrained(str(path), dtype=next(model.parameters()).dtype).state_dict()
    loaded_ptrs = {own[k].data_ptr() for k in state if k in own}
    missing = [k for k in own if k not in state and own[k].data_ptr() not in loaded_ptrs]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        raise CheckpointError(f"{path}: weights do not match the model (missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}); is this checkpoint for this model?")
    mismatched = [k for k in state if state[k].shape != own[k].shape]
    if mismatched:
        k = mismatched[0]
        raise CheckpointError(f"{path}: {k} has shape {tuple(state[k].shape)} in the checkpoint "
                              f"but {tuple(own[k].shape)} in the model")
    model.load_state_dict(state, strict=False)


def _load_optim(path: Path, optimizer: Any, scheduler: Any) -> None:
    for obj, name in ((optimizer, "optimizer.pt"), (scheduler, "scheduler.pt")):
        if obj is None:
            continue
        if not (path / name).is_file():
            raise CheckpointError(f"{path / name} is missing (saved with no_save_optim?); set "
                                  f"no_load_optim: true to start with a fresh optimizer")
        try:
            obj.load_state_dict(_load_file(path / name))
        except (ValueError, KeyError) as err:
            raise CheckpointError(f"{path / name} does not fit this {type(obj).__name__} ({err}); "
                                  f"set no_load_optim: true to start with a fresh one") from err


def load_part(checkpoint_dir: str | Path, name: str, part: Part, *, no_load_optim: bool = False) -> bool:
    """Restore an extra part saved by ``save_checkpoint(extra={name: part})`` (weights, and unless
    ``no_load_optim`` its optimizer and scheduler); False when the checkpoint has no such part."""
    path = Path(checkpoint_dir) / name
    if not (path / "config.json").is_file():
        return False
    load_weights(path, part.model)
    if not no_load_optim:
        _load_optim(path, part.optimizer, part.scheduler)
    return True


def load_checkpoint(load_dir: str | Path, model: Any, optimizer: Any = None, scheduler: Any = None,
                    *, finetune: bool = False, no_load_optim: bool = False,
                    no_load_rng: bool = False, generator: torch.Generator | None = None,
                    extra: dict[str, Part] | None = None) -> dict[str, Any]:
    """Load weights (always) and, for a resume, optimizer/scheduler/RNG/sampler/trainer state.

    Returns the trainer state: the saved dict (``iteration``, ``consumed_samples``, ...) plus
    ``sampler_state`` (None if not restored) and ``checkpoint_dir``. With ``finetune`` or a plain
    HF directory: weights only, ``{"iteration": 0, "consumed_samples": 0, ...}``.
    """
    path, full = resolve_checkpoint(load_dir)
    load_weights(path, model)
    if not (finetune or not full or no_load_optim):
        _load_optim(path, optimizer, scheduler)
    for name, part in (extra or {}).items():
        if not load_part(path, name, part, no_load_optim=finetune or not full or no_load_optim):
            raise CheckpointError(f"{path / name} is missing: this checkpoint has no {name}")
    if finetune or not full:
        return {"iteration": 0, "consumed_samples": 0, "sampler_state": None,
                "checkpoint_dir": str(path)}
    if not no_load_rng:
        if not (path / "rng.pt").is_file():
            raise CheckpointError(f"{path / 'rng.pt'} is missing (saved with no_save_rng?); set "
                                  f"no_load_rng: true to resume without it")
        try:
            set_rng_state(_load_file(path / "rng.pt"), generator)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as err:
            raise CheckpointError(f"{path / 'rng.pt'}: not the RNG states posttrain saves ({type(err).__name__}: "
                                  f"{err}); the file is corrupt. Set no_load_rng: true to resume without it") from None
    state = read_trainer_state(path)
    state.pop("format", None)
    sampler_saved = state.pop("sampler_saved", True)  # older checkpoints always had one
    sampler = path / "sampler.pt"
    if sampler.is_file():
        state["sampler_state"] = _load_file(sampler)
    elif not sampler_saved:
        state["sampler_state"] = None
    elif no_load_rng:
        log.warning("%s is missing; no_load_rng is set, so the data sampler restarts at the first batch of "
                    "epoch 0 (prompts already trained on are drawn again)", sampler)
        state["sampler_state"] = None
    else:
        raise CheckpointError(f"{sampler} is missing, so the data order cannot be resumed; set no_load_rng: "
                              f"true to resume anyway with the sampler restarted at epoch 0 (prompts already "
                              f"trained on are drawn again)")
    state["checkpoint_dir"] = str(path)
    return state
