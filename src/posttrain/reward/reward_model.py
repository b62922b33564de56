"""Reward-model scoring: the value of prompt + response at the last response token.

``reward_i = V(prompt_i ++ response_i)[last response token]`` with ``V`` a
:class:`~posttrain.models.value_head.ValueHeadModel` (an ``AutoModelForSequenceClassification``
reward model, or a causal-LM backbone with a scalar head). Unlike the seed, the logits are not
divided by the sampling temperature (seed_system.md section 11, quirk 6).
"""

from __future__ import annotations

from pathlib import Path

import torch

from posttrain.models.loading import load_tokenizer
from posttrain.models.value_head import ValueHeadModel


class RewardModelScorer:
    """Score responses with a reward model.

    Args:
        model: a model directory or a loaded :class:`ValueHeadModel`.
        tokenizer: an HF tokenizer (loaded from ``model`` when it is a directory and this is None).
        device / dtype: where and in which precision to load a directory.
        batch_size: sequences per forward pass.
    """

    def __init__(self, model: str | Path | ValueHeadModel, tokenizer=None, *, device: str = "cpu",
                 dtype: str = "float32", batch_size: int = 8):
        if not isinstance(model, ValueHeadModel):
            tokenizer = tokenizer or load_tokenizer(model)
            model = ValueHeadModel.from_pretrained(model, dtype=dtype, device=device)
        if tokenizer is None:
            raise ValueError("RewardModelScorer needs a tokenizer when given a loaded model")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (tokenizer.eos_token_id or 0)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        """Reward per (prompt, response) text pair; each part is tokenised on its own."""
        enc = lambda texts: self.tokenizer(texts, add_special_tokens=False)["input_ids"]  # noqa: E731
        return self.score_sequences(enc(list(prompts)), enc(list(responses)))

    def score_sequences(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[float]:
        """Reward per (prompt ids, response ids) pair, read at the last response token."""
        seqs = [list(p) + list(r) for p, r in zip(prompt_ids, response_ids)]
        out: list[float] = []
        for start in range(0, len(seqs), self.batch_size):
            out.extend(self._score_batch(seqs[start:start + self.batch_size]))
        return out

    @torch.inference_mode()
    def _score_batch(self, seqs: list[list[int]]) -> list[float]:
        lengths = [max(1, len(s)) for s in seqs]
        width = max(lengths)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            s = s or [self.pad_id]
            ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, :len(s)] = 1
        values = self.model(ids.to(self.device), mask.to(self.device))  # [B, T]
        last = torch.tensor(lengths, device=values.device) - 1
        return values.gather(1, last[:, None]).squeeze(1).tolist()

    def score_padded(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Rewards [B] of right- or left-padded [B, T] sequences: the value at each row's last
        attended token."""
        with torch.inference_mode():
            values = self.model(input_ids.to(self.device), attention_mask.to(self.device))
        positions = torch.arange(attention_mask.shape[1], device=values.device)
        last = (attention_mask.to(values.device).long() * positions).argmax(dim=1)
        return values.gather(1, last[:, None]).squeeze(1)
