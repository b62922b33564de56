"""The trainer's model as the vLLM engine sees it (:class:`ModelView`; one version of it kept for later:
:class:`WeightSnapshot`), and its weights as vLLM takes them: ``(Hugging Face name, tensor)`` pairs, grouped one
decoder layer per bucket, and written once as a real checkpoint for vLLM to start from.

* Names are the Hugging Face checkpoint's. A PEFT model's base weights are named as the base model's
  (``base_model.model.`` and ``.base_layer.`` dropped, the adapter's own tensors left out): the caller
  merges the adapter into them first (:func:`posttrain.models.lora.merged`), so vLLM holds the
  adapted model.
* A tensor shared by several names (tied embeddings) is sent once, under its first name.
* Buckets: vLLM fuses some weights into one parameter (q, k and v into ``qkv_proj``; gate and up
  into ``gate_up_proj``) and rebuilds a fused parameter from the tensors of one reload call, so the
  parts of a fused weight must travel together. A bucket is one decoder layer (``model.layers.N.``),
  or one tensor outside the layers, so a sync never holds more than one layer beyond the model.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")
_PEFT_PREFIX = "base_model.model."


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a (PEFT) model's state-dict key; None for an adapter's own tensor."""
    if ".lora_" in name or "lora_embedding" in name or ".modules_to_save." in name:
        return None
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX):]
    return name.replace(".base_layer.", ".").replace(".original_module.", ".")


def named_weights(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, tensor)`` for every weight of ``model`` (an HF or PEFT model), shared tensors once."""
    seen: set[int] = set()
    for key, tensor in model.state_dict(keep_vars=True).items():
        name = hf_name(key)
        if name is None or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        yield name, tensor.detach()


def layer_buckets(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The pairs grouped by decoder layer (a layer's tensors arrive together, as every converter and
    state dict yields them); a tensor outside the layers is a bucket of its own."""
    bucket: list[tuple[str, torch.Tensor]] = []
    layer = None
    for name, tensor in weights:
        match = _LAYER.match(name)
        this = match[1] if match else None
        if bucket and (this is None or this != layer):
            yield bucket
            bucket = []
        bucket.append((name, tensor))
        layer = this
    if bucket:
        yield bucket


def write_checkpoint(config: Any, weights: Iterable[tuple[str, torch.Tensor]], directory: str | Path,
                     dtype: torch.dtype | None = None) -> Path:
    """A Hugging Face checkpoint in ``directory``: ``config.json`` and one safetensors file per
    bucket with its index, written as the buckets arrive, so only one layer is held (made
    contiguous, cast to ``dtype``) at a time, also from a stream of gathered tensors (a sharded
    trainer's). vLLM starts from it (an engine started with dummy weights never takes a later reload)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    index: dict[str, str] = {}
    total = 0
    for i, bucket in enumerate(layer_buckets(weights)):
        file = f"model-{i + 1:05d}.safetensors"
        tensors = {name: (t.to(dtype) if dtype is not None else t).detach().cpu().contiguous() for name, t in bucket}
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, file))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors, bucket
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=1))
    return directory


class ModelView:
    """What the vLLM engine needs of the trainer's model, for an HF (or PEFT) model in this process:
    its config, device type and dtype, its weights by HF name, and its log-probs (and each decoder
    layer's output) on the probe sequence. A trainer whose model is sharded over processes
    (Megatron, FSDP2) passes an object with the same attributes and methods instead."""

    def __init__(self, model: Any):
        self.model = model
        self.config = model.config
        parameter = next(model.parameters())
        self.device_type, self.dtype = parameter.device.type, str(parameter.dtype).removeprefix("torch.")

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return named_weights(self.model)

    def probe_logprobs(self, ids: list[int]) -> torch.Tensor:
        from posttrain.rollout.vllm_probe import trainer_logprobs

        return trainer_logprobs(self.model, ids)

    def layer_outputs(self, ids: list[int]) -> dict[int, torch.Tensor] | None:
        from posttrain.rollout.vllm_probe import trainer_layers

        return trainer_layers(self.model, ids)


def as_view(model: Any) -> Any:
    """``model`` itself when it is already a view (it has ``probe_logprobs``), else a :class:`ModelView`."""
    return model if hasattr(model, "probe_logprobs") else ModelView(model)


class WeightSnapshot:
    """The trainer's weights of one version as the vLLM engine takes them (a view, duck-typed like
    :class:`~posttrain.rollout.vllm_weights.ModelView`): the tensors by Hugging Face name, copied,
    and the trainer's log-probs (and layer outputs) of the engine's probe, computed when the copy is
    taken, so that loading them later is proven against exactly these weights. ``host``: the copy is
    kept in host memory (a Ray worker's snapshots beside its trained model on a GPU; vLLM copies each
    tensor onto its device when it loads it), else on the model's device."""

    def __init__(self, model, probe: list[int], host: bool = False):
        view = as_view(model)
        self.config, self.device_type, self.dtype = view.config, view.device_type, view.dtype
        self.pairs = [(name, tensor.detach().to("cpu", copy=True) if host else tensor.detach().clone())
                      for name, tensor in view.weights()]
        self.probe = list(probe)
        self.logprobs, self.layers = view.probe_logprobs(self.probe), view.layer_outputs(self.probe)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.pairs)

    def probe_logprobs(self, ids: list[int]) -> torch.Tensor:
        assert list(ids) == self.probe, "the engine's probe changed"
        return self.logprobs

    def layer_outputs(self, ids: list[int]) -> dict[int, torch.Tensor] | None:
        return self.layers
