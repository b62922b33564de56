"""The dataset YAML (``configs/datasets/*.yaml``): the seed's DataHandlerConfig keys and defaults.

Every key of the seed is accepted. Keys posttrain does not act on are listed in
:data:`INERT_KEYS`; setting one away from its default prints one warning naming them.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from posttrain.data.handlers import HANDLERS
from posttrain.errors import ConfigError
from posttrain.data.tokenizer_files import FILE_TYPES, tokenizer_files

MAX_ROW_TOKENS = 2**31 - 1  # the .idx stores row lengths as int32

PROMPT_TYPE_HANDLERS = ["AlpacaStyleInstructionHandler", "AlpacaStylePairwiseHandler",
                        "AlpacaStyleProcessRewardHandler", "R1AlpacaStyleInstructionHandler",
                        "Math17kAlpacaStyleInstructionHandler"]

# accepted for compatibility; posttrain does not act on them (see docs/data.md)
INERT_KEYS = {"streaming": False, "json_keys": ["text"], "split_sentences": False, "keep_newlines": False,
              "interleave_probs": None, "overwrite_cache": False, "cache_dir": "~/cache",
              "script_data_dir": None, "tokenizer_not_use_fast": True,
              "make_vocab_size_divisible_by": 128, "pad_vocab_size_to": None,
              "placeholder_token": "ки", "reward_tokens": [], "dataset_impl": "mmap", "n_subs": 1,
              "merge_group_keys": None}


class DataHandlerConfig(BaseModel):
    """Keys and defaults of the seed's ``config_cls/data_handler_config.py``."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    input: Optional[str] = None
    handler_name: str = ""
    streaming: bool = False
    json_keys: list[str] = ["text"]
    split_sentences: bool = False
    keep_newlines: bool = False
    prompt_type: Optional[str] = "empty"
    prompt_type_path: Optional[str] = None  # None: configs/model/templates.json
    dataset_additional_keys: list[str] = []
    interleave_probs: Optional[Any] = None
    overwrite_cache: bool = False
    seed: int = 1234
    cache_dir: str = "~/cache"
    map_keys: Optional[dict[str, Optional[str]]] = None
    pack: bool = False
    neat_pack: bool = False
    script_data_dir: Optional[str] = None
    tokenizer_type: str = "HuggingFaceTokenizer"
    tokenizer_not_use_fast: bool = True
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_model: Optional[str] = None
    append_eod: bool = False
    tokenizer_name_or_path: Optional[str] = None
    seq_length: Optional[int] = None
    make_vocab_size_divisible_by: int = 128
    pad_vocab_size_to: Optional[int] = None
    placeholder_token: str = "ки"
    reward_tokens: list[str] = []
    output_prefix: Optional[str] = None
    dataset_impl: str = "mmap"
    workers: int = 1
    n_subs: int = 1
    log_interval: int = 100
    merge_group_keys: Optional[list[str]] = None
    enable_thinking: bool = False
    # multimodal rows (posttrain.data.media); the seed names these in its generate_config
    limit_mm_image_per_prompt: int = 1
    limit_mm_video_per_prompt: int = 0

    @field_validator("dataset_additional_keys", "json_keys", "reward_tokens", mode="before")
    @classmethod
    def _listify(cls, v):
        if v is None:
            return []
        return [v] if isinstance(v, str) else v

    @field_validator("map_keys", mode="before")
    @classmethod
    def _map_keys_json(cls, v):
        if isinstance(v, str):  # --map-keys '{"prompt": "problem"}' style
            try:
                return json.loads(v)
            except json.JSONDecodeError as err:
                raise ValueError(f"map_keys is not valid JSON: {err.msg}") from None
        return v


def make_config(data: dict[str, Any] | DataHandlerConfig, source: str = "dataset config") -> DataHandlerConfig:
    """A validated :class:`DataHandlerConfig` from a dict (keys with ``-`` are normalised)."""
    if isinstance(data, DataHandlerConfig):
        cfg = data
    else:
        data = {str(k).replace("-", "_"): v for k, v in (data or {}).items()}
        try:
            cfg = DataHandlerConfig(**data)
        except ValidationError as err:
            raise ConfigError(_pydantic_message(err, source)) from None
    validate(cfg)
    return cfg


