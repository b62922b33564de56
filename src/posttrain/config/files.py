"""The files a run reads and the directories it writes, checked as ``train`` finds them at start-up.

``posttrain train`` refuses a config at start-up for what is on disk: a dataset prefix with no
files, a save or output directory that is a file, a ``load`` that is a file or holds no model, an
unknown ``prompt_type``, a missing ``eval_data_path`` or ``teacher_model``, a LoRA target that
matches no linear layer of the model. :func:`check_run_files` runs those checks (with the same functions ``train`` uses, and in
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
from posttrain.envs.dataset import build_env_dataset
from posttrain.rundir import RunDirs, check_dir_contents
from posttrain.paths import shipped_file

if TYPE_CHECKING:
    from posttrain.config.plan import Plan

__all__ = ["check_run_files"]


def check_run_files(plan: Plan) -> None:
    """Raise what ``train`` would raise at start-up about the files of ``plan``, in train's order
    (:class:`posttrain.loops.session.Session`): the dataset, the directories it writes, what the
    actor starts from, the prompt template, the LoRA targets, the held-out dataset."""
    d, p = plan.data, plan.policy
    if plan.stage.on_policy and d.env is not None:  # rl_config.env_config: the environment's tasks
        build_env_dataset(d.env, p, d.max_prompt_length)
    elif plan.stage.on_policy:
        mm = plan.multimodal  # a multimodal run's dataset must hold the images
        build_prompt_dataset(d.data_path, d.max_prompt_length, additional_keys=d.additional_keys, split=d.split,
                             images_per_prompt=mm.images_per_prompt if mm else None,
                             videos_per_prompt=mm.videos_per_prompt if mm else 0)
    else:
        build_offline_dataset(d.data_path, plan.stage.name, seq_length=d.seq_length, split=d.split,
                              unpaired=plan.dpo is not None and plan.dpo.unpaired)
    dirs = run_dirs(plan)
    for key, directory in [(dirs.run_dir_key, dirs.run_dir), *dirs.log_dirs.items(), ("actor_config.save", dirs.save),
                           ("critic_config.save", dirs.critic_save)]:
        if directory is not None:
            _check_dir_target(directory, key)
    check_dir_contents(dirs)
    start = _check_start(p.load, p.tokenizer)
    if plan.stage.on_policy:
        path = p.prompt_type_path if p.prompt_type_path and shipped_file(p.prompt_type_path).is_file() else None
        get_template(p.prompt_type or "hf_chat_template", path)
    if start is not None and plan.parallel.backend == "hf":
        _check_lora(p.lora, start)
    if plan.distill is not None:
        _check_teacher(plan.distill.teacher)
    if plan.stage.on_policy and d.eval_data_path:
        build_prompt_dataset(d.eval_data_path, d.max_prompt_length, additional_keys=d.additional_keys,
                             split=d.split, key="rl_config.eval_data_path")


def run_dirs(plan: Plan) -> RunDirs:
    """The directories ``plan`` writes, as :func:`posttrain.rundir.claim_run_dirs` checks and locks
    them (``plan``'s read-only check and the session's claim)."""
    s, logs = plan.schedule, plan.logging
    log_dirs = {}
    if logs.use_tensorboard and logs.tensorboard_dir:
        log_dirs["rl_config.tensorboard_log_dir"] = Path(logs.tensorboard_dir)
    if logs.use_wandb and logs.wandb_save_dir:
        log_dirs["rl_config.wandb_save_dir"] = Path(logs.wandb_save_dir)
    critic = plan.critic
    return RunDirs(run_dir=Path(s.run_dir), run_dir_key=s.run_dir_key, save=Path(s.save) if s.save else None,
                   actor=plan.policy.checkpoint,
                   critic_save=Path(critic.save_dir) if critic is not None and critic.save_dir else None,
                   critic=critic.checkpoint if critic is not None else plan.policy.checkpoint, log_dirs=log_dirs)


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
    model or checkpoint; returns the directory a model is read from (None for a Megatron
    checkpoint, whose layers are read when it is converted)."""
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
    return path


def _check_teacher(teacher: str) -> None:
    """``rl_config.teacher_model`` exists and holds an HF model or checkpoint (its vocabulary is
    compared with the actor's when it is loaded: :func:`posttrain.roles.policy.check_teacher_vocab`)."""
    if not Path(teacher).exists():
        raise ConfigError(f"rl_config.teacher_model: {teacher} does not exist; set it to the teacher's HF model "
                          f"directory or checkpoint")
    try:
        resolve_checkpoint(teacher)
    except CheckpointError as err:
        raise ConfigError(f"rl_config.teacher_model: {err}") from err


def _check_lora(options: lora.LoraOptions | None, path: Path) -> None:
    """The LoRA keys against the model in ``path``: an adapter there needs the LoRA keys, with its
    rank, alpha and targets (:func:`posttrain.models.lora.check_adapter_keys`); the targets must
    match linear layers of the base (:func:`posttrain.models.lora.hf_targets`). The base is built
    on the meta device (no weights read)."""
    has_adapter = lora.is_adapter_dir(path)
    lora.check_adapter_wanted(path, options)
    if options is None:
        return
    import torch  # lazy: the model is built only to list its layers
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(lora.adapter_base(path) if has_adapter else path))
    except (OSError, ValueError, KeyError):
        return  # the model's own loader names what is wrong with its config.json
    auto = AutoModelForCausalLM
    if getattr(config, "vision_config", None) is not None:  # a vision-language model (Qwen2.5-VL)
        from transformers import AutoModelForImageTextToText as auto
    with torch.device("meta"):
        model = auto.from_config(config)
    if has_adapter:
        lora.check_adapter_keys(path, options, model)
    lora.hf_targets(options.target_modules, model)
