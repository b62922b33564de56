"""Reading and writing Hugging Face weight files one tensor at a time (so conversions stream)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from posttrain.errors import CheckpointError, ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                   "generation_config.json")
SAFETENSORS_INDEX = "model.safetensors.index.json"


def read_hf_config(path: Path) -> dict:
    """An HF ``config.json``, as a dict; a file that is not one is refused with its name and line."""
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}); "
                          f"restore the model's config.json") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot be read ({err})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: expected a JSON object of model settings, found {type(config).__name__}")
    return config


class HFWeights:
    """The tensors of an HF model directory, read lazily by name (safetensors, sharded or not, or
    ``pytorch_model*.bin`` memory-mapped)."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        self._where: dict[str, object] = {}
        files = self._files()
        for f in files:
            if f.suffix == ".safetensors":
                try:
                    handle = safe_open(str(f), framework="pt")
                except Exception as err:  # safetensors raises its own error types
                    raise CheckpointError(f"{f}: not a readable safetensors file ({err})") from None
                for name in handle.keys():
                    self._where[name] = handle
            else:
                try:
                    state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
                except Exception as err:
                    raise CheckpointError(f"{f}: not a readable torch weights file ({type(err).__name__})") from None
                for name in state:
                    self._where[name] = state

    def _files(self) -> list[Path]:
        index = self.dir / SAFETENSORS_INDEX
        if index.is_file():
            try:
                names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
            except (ValueError, KeyError, TypeError) as err:
                raise CheckpointError(f"{index}: not a valid safetensors index ({err})") from None
            missing = [n for n in names if not (self.dir / n).is_file()]
            if missing:
                raise CheckpointError(f"{index} names {missing[0]}, which is missing from {self.dir}")
            return [self.dir / n for n in names]
        files = sorted(self.dir.glob("*.safetensors")) or sorted(self.dir.glob("pytorch_model*.bin"))
        if not files:
            raise CheckpointError(f"{self.dir}: no *.safetensors or pytorch_model*.bin weights")
        return files

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        source = self._where.get(name)
        if source is None:
            raise CheckpointError(f"{self.dir}: the weights have no tensor {name!r}; "
                                  f"the files do not match the architecture config.json describes")
        return source.get_tensor(name) if hasattr(source, "get_tensor") else source[name]

    def shape(self, name: str) -> tuple[int, ...]:
        source = self._where.get(name)
        if source is None:
            self.get(name)  # raises the error that names the tensor
        if hasattr(source, "get_slice"):
            return tuple(source.get_slice(name).get_shape())
        return tuple(source[name].shape)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """``tensor[start:stop]`` of ``name``, reading only those rows from a safetensors file."""
        return self._slice(name, (slice(start, stop),))

    def cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        """``tensor[:, start:stop]`` of ``name``."""
        return self._slice(name, (slice(None), slice(start, stop)))

    def _slice(self, name: str, index: tuple) -> torch.Tensor:
        source = self._where.get(name)
        if source is None:
            self.get(name)  # raises the error that names the tensor
        part = source.get_slice(name)[index] if hasattr(source, "get_slice") else source[name][index]
        return part.clone()  # its own storage: torch.save of a view would write the whole tensor


def check_shapes(hf_dir: Path, weights: "HFWeights") -> None:
    """Refuse a weights file whose tensor shapes do not match what config.json describes (the model
    built on the meta device, so nothing is allocated), naming the first tensor that differs."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(hf_dir))
    cls = getattr(transformers, (getattr(config, "architectures", None) or [""])[0], None)
    cls = cls if cls is not None and hasattr(cls, "_from_config") else transformers.AutoModelForCausalLM
    with torch.device("meta"):
        built = cls._from_config(config) if cls is not transformers.AutoModelForCausalLM else cls.from_config(config)
        expected = {k: tuple(v.shape) for k, v in built.state_dict().items()}
    for name in weights.names():
        if name in expected and weights.shape(name) != expected[name]:
            raise CheckpointError(f"{hf_dir}: the weights' {name} has shape {weights.shape(name)} but "
                                  f"config.json describes {expected[name]}; the weights and config.json do not "
                                  f"belong together")


class ShardedWriter:
    """Write tensors into ``model-0000i-of-0000n.safetensors`` files of at most ``max_bytes`` each
    (``model.safetensors`` when one file is enough) plus the index, holding one shard in memory."""

    def __init__(self, out_dir: Path, max_bytes: int = 2 << 30):
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self._shard: dict[str, torch.Tensor] = {}
        self._bytes = 0
        self._written: list[tuple[Path, list[str]]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._shard and self._bytes + size > self.max_bytes:
            self._flush()
        self._shard[name] = tensor.contiguous()
        self._bytes += size

    def _flush(self) -> None:
        path = self.out_dir / f".part-{len(self._written):05d}.safetensors"
        save_file(self._shard, str(path), metadata={"format": "pt"})
        self._written.append((path, list(self._shard)))
        self._shard, self._bytes = {}, 0

    def close(self) -> int:
        """Flush, give the files their final names, write the index; the total size in bytes."""
        if self._shard:
            self._flush()
        n = len(self._written)
        weight_map, total = {}, 0
        for i, (path, names) in enumerate(self._written):
            final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            total += path.stat().st_size
            path.rename(self.out_dir / final)
            weight_map.update({name: final for name in names})
        if n > 1:
            (self.out_dir / SAFETENSORS_INDEX).write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2), encoding="utf-8")
        return total


def copy_tokenizer(source: Path, out_dir: Path) -> list[str]:
    """Copy the tokenizer files of ``source`` (a directory, or one tokenizer file) into ``out_dir``."""
    files = [source] if source.is_file() else [source / n for n in TOKENIZER_FILES if (source / n).is_file()]
    for f in files:
        shutil.copyfile(f, out_dir / f.name)
    return [f.name for f in files]
