"""The files a run reads and the directories it writes, checked as ``train`` finds them at start-up.

``posttrain train`` refuses a config at start-up for what is on disk: a dataset prefix with no
files, a save or output directory that is a file, a ``load`` that is a file or holds no model, an
unknown ``prompt_type``, a missing ``eval_data_path``, a LoRA target that matches no linear layer of
the model. :func:`check_run_files` runs those checks (with the same functions ``train`` uses, and in
its order) without writing anything, so that ``posttrain plan`` calls no config valid that
``train`` refuses. :func:`posttrain.config.plan.resolve_plan` runs it with ``files=True``, as the
commands ``plan``, ``train`` and ``bench`` do; a config built in Python for a test that never
touches the disk leaves it off.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from posttrain.checkpoint import list_checkpoints, resolve_checkpoint
from posttrain.data.builders import build_offline_dataset, build_prompt_dataset
from posttrain.data.templates import get_template
from posttrain.errors import CheckpointError, ConfigError
from posttrain.models import lora
from posttrain.models.mcore import mcore_files

if TYPE_CHECKING:
    from posttrain.config.plan import Plan

__all__ = ["check_run_files"]


def check_run_files(plan: Plan) -> None:
    """Raise what ``train`` would raise at start-up about the files of ``plan``, in train's order
    (:class:`posttrain.loops.session.Session`): the dataset, the directories it writes, what the
    actor starts from, the prompt template, the LoRA targets, the held-out dataset."""
    d, p, s = plan.data, plan.policy, plan.schedule
    if plan.stage.on_policy:
        build_prompt_dataset(d.data_path, d.max_prompt_length, additional_keys=d.additional_keys, split=d.split)
    else:
        build_offline_dataset(d.data_path, plan.stage.name, seq_length=d.seq_length, split=d.split)
    _check_dir_target(s.run_dir, s.run_dir_key)
    if plan.logging.use_tensorboard and plan.logging.tensorboard_dir:
        _check_dir_target(plan.logging.tensorboard_dir, "rl_config.tensorboard_log_dir")
    if plan.logging.use_wandb and plan.logging.wandb_save_dir:
        _check_dir_target(plan.logging.wandb_save_dir, "rl_config.wandb_save_dir")
    if s.save:
        _check_dir_target(s.save, "actor_config.save")
    if plan.critic is not None and plan.critic.save_dir:
        _check_dir_target(plan.critic.save_dir, "critic_config.save")
    model_dir = _check_start(p.load, p.tokenizer)
    if plan.stage.on_policy:
        path = p.prompt_type_path if p.prompt_type_path and Path(p.prompt_type_path).is_file() else None
        get_template(p.prompt_type or "hf_chat_template", path)
    if p.lora is not None and model_dir is not None and plan.parallel.backend == "hf":
        _check_lora_targets(p.lora.target_modules, model_dir)
    if plan.stage.on_policy and d.eval_data_path:
        build_prompt_dataset(d.eval_data_path, d.max_prompt_length, additional_keys=d.additional_keys,
                             split=d.split, key="rl_config.eval_data_path")


def _check_dir_target(directory: str, key: str) -> None:
    """A directory the run will create or write: not an existing file, and creatable (nothing is
    created here)."""
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key} {path} is an existing file, not a directory; give a directory path")
    above = path
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        raise ConfigError(f"{key} {path}: cannot create the directory ({above} is a file); give another path")
    if not os.access(above, os.W_OK | os.X_OK):
        raise ConfigError(f"{key} {path} is not writable ({above}: permission denied); fix its permissions or "
                          f"choose another directory")


def _check_start(load: str | None, tokenizer: str | None) -> Path | None:
    """What the actor starts from (``load``, else the tokenizer's directory) exists and holds a
    model or checkpoint; returns its HF model directory (None for a Megatron checkpoint, whose
    layers are read when it is converted)."""
    source = load or tokenizer
    if not source:
        raise ConfigError("set actor_config.load (an HF model or checkpoint directory) or "
                          "megatron_training.tokenizer_name_or_path (an HF model directory)")
    if not Path(source).exists():
        raise ConfigError(f"actor_config.load / tokenizer_name_or_path: {source} does not exist")
    if mcore_files.is_mcore_checkpoint(source):
        return None
    try:
        path, _ = resolve_checkpoint(source)
    except CheckpointError:
        if Path(source).is_dir() and list_checkpoints(source):
            return None  # checkpoints with a damaged latest one: train names it, or falls back to an earlier one
        raise
    return lora.adapter_base(path) if lora.is_adapter_dir(path) else path


def _check_lora_targets(targets, model_dir: Path) -> None:
    """``lora_target_modules`` against the linear layers of the model in ``model_dir``, built on the
    meta device (no weights read): :func:`posttrain.models.lora.hf_targets`, as train calls it."""
    import torch  # lazy: the model is built only to list its layers
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(model_dir))
    except (OSError, ValueError, KeyError):
        return  # the model's own loader names what is wrong with its config.json
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    lora.hf_targets(targets, model)
