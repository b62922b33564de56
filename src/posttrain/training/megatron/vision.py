"""Qwen2.5-VL on the megatron backend: the language model as Megatron-Core's ``GPTModel`` with
multimodal rotary positions, the vision tower kept as the Hugging Face module.

* **The language model** is built from the VLM directory like a text Qwen2 (the same HF <->
  Megatron-Core mapping, :mod:`posttrain.models.mcore.mapping`): its weights are read under the
  names Transformers saves them with (``model.layers.*``, ``model.embed_tokens.weight``; a file
  with ``model.language_model.*`` names is read through :class:`LanguageModelWeights`), its rotary
  embedding is Megatron-Core's ``mrope`` with the HF config's ``mrope_section`` (rotary dims of
  the temporal, height and width positions; ``position_ids [3, B, S]``).
* **The vision tower** is the HF model's own module (``model.visual``), replicated on every rank,
  not tensor-parallel: each rank runs it on its micro-batch's images (the same images on every
  tensor-parallel rank, so the same features). It is frozen (``freeze_vision_tower: true``): it
  gets no gradient and the Megatron optimizer holds none of its weights.
* **The inputs** of a micro-batch (:class:`VisionInputs`): the word embeddings of its tokens (the
  vocab-parallel embedding run as ``GPTModel`` runs it: each tensor-parallel rank looks up its
  vocabulary shard and the ranks' rows are summed, so every rank holds every row) with the tower's
  merged features put at the image tokens, given to ``GPTModel`` as its ``decoder_input``
  ``[S, B, H]``; the 3-D positions from the HF model's own ``get_rope_index``
  (:func:`posttrain.training.multimodal.multimodal_inputs`), in the padded layout or packed with
  the row's tokens.

The loop builds it in :mod:`posttrain.roles.megatron_vlm`. Not built (refused by the config, compat
rows ``mm-megatron-*``, and here): pipeline parallelism (the first
stage's ``decoder_input`` only), sequence parallelism, a trained tower (its gradients would have
to be reduced over the tensor-parallel ranks), Qwen3-VL (interleaved mrope and deepstack), videos
and ``reuse_image_embeds``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from posttrain.errors import ConfigError
from posttrain.models.mcore.hf_files import HFWeights, read_hf_config
from posttrain.training.multimodal import FEATURES, VIDEO_FEATURES, multimodal_inputs

MODEL_TYPES = ("qwen2_5_vl",)  # the VLMs whose language model the megatron backend builds
LANGUAGE_PREFIX = "model.language_model."


def is_vlm_dir(hf_dir: str | Path) -> bool:
    """Whether ``hf_dir`` holds a vision-language model (a config with text and vision parts)."""
    config = read_hf_config(Path(hf_dir) / "config.json")
    return isinstance(config.get("vision_config"), dict) and isinstance(config.get("text_config"), dict)


def mrope_section(hf_dir: str | Path) -> list[int]:
    """The HF config's ``mrope_section`` (rotary frequencies of the temporal, height and width
    positions; they add up to half the head dimension), checked for a model this module builds."""
    where = Path(hf_dir) / "config.json"
    config = read_hf_config(where)
    if config.get("model_type") not in MODEL_TYPES:
        raise ConfigError(f"{where}: model_type {config.get('model_type')!r}: the megatron backend builds the "
                          f"language model of {', '.join(MODEL_TYPES)} (Qwen2.5-VL) only; Qwen3-VL (interleaved "
                          f"multimodal rotary positions, deepstack) trains on the hf backend")
    text = config["text_config"]
    rope = text.get("rope_parameters") or text.get("rope_scaling") or config.get("rope_scaling") or {}
    section = rope.get("mrope_section")
    head_dim = int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])
    if not section or sum(section) * 2 != head_dim:
        raise ConfigError(f"{where}: text_config's rope_parameters mrope_section {section!r} must add up to half "
                          f"the head dimension ({head_dim // 2})")
    return [int(s) for s in section]


def language_arch(hf_dir: str | Path):
    """The language model's :class:`~posttrain.models.arch.ModelArch` of the VLM in ``hf_dir`` (its
    ``text_config``; the rotary base read from ``rope_parameters`` where Transformers 5 keeps it)."""
    from dataclasses import replace

    from posttrain.models.arch import arch_from_hf_config

    mrope_section(hf_dir)  # checks the model type and the rotary split
    text = read_hf_config(Path(hf_dir) / "config.json")["text_config"]
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    arch = arch_from_hf_config(hf_dir)
    return replace(arch, rope_theta=float(text.get("rope_theta") or rope.get("rope_theta") or arch.rope_theta))


class LanguageModelWeights:
    """The language model's tensors of a VLM directory under the text model's names
    (``model.layers.*``): a file that names them ``model.language_model.*`` is read through this."""

    def __init__(self, weights: HFWeights):
        self.weights, self.dir = weights, weights.dir
        self._source = {self._text_name(n): n for n in weights.names()}

    @staticmethod
    def _text_name(name: str) -> str:
        return "model." + name[len(LANGUAGE_PREFIX):] if name.startswith(LANGUAGE_PREFIX) else name

    def names(self) -> list[str]:
        return list(self._source)

    def __contains__(self, name: str) -> bool:
        return name in self._source

    def get(self, name: str) -> torch.Tensor:
        return self.weights.get(self._source.get(name, name))

    def shape(self, name: str) -> tuple[int, ...]:
        return self.weights.shape(self._source.get(name, name))

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.weights.rows(self._source.get(name, name), start, stop)

    def cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.weights.cols(self._source.get(name, name), start, stop)


def with_mrope(args: argparse.Namespace, hf_dir: str | Path) -> argparse.Namespace:
    """``args`` (Megatron-LM arguments of the language model) with Megatron-Core's multimodal rotary
    embedding: ``position_embedding_type="mrope"`` and the HF config's ``mrope_section``. They
    describe the ``GPTModel``, a Qwen2 language model (``hf_model_type``); ``vlm_model_type`` names
    the VLM it belongs to."""
    args.position_embedding_type = "mrope"
    args.mrope_section = mrope_section(hf_dir)
    args.vlm_model_type, args.hf_model_type = args.hf_model_type, "qwen2"
    return args


def check_layout(sequence_parallel: bool = False) -> None:
    """Refuse the parallel layouts this module does not build (see the module docstring)."""
    from megatron.core import parallel_state as ps

    if sequence_parallel:
        raise ConfigError("a vision-language model on the megatron backend runs without sequence parallelism (the "
                          "image features enter the whole sequence's embeddings); set sequence_parallel: false")
    pp, cp = ps.get_pipeline_model_parallel_world_size(), ps.get_context_parallel_world_size()
    if pp > 1 or cp > 1:
        raise ConfigError(f"a vision-language model on the megatron backend runs with pipeline and context parallel "
                          f"size 1 (got PP {pp}, CP {cp}): the image features enter the first stage's input; set "
                          f"pipeline_model_parallel_size and context_parallel_size to 1")


class VisionInputs:
    """A micro-batch's ``GPTModel`` inputs with its images (see the module docstring): ``hf_model``
    (a ``Qwen2_5_VLForConditionalGeneration``, frozen tower) gives the tower and ``get_rope_index``."""

    def __init__(self, hf_model: torch.nn.Module):
        inner = hf_model.model
        if any(p.requires_grad for p in inner.visual.parameters()):
            raise ConfigError("the megatron backend trains a vision-language model with a frozen vision tower: set "
                              "rl_config.freeze_vision_tower: true (a trained tower's gradients would need reducing "
                              "over the tensor-parallel ranks, which is not built)")
        self.hf_model = hf_model

    def _features(self, batch: dict, rows: torch.Tensor) -> dict:
        """``multimodal_inputs`` of ``rows`` in the padded layout (the tower's features, image mask, positions)."""
        if "images" not in batch:
            raise ValueError("a multimodal batch on the megatron backend carries its images per row (the key "
                             "'images', a posttrain.models.vlm.SampleImages)")
        rows_batch = {"input_ids": batch["input_ids"][rows], "attention_mask": batch["attention_mask"][rows],
                      "images": batch["images"][rows]}
        out = multimodal_inputs(self.hf_model, rows_batch)
        if VIDEO_FEATURES in out or "image_embeds" in batch:
            raise ConfigError("videos and reuse_image_embeds are not built on the megatron backend; train them on "
                              "the hf backend")
        return out

    def padded(self, chunk, batch: dict, rows: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor):
        """``(position_ids [3, B, L], decoder_input [L, B, H])`` of the padded rows ``ids [B, L]``
        (the batch's ``width`` tokens, then padding); ``positions [B, L]``: their text positions."""
        out = self._features(batch, rows)
        length, width = ids.shape[1], batch["input_ids"].shape[1]
        rope = positions[None].expand(3, -1, -1)
        image_mask = torch.zeros_like(ids, dtype=torch.bool)
        if "position_ids" in out:
            rope = torch.nn.functional.pad(out["position_ids"][1:], (0, length - width))
        if FEATURES in out:
            image_mask[:, :width] = out["image_mask"]
        return rope, _decoder_input(chunk, ids, image_mask, out.get(FEATURES))

    def packed(self, chunk, batch: dict, rows: torch.Tensor, ids: torch.Tensor):
        """``(position_ids [3, 1, L], decoder_input [L, 1, H])`` of the rows packed into ``ids [1, L]``
        (each row's valid tokens one after the other, in row order, then padding)."""
        out = self._features(batch, rows)
        valid = batch["attention_mask"][rows].bool()
        count = int(valid.sum())
        rope = torch.zeros(3, 1, ids.shape[1], dtype=torch.long, device=ids.device)
        image_mask = torch.zeros_like(ids, dtype=torch.bool)
        if "position_ids" in out:
            rope[:, 0, :count] = out["position_ids"][1:][:, valid]
        else:  # text-only rows: each row's positions restart (rotary positions are relative within a row)
            text = valid.long().cumsum(1) - 1
            rope[:, 0, :count] = text[valid]
        if FEATURES in out:
            image_mask[0, :count] = out["image_mask"][valid]
        return rope, _decoder_input(chunk, ids, image_mask, out.get(FEATURES))


def _decoder_input(chunk, ids: torch.Tensor, image_mask: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
    """``GPTModel``'s ``decoder_input [L, B, H]``: its word embeddings of ``ids [B, L]`` (the
    vocab-parallel embedding, summed over the tensor-parallel ranks) with ``features [N, 1, H]`` at
    the ``image_mask`` tokens, in row-major order."""
    module = getattr(chunk, "module", chunk)  # Megatron's DistributedDataParallel wraps the chunk
    embeds = module.embedding(input_ids=ids, position_ids=None).transpose(0, 1)  # [B, L, H]
    if features is None:
        return embeds.transpose(0, 1).contiguous()
    placed = torch.zeros_like(embeds)
    placed[image_mask] = features[:, 0].to(embeds.dtype)
    return torch.where(image_mask[..., None], placed, embeds).transpose(0, 1).contiguous()

