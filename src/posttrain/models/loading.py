"""Loading Hugging Face models and tokenizers for the roles, with clear errors."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.checkpoint import STATE_FILE, resolve_checkpoint
from posttrain.errors import ConfigError
from posttrain.models.mcore.cache import hf_cache_for
from posttrain.models.mcore.mcore_files import is_mcore_checkpoint
from posttrain.models.vlm import is_vlm_dir

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


def torch_dtype(name: str):
    try:
        return getattr(torch, DTYPES[name])
    except KeyError:
        raise ConfigError(f"unknown dtype '{name}'; use one of {', '.join(DTYPES)}") from None


def resolve_model(source: str | Path) -> tuple[Path, bool]:
    """``(HF model directory, is_full_checkpoint)`` of a model path: a posttrain save directory (its
    latest ``iter_*``), an ``iter_*`` directory or an HF directory
    (:func:`posttrain.checkpoint.resolve_checkpoint`), or a Megatron checkpoint, converted once into
    an HF cache (:func:`posttrain.models.mcore.cache.hf_cache_for`; never a full checkpoint here)."""
    path = Path(source)
    if path.is_dir() and not (path / STATE_FILE).is_file() and is_mcore_checkpoint(path):
        return hf_cache_for(path), False
    return resolve_checkpoint(path)


def resolve_model_dir(source: str | Path) -> Path:
    """The HF model directory of a model path (:func:`resolve_model`)."""
    return resolve_model(source)[0]


def load_tokenizer(path: str | Path):
    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(path: str | Path, *, device: str = "cpu", dtype: str = "float32",
                   attn_implementation: str | None = "sdpa"):
    """Load an ``AutoModelForCausalLM`` in ``dtype`` (weights; autocast is separate) on ``device``.

    ``path`` is an HF model directory, a checkpoint save dir (its latest ``iter_*``), an ``iter_*`` dir
    or a Megatron checkpoint (:func:`resolve_model`)."""
    path = resolve_model_dir(path)
    kwargs = {"dtype": torch_dtype(dtype)}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if is_vlm_dir(path):  # a vision-language model (Qwen2.5-VL): its conditional-generation class
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText.from_pretrained(str(path), **kwargs).to(device)
    model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    return model.to(device)


def check_vocab(model, tokenizer, where: str) -> None:
    """A tokenizer whose ids do not fit the model's embedding is a user error, caught up front."""
    emb = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > emb:
        raise ConfigError(f"{where}: the tokenizer has {len(tokenizer)} tokens but the model's embedding has only "
                          f"{emb} rows; use the tokenizer that belongs to this model "
                          f"(megatron_training.tokenizer_name_or_path)")