def _pydantic_message(err: ValidationError, source: str) -> str:
    known = ", ".join(DataHandlerConfig.model_fields)
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"{source}: unknown key '{key}'. Known keys: {known}")
        else:
            lines.append(f"{source}: key '{key}': {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def validate(cfg: DataHandlerConfig) -> None:
    """The seed's ``validate_data_handler_config`` rules, with its messages (and a hint)."""
    if not cfg.input:
        raise ConfigError("input is required. Set input=PATH (a file or a directory of data files).")
    if not cfg.output_prefix:
        raise ConfigError("output_prefix is required. Set output_prefix=DIR/NAME.")
    if not cfg.tokenizer_name_or_path and cfg.tokenizer_type not in FILE_TYPES:
        raise ConfigError("tokenizer_name_or_path is required: a Hugging Face tokenizer or model directory.")

    handler_cls = HANDLERS.get(cfg.handler_name)  # unknown names list the known ones
    if (cfg.prompt_type and cfg.prompt_type != "empty" and cfg.handler_name not in PROMPT_TYPE_HANDLERS
            and not getattr(handler_cls, "uses_template", False)):
        raise ConfigError("If specify prompt_type , handler name must be in:\n" + "\n".join(PROMPT_TYPE_HANDLERS) + ".")
    if cfg.neat_pack and not cfg.pack:
        raise ConfigError("Require set `pack` True when `neat-pack` is True.")
    if cfg.enable_thinking and cfg.prompt_type not in ("qwen3", "hf_chat_template"):
        raise ConfigError("enable_thinking only support when using qwen3 prompt type "
                          "(or hf_chat_template with a tokenizer whose template reads enable_thinking)")
    if cfg.pack and not cfg.seq_length:
        raise ConfigError("pack: true needs seq_length (the packed sequence length).")
    for key in ("limit_mm_image_per_prompt", "limit_mm_video_per_prompt"):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"{key} must be >= 0 (got {getattr(cfg, key)})")
    if cfg.workers < 1:
        raise ConfigError(f"workers must be >= 1 (got {cfg.workers})")
    if cfg.seq_length is not None and cfg.seq_length < 2:
        raise ConfigError(f"seq_length must be >= 2 (got {cfg.seq_length})")
    if cfg.seq_length is not None and cfg.seq_length > MAX_ROW_TOKENS:
        raise ConfigError(f"seq_length={cfg.seq_length}: larger than a row of the indexed dataset can be "
                          f"({MAX_ROW_TOKENS:,} tokens, its lengths are int32); give a smaller seq_length")
    files = tokenizer_files(cfg.tokenizer_type, cfg.vocab_file, cfg.merge_file, tokenizer_model=cfg.tokenizer_model)
    if files and cfg.tokenizer_name_or_path:
        raise ConfigError(f"tokenizer_type {cfg.tokenizer_type} builds the tokenizer from {' and '.join(files.paths())}, "
                          f"and tokenizer_name_or_path={cfg.tokenizer_name_or_path} names another; keep one")
    if cfg.merge_group_keys:
        raise ConfigError("merge_group_keys (merging existing .bin/.idx files) is not supported by posttrain "
                          "preprocess; merge with posttrain.data.indexed.IndexedDatasetBuilder.add_index")


def warn_inert(cfg: DataHandlerConfig) -> list[str]:
    """Warn once about keys that are set but have no effect here; returns their names."""
    changed = [k for k, default in INERT_KEYS.items() if getattr(cfg, k) != default]
    if changed:
        warnings.warn("these dataset config keys are accepted for compatibility but have no effect in "
                      f"posttrain: {', '.join(changed)} (see docs/data.md)", stacklevel=2)
    return changed


def resolve_path(path: str | None) -> str | None:
    """``~`` expanded; relative paths are relative to the current directory."""
    if path is None:
        return None
    return str(Path(os.path.expanduser(path)))
