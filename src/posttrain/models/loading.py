"""Loading Hugging Face models and tokenizers for the roles, with clear errors."""

from __future__ import annotations

from pathlib import Path

from posttrain.errors import ConfigError

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


def torch_dtype(name: str):
    import torch

    try:
        return getattr(torch, DTYPES[name])
    except KeyError:
        raise ConfigError(f"unknown dtype '{name}'; use one of {', '.join(DTYPES)}") from None


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(path: str | Path, *, device: str = "cpu", dtype: str = "float32",
                   attn_implementation: str | None = "sdpa"):
    """Load an ``AutoModelForCausalLM`` in ``dtype`` (weights; autocast is separate) on ``device``.

    ``path`` is an HF model directory, a checkpoint save dir (its latest ``iter_*``) or an ``iter_*`` dir
    (:func:`posttrain.checkpoint.resolve_checkpoint`)."""
    from transformers import AutoModelForCausalLM

    from posttrain.checkpoint import resolve_checkpoint

    path, _ = resolve_checkpoint(path)
    kwargs = {"dtype": torch_dtype(dtype)}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    return model.to(device)


def check_vocab(model, tokenizer, where: str) -> None:
    """A tokenizer whose ids do not fit the model's embedding is a user error, caught up front."""
    emb = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > emb:
        raise ConfigError(f"{where}: the tokenizer has {len(tokenizer)} tokens but the model's embedding has only "
                          f"{emb} rows; use the tokenizer that belongs to this model "
                          f"(megatron_training.tokenizer_name_or_path)")
