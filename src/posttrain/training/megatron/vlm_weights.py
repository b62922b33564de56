"""The trained language model of a Qwen2.5-VL on the megatron backend back into its Hugging Face
VLM (:mod:`posttrain.training.megatron.vision`): the weight sync, and what its HF checkpoint saves."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

import torch

from posttrain.checkpoint.files import make_readable
from posttrain.training.megatron import vision
from posttrain.training.megatron.model import hf_weights


def hf_param_name(name: str) -> str:
    """The in-memory Transformers name of the language-model weight ``name`` of
    :func:`posttrain.training.megatron.model.hf_weights` (``model.layers.0...`` ->
    ``model.language_model.layers.0...``; ``lm_head.weight`` stays)."""
    return vision.LANGUAGE_PREFIX + name[len("model."):] if name.startswith("model.") else name


def copy_language_model(chunks: list, args: argparse.Namespace, hf_model: torch.nn.Module) -> int:
    """The trained language model of ``chunks`` (this rank's part; gathered on every rank, so all
    ranks call it together) copied into ``hf_model`` (a ``Qwen2_5_VLForConditionalGeneration``, whose
    vision tower stays as it is): the rollout's weight sync, and what a Hugging Face checkpoint saves
    (``hf_model.save_pretrained``). Returns the number of tensors copied."""
    params = dict(hf_model.named_parameters(remove_duplicate=False))
    count = 0
    with torch.no_grad():
        for name, tensor in hf_weights(chunks, args):
            target = params.get(hf_param_name(name))
            if target is None:
                raise KeyError(f"{name}: no such language-model weight in the Hugging Face VLM")
            target.copy_(tensor.to(target.dtype))
            count += 1
    return count


def save_vlm(chunks: list, args: argparse.Namespace, hf_model: torch.nn.Module, out_dir: str | Path,
             processor=None) -> Path | None:
    """Save the VLM with the trained language model of ``chunks`` as a Hugging Face Qwen2.5-VL
    directory ``out_dir`` (``AutoModelForImageTextToText`` loads it; the processor's tokenizer and
    ``preprocessor_config.json`` beside it): every rank gathers (:func:`copy_language_model`), the
    first writes, into a temporary directory renamed when complete. Returns ``out_dir`` on the writer."""
    import torch.distributed as dist

    copy_language_model(chunks, args, hf_model)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        hf_model.save_pretrained(str(tmp))
        if processor is not None:
            processor.save_pretrained(tmp)
        make_readable(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
