"""A scalar value head on an HF transformer: the reward model and the PPO critic.

:class:`ValueHeadModel` wraps an ``AutoModelForSequenceClassification`` with ``num_labels = 1``
(for decoder LMs: the backbone ``model.model`` plus a bias-free linear ``model.score``) and
returns one value per token::

    values[b, t] = score(h[b, t])        h = backbone(input_ids, attention_mask).last_hidden_state

It loads either a sequence-classification checkpoint (a trained reward model) or a causal-LM
directory (the backbone is reused; the head is new), and saves in the sequence-classification
format, so ``AutoModelForSequenceClassification.from_pretrained(out_dir)`` reads it back.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification

from posttrain.errors import CheckpointError
from posttrain.models.loading import resolve_model_dir, torch_dtype

HEAD_INITS = ("default", "zero", "normal")


class ValueHeadModel(torch.nn.Module):
    """HF backbone + scalar head; ``forward(input_ids, attention_mask) -> values [B, T]`` (float32)."""

    def __init__(self, seq_cls_model):
        super().__init__()
        self.model = seq_cls_model
        head_name = "score" if hasattr(seq_cls_model, "score") else "classifier"
        self.head_name = head_name

    @property
    def backbone(self) -> torch.nn.Module:
        return getattr(self.model, self.model.base_model_prefix)

    @property
    def head(self) -> torch.nn.Module:
        return getattr(self.model, self.head_name)

    @property
    def config(self):
        return self.model.config

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_config(cls, config, head_init: str = "default") -> "ValueHeadModel":
        """A random-init model from an HF config (its ``num_labels`` is set to 1)."""
        config.num_labels = 1
        self = cls(AutoModelForSequenceClassification.from_config(config))
        self._init_head(head_init)
        return self

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: str = "float32", device: str = "cpu",
                        head_init: str = "default", attn_implementation: str | None = "sdpa",
                        require_head: bool = False) -> "ValueHeadModel":
        """Load a reward model / critic from a sequence-classification or causal-LM directory.

        A head missing from the checkpoint (causal-LM directory) is initialised per ``head_init``:
        ``default`` (HF's normal init), ``zero`` (values start at 0) or ``normal`` (std 1/sqrt(H+1));
        with ``require_head`` (a reward model, whose head must be trained) it is a CheckpointError.
        """
        path = resolve_model_dir(path)
        kwargs = {"dtype": torch_dtype(dtype), "num_labels": 1}
        if attn_implementation:
            kwargs["attn_implementation"] = attn_implementation
        model, info = AutoModelForSequenceClassification.from_pretrained(
            str(path), output_loading_info=True, **kwargs)
        self = cls(model)
        if any(k.startswith(self.head_name) for k in info.get("missing_keys", ())):
            if require_head:
                raise CheckpointError(f"{path} has no trained score head (it holds a causal LM, not a reward "
                                      f"model); give a sequence-classification checkpoint with num_labels 1 (an "
                                      f"HF reward model, a posttrain critic or a Megatron --orm checkpoint)")
            self._init_head(head_init)
        return self.to(device)

    def _init_head(self, head_init: str) -> None:
        if head_init not in HEAD_INITS:
            raise ValueError(f"head_init must be one of {HEAD_INITS}, got {head_init!r}")
        weight = self.head.weight
        with torch.no_grad():
            if head_init == "zero":
                weight.zero_()
            elif head_init == "normal":
                weight.normal_(0.0, 1.0 / (weight.shape[1] + 1) ** 0.5)
            if getattr(self.head, "bias", None) is not None and head_init != "default":
                self.head.bias.zero_()

    # ---- compute --------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Per-token values [B, T] (float32). With left padding, positions come from the mask."""
        if position_ids is None and attention_mask is not None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        return self.head(out.last_hidden_state).squeeze(-1).float()

    # ---- persistence ----------------------------------------------------------------------
    def save_pretrained(self, out_dir: str | Path, tokenizer=None) -> Path:
        """Save as an HF sequence-classification model (atomically: temp dir, then rename)."""
        out_dir = Path(out_dir)
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        if tokenizer is not None and self.config.pad_token_id is None:
            self.config.pad_token_id = tokenizer.pad_token_id
        self.model.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
        return out_dir
