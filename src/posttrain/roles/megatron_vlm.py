"""A vision-language actor (Qwen2.5-VL) on the megatron backend: what a rank of
:class:`~posttrain.roles.megatron_policy.MegatronPolicy` holds beside its ``GPTModel`` chunks.

* **The Hugging Face VLM** (:func:`load_vlm`), loaded from the run's HF directory on every rank,
  all of it frozen: its vision tower and ``get_rope_index`` feed the chunks
  (:class:`~posttrain.training.megatron.vision.VisionInputs`: each rank runs the tower on its
  micro-batch's images), and on a replica's leader it is also the native rollout's copy, whose
  language model :func:`~posttrain.training.megatron.vlm_weights.copy_language_model` refreshes
  after every update (all ranks gather the shards; every rank copies into its own VLM, which keeps
  the collective the same on all of them).
* **Checkpoints**: Megatron's layout as for a text model, and beside it in ``iter_XXXXXXX/hf/`` the
  trained VLM as a Hugging Face Qwen2.5-VL directory with its processor
  (:func:`~posttrain.training.megatron.vlm_weights.save_vlm`), which
  ``AutoModelForImageTextToText`` loads and a new run can start from.
* **Resume** (``actor_config.load`` a run's checkpoint, ``finetune: false``): the ``GPTModel``
  from the Megatron files (their saved arguments hold the multimodal rotary layout:
  ``position_embedding_type: mrope`` and ``mrope_section``), with the optimizer, LR schedule and
  trainer state; the frozen HF VLM from the checkpoint's ``iter_XXXXXXX/hf`` (:func:`vlm_source`):
  the tower is frozen, so it is the original directory's, and the checkpoint is then complete on its
  own (the original directory may have moved); its language model is overwritten from the chunks
  before the first rollout anyway. The reference is rebuilt from the run's ``initial_model`` (the
  original HF directory) as for a text run.
* **Not built** (refused by :func:`posttrain.config.backend.check_vlm_load`): ``finetune: true``
  from a VLM's Megatron checkpoint, or a Megatron checkpoint without the trained VLM beside it (a
  converted ``release``: no tower).
"""

from __future__ import annotations

from pathlib import Path

import torch

from posttrain.errors import ConfigError
from posttrain.models.vlm import MEGATRON_HF_SUBDIR, saved_vlm_dir

HF_SUBDIR = MEGATRON_HF_SUBDIR  # the trained VLM as a Hugging Face directory in each checkpoint iteration


def vlm_source(source: str) -> str:
    """The Hugging Face directory a rank's frozen VLM loads from: the run's own checkpoint
    iteration's ``hf/`` when ``source`` is a Megatron checkpoint (a resume), else ``source``'s."""
    from posttrain.checkpoint import resolve_checkpoint
    from posttrain.models.mcore.mcore_files import is_mcore_checkpoint, iteration_dir

    if not is_mcore_checkpoint(source):
        return str(resolve_checkpoint(source)[0])
    hf_dir = saved_vlm_dir(iteration_dir(source))
    if hf_dir is None:  # the config check refuses it first (posttrain.config.backend.check_vlm_load)
        raise ConfigError(f"actor_config.load={source}: no trained VLM in {iteration_dir(source)}/{HF_SUBDIR}")
    return str(hf_dir)


def load_vlm(hf_dir: str, device: str, dtype: str) -> torch.nn.Module:
    """The Hugging Face VLM of ``hf_dir`` on ``device`` in ``dtype``, in eval mode, every weight frozen
    (the trained language model lives in the Megatron chunks; the tower is frozen)."""
    from transformers import AutoModelForImageTextToText

    from posttrain.training.megatron.vision import is_vlm_dir, mrope_section

    if not is_vlm_dir(hf_dir):
        raise ConfigError(f"rl_config.is_multimodal: true, but {hf_dir} holds a text model; give a vision-language "
                          f"model (Qwen2.5-VL) in actor_config.load, or set is_multimodal: false")
    mrope_section(hf_dir)  # a Qwen2.5-VL with a rotary split the megatron backend builds, else a ConfigError
    model = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=getattr(torch, dtype)).to(device)
    return model.eval().requires_grad_(False)


def save_hf_vlm(chunks: list, args, vlm: torch.nn.Module, directory: Path, processor_dir: str) -> None:
    """The trained VLM in ``directory / HF_SUBDIR`` (a collective: every rank gathers, rank 0 writes
    it with the processor of ``processor_dir``)."""
    import torch.distributed as dist

    from posttrain.models.vlm import load_processor
    from posttrain.training.megatron.vlm_weights import save_vlm

    processor = load_processor(processor_dir) if dist.get_rank() == 0 else None
    save_vlm(chunks, args, vlm, Path(directory) / HF_SUBDIR, processor)
