"""The training backends' declared interfaces: what the loops call on an engine, and the loss
function they hand to its ``update``.

**Engines.** The loops use an engine in one of three roles, and the seven engine-like classes
each play one role, or all of them:

============================  ===================  =============================================
protocol                      methods              implemented by
============================  ===================  =============================================
:class:`ReferenceEngine`      log-probs, DPO       ``AdapterOff`` (models/lora.py),
                              pair log-probs       ``OffloadedReference`` (training/offload.py),
                                                   ``ReferenceRole`` (cluster/group.py)
:class:`ActorEngine`          log-probs, update    ``ActorRole`` (cluster/group.py)
:class:`CriticEngine`         values, update       ``Critic`` (roles/critic.py), ``CriticRole``
:class:`Engine`               all of the above,    ``TrainEngine`` (training/engine.py, HF),
                              ``optimizer`` and    ``MegatronEngine`` (training/megatron/engine.py)
                              ``scheduler``
============================  ===================  =============================================

A backend provides :class:`Engine`; a wrapper or a proxy provides the role it plays. Every method
takes a batch in the training layout (:mod:`posttrain.training.batch`); the sizes after ``*`` are
keyword-only. An implementation may add parameters of its own, with defaults (``with_entropy=``
of the backends' ``compute_logprobs``). ``tests/unit/train/test_engine_protocol.py`` checks each
implementation's signatures against these.

The checkpoints read an engine's state as its ``optimizer`` and ``scheduler`` (each with
``state_dict`` / ``load_state_dict``); the model's weights are saved by the checkpoint module.

**Loss functions.** :class:`LossFn` is the loss an ``update`` trains on: a forward declared by
its fields, then :attr:`LossFn.after_forward`, the part after the forward. The HF engine calls the
whole (``loss_fn(model, micro_batch, *, num_tokens, num_seqs, packing)``); the Megatron engine
runs its own forward (log-probs and entropy from vocab-parallel logits, or its value head's
values) as the fields say and calls ``after_forward``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from posttrain.algo.truncation import Truncation
from posttrain.training.forward import response_logprobs, response_values
from posttrain.training.remove_padding import Packing

Batch = dict[str, torch.Tensor]
LossOutput = tuple[torch.Tensor, dict[str, torch.Tensor]]
AfterForward = Callable[..., LossOutput]


@dataclass(frozen=True)
class LossFn:
    """A loss for :meth:`Engine.update`: ``loss_fn(model, micro_batch, *, num_tokens, num_seqs,
    packing) -> (loss, metrics)`` runs the forward, then :attr:`after_forward`.

    ``num_tokens`` / ``num_seqs`` count the valid tokens and rows of the whole mini-batch (a loss
    normalised by them does not depend on the micro-batch size); ``metrics`` are this
    micro-batch's shares, which the engine sums. ``packing`` is the engine's
    :class:`~posttrain.training.remove_padding.Packing` (remove padding), else None.

    Fields:
        after_forward: the loss from the forward's outputs. ``consumes="logprobs"``:
            ``after_forward(logprobs [B, R], entropy [B, R] | None, micro_batch, *, num_tokens,
            num_seqs)``; ``consumes="values"``: ``after_forward(values [B, R], micro_batch, *,
            num_tokens, num_seqs)``. Both are 0 on response padding.
        consumes: what the forward produces: the response tokens' log-probs (and entropy), or
            a value model's values at the response positions.
        temperature: the log-probs' sampling temperature.
        truncation: the sampling truncation the log-probs are taken under (None: full distribution).
        with_entropy: whether ``after_forward`` gets the entropy (else None).
        entropy_grad: whether the entropy carries gradient (it is in the loss).
        rows: None when the loss's rows are the batch's; else the batch as the rows
            ``after_forward`` takes (DPO: two per pair, see :class:`~posttrain.training.loss_fns.PairLossFn`).
    """

    after_forward: AfterForward
    consumes: Literal["logprobs", "values"] = "logprobs"
    temperature: float = 1.0
    with_entropy: bool = False
    entropy_grad: bool = False
    truncation: Truncation | None = None
    rows: Callable[[Batch], Batch] | None = None

    def __call__(self, model: torch.nn.Module, micro_batch: Batch, *, num_tokens=None, num_seqs=None,
                 packing: Packing | None = None) -> LossOutput:
        if self.consumes == "values":
            values = response_values(model, micro_batch)  # the value head runs padded
            return self.after_forward(values, micro_batch, num_tokens=num_tokens, num_seqs=num_seqs)
        logprobs, entropy = response_logprobs(model, micro_batch, temperature=self.temperature,
                                              with_entropy=self.with_entropy, entropy_grad=self.entropy_grad,
                                              packing=packing, truncation=self.truncation)
        return self.after_forward(logprobs, entropy, micro_batch, num_tokens=num_tokens, num_seqs=num_seqs)


@runtime_checkable
class ReferenceEngine(Protocol):
    """Inference without gradients: what the loops call on the frozen reference (and, for the
    old log-probs, on the actor)."""

    def compute_logprobs(self, batch: Batch, *, temperature: float = 1.0,
                         micro_batch_size: int | None = None) -> torch.Tensor:
        """Response-token log-probs ``[B, R]`` (0 on padding), ``micro_batch_size`` rows at a time
        (None: the engine's own)."""
        ...

    def compute_pair_logps(self, batch: Batch, *, average: bool = False,
                           micro_batch_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """DPO: per-pair sequence log-probs ``(chosen [N], rejected [N])`` of a ``chosen_*`` /
        ``rejected_*`` batch (sums over the response tokens; means with ``average``)."""
        ...


@runtime_checkable
class Trainable(Protocol):
    """Optimizer steps on a batch."""

    def update(self, batch: Batch, loss_fn: LossFn, *, mini_batch_size: int, epochs: int = 1,
               shuffle: bool = False, seed: int = 0,
               micro_batch_size: int | None = None) -> list[dict[str, float]]:
        """``epochs`` passes over ``batch`` in mini-batches of ``mini_batch_size`` rows (one
        optimizer step each; rows permuted by ``seed + epoch`` with ``shuffle``), micro-batches of
        ``micro_batch_size`` rows (None: the engine's own); one metrics dict per step."""
        ...


@runtime_checkable
class ActorEngine(Trainable, Protocol):
    """The policy being trained: its log-probs and its updates."""

    def compute_logprobs(self, batch: Batch, *, temperature: float = 1.0,
                         micro_batch_size: int | None = None) -> torch.Tensor:
        """As :meth:`ReferenceEngine.compute_logprobs`."""
        ...


@runtime_checkable
class CriticEngine(Trainable, Protocol):
    """PPO's value model: its values and its updates."""

    def compute_values(self, batch: Batch, *, micro_batch_size: int | None = None) -> torch.Tensor:
        """Values ``[B, R]`` at the response positions (0 on padding), no gradients."""
        ...


@runtime_checkable
class Engine(ReferenceEngine, ActorEngine, CriticEngine, Protocol):
    """A training backend: every role on one model, and the state the checkpoints save."""

    optimizer: Any  # None for a frozen (reference) engine
    scheduler: Any
