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


def resolve_model_path(path: str | Path) -> Path:
    """An HF model directory; a posttrain checkpoint dir resolves to its latest ``iter_*/``."""
    path = Path(path)
    if (path / "latest_checkpointed_iteration.txt").is_file():
        text = (path / "latest_checkpointed_iteration.txt").read_text().strip()
        if text.isdigit():
            path = path / f"iter_{int(text):07d}"
    if not (path / "config.json").is_file():
        hint = ""
        if path.exists() and any(path.glob("*.gguf")):
            hint = " It holds a GGUF file: convert it first (see posttrain.models.pretrained)."
        raise ConfigError(f"{path}: not a Hugging Face model directory (no config.json).{hint}")
    return path


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(path: str | Path, *, device: str = "cpu", dtype: str = "float32",
                   attn_implementation: str | None = "sdpa"):
    """Load an ``AutoModelForCausalLM`` in ``dtype`` (weights; autocast is separate) on ``device``."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(path)
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
