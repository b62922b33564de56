"""Training engine: micro/mini-batching, gradient accumulation, clipping, optimizer and LR steps.

The batch layout is described in :mod:`posttrain.training.forward`. ``update`` splits the ``B`` rows
into mini-batches of ``mini_batch_size`` rows (one optimizer step each) and every mini-batch into
micro-batches of ``micro_batch_size`` rows (one forward/backward each, gradients accumulated).

A loss function is a :class:`~posttrain.training.base.LossFn`, called as::

    loss_fn(model, micro_batch: dict[str, Tensor], *, num_tokens, num_seqs, packing) -> (loss, metrics)

(this engine runs the loss's own forward, so any callable with that signature works here).
``num_tokens`` is the number of valid tokens (``options.loss_mask_key``, default ``response_mask``) of the
whole **mini-batch** and ``num_seqs`` its number of rows. A loss normalised by these (as the
``posttrain.algo`` losses are when given them) makes the accumulated gradient independent of the
micro-batch size: 1 micro-batch of 8 rows and 8 micro-batches of 1 row give the same step. The
``metrics`` of the micro-batches are **summed**, so each should be this micro-batch's share of the
mini-batch value (again what ``posttrain.algo`` returns when given the counts). Ready-made loss
functions for actor, critic, SFT and DPO are in :mod:`posttrain.training.loss_fns`. The engine
provides :class:`~posttrain.training.base.Engine`.

How forwards are batched is fixed at construction by :class:`~posttrain.training.options.EngineOptions`
(derived once by the run's plan): remove padding (the engine passes a
:class:`~posttrain.training.remove_padding.Packing` to the loss function and to the log-prob
forward), and token budgets instead of a fixed micro-batch size (:mod:`posttrain.training.dynamic_batch`).

Per optimizer step the engine reports the loss-function metrics plus ``<prefix>/grad_norm``
(before clipping) and ``<prefix>/lr`` (the rate used for that step); ``prefix`` is ``actor`` by
default (``critic`` for the value model). A non-finite loss or gradient norm raises
:class:`NaNLossError` and the optimizer is not stepped.

Data parallel: when torch.distributed is initialised, each rank passes its own rows; the counts
are summed over ``dp_group`` (default: the world), the loss is scaled by the world size to undo
DDP/FSDP gradient averaging, and the metrics are summed over ranks (see ``training/parallel.py``).
The model must already be wrapped (DDP or FSDP2) by the caller.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from posttrain.errors import ConfigError, PosttrainError
from posttrain.models.vlm import SampleImages
from posttrain.training.base import LossFn
from posttrain.training.options import EngineOptions, TokenBudget
from posttrain.training.dynamic_batch import split_by_tokens
from posttrain.training.forward import response_logprobs, response_values
from posttrain.training.fused_regions import fused_regions
from posttrain.training.loss_fns import pair_logps
from posttrain.training.offload import StateOffload
from posttrain.training.remove_padding import Packing, group_rows_by_prompt
from posttrain.training.parallel import dp_world_size, global_counts, maybe_no_sync, reduce_metric_totals

_DTYPES = {"float32": None, "fp32": None, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


class NaNLossError(PosttrainError):
    """The loss or the gradient norm is NaN/inf; the optimizer step was skipped."""


def _split(rows: torch.Tensor, size: int) -> list[torch.Tensor]:
    return [rows[i : i + size] for i in range(0, rows.numel(), size)]


def _take(batch: dict[str, torch.Tensor], rows: torch.Tensor, device=None) -> dict[str, torch.Tensor]:
    """Rows ``rows`` of every tensor, moved to ``device`` when given."""
    if device is None:
        return {key: value[rows] for key, value in batch.items()}
    return {key: value[rows.to(value.device)].to(device, non_blocking=True) for key, value in batch.items()}


def minibatch_order(num_rows: int, mini_batch_size: int, *, epochs: int = 1, shuffle: bool = False,
                    seed: int = 0) -> list[torch.Tensor]:
    """Row indices of every optimizer step of an update: ``epochs`` passes over ``num_rows`` rows
    (permuted with a ``torch.Generator`` seeded with ``seed + epoch`` when ``shuffle``), cut into
    mini-batches of ``mini_batch_size``. The Ray worker group cuts the same steps across workers."""
    if mini_batch_size < 1 or num_rows % mini_batch_size:
        raise ConfigError(
            f"The batch of {num_rows} rows cannot be split into mini-batches of {mini_batch_size} "
            "rows; make rl_config.mini_batch_size x n_samples_per_prompt divide the batch."
        )
    steps = []
    for epoch in range(epochs):
        if shuffle:
            order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch))
        else:
            order = torch.arange(num_rows)
        steps += _split(order, mini_batch_size)
    return steps


def _num_rows(batch: dict[str, torch.Tensor]) -> int:
    bad = [key for key, value in batch.items() if not isinstance(value, (torch.Tensor, SampleImages))]
    if bad:
        raise ConfigError(f"Batch values must be tensors with one row per sample; not tensors: {bad}.")
    sizes = {key: value.shape[0] for key, value in batch.items()}
    if len(set(sizes.values())) != 1:
        raise ConfigError(f"All batch tensors must have the same number of rows; got {sizes}.")
    return next(iter(sizes.values()))


def release_gradients_of(*engines) -> None:
    """:meth:`TrainEngine.release_gradients` on each of ``engines`` that has it (through the LoRA and
    offload wrappers); None and engines that keep their gradients in buffers (Megatron's) are skipped."""
    for engine in engines:
        release = getattr(engine, "release_gradients", None)
        if release is not None:
            release()


class TrainEngine:
    """Owns a model, its optimizer and LR schedule; runs forward/backward in micro-batches."""

    optimizer: torch.optim.Optimizer | None  # the checkpoints' state (posttrain.training.base.Engine)
    scheduler: Any

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler=None,
        *,
        clip_grad: float = 1.0,
        micro_batch_size: int = 1,
        dtype: str = "float32",
        activation_checkpointing: bool = False,
        metric_prefix: str = "actor",
        dp_group=None,
        options: EngineOptions = EngineOptions(),
        offload: StateOffload | None = None,
    ):
        if dtype not in _DTYPES:
            raise ConfigError(f"Unsupported training dtype {dtype!r}; known: {', '.join(_DTYPES)}.")
        if micro_batch_size < 1:
            raise ConfigError(f"micro_batch_size must be >= 1; got {micro_batch_size}.")
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.clip_grad = clip_grad
        self.micro_batch_size = micro_batch_size
        self.autocast_dtype = _DTYPES[dtype]
        self.metric_prefix = metric_prefix
        self.dp_group = dp_group
        self.options = options
        self.offload = offload  # optimizer state / gradients on the host between updates
        self.packing = Packing(options.share_prompt_prefix) if options.use_remove_padding else None
        self.region_choices: dict | None = None  # compile_regions auto's choices (compile_auto.Choice), once chosen
        if activation_checkpointing:
            self._enable_checkpointing()

    def _enable_checkpointing(self) -> None:
        """HF activation checkpointing (non-reentrant), under its transformers>=5 name if present."""
        kwargs = {"use_reentrant": False}
        if hasattr(self.model, "activation_checkpointing_enable"):
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        elif hasattr(self.model, "gradient_checkpointing_enable"):
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        else:
            raise ConfigError(
                "Activation checkpointing (recompute_granularity) needs a Hugging Face model; "
                "remove the recompute_* keys for this model."
            )

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast on the model's device type when ``dtype='bfloat16'``, else a no-op."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def compiled_regions(self) -> contextlib.AbstractContextManager:
        """The model's compiled regions (:mod:`posttrain.training.fused_regions`) with
        ``options.compile_regions``: around the update's forwards only, where their fused backward
        pays (a forward alone gains about 1%, docs/performance.md); with ``"auto"`` the regions
        :meth:`choose_regions` chose."""
        if self.options.compile_regions == "auto":
            names = tuple(region for region, choice in (self.region_choices or {}).items() if choice.on)
            return fused_regions(self.model, enabled=bool(names), names=names)
        return fused_regions(self.model, enabled=bool(self.options.compile_regions))

    def choose_regions(self, batch: dict[str, torch.Tensor], epochs: int) -> None:
        """With ``compile_regions: auto``, once (at the first update): the regions that pay back in the run's
        updates (:mod:`posttrain.training.compile_auto`), on this update's token counts."""
        if self.options.compile_regions != "auto" or self.region_choices is not None:
            return
        from posttrain.training.compile_auto import choose_regions, update_tokens

        share = self.packing is not None and self.packing.share_prompts
        tokens, response_tokens = update_tokens(batch, share, self.options.loss_mask_key)
        self.region_choices = choose_regions(self.model, tokens * epochs, response_tokens * epochs,
                                             self.options.compile_updates)

    def _chunks(self, batch, micro_batch_size: int | None, budget: TokenBudget | None) -> list[torch.Tensor]:
        """Row indices of each micro-batch: fixed-size chunks, or token-balanced ones under a budget."""
        if budget is None:
            rows = torch.arange(_num_rows(batch))
            if self.packing is not None and self.packing.share_prompts and "input_ids" in batch:
                # a group's rows side by side, so a micro-batch packs their prompt once
                rows = group_rows_by_prompt(batch)
            return _split(rows, micro_batch_size or self.micro_batch_size)
        # a row's tokens (a DPO pair's row has chosen_ and rejected_ sides: both count)
        lengths = sum(v.sum(-1) for k, v in batch.items() if k.endswith("attention_mask")).tolist()
        return [torch.tensor(g, dtype=torch.long) for g in split_by_tokens(lengths, budget, self._dp_max)]

    def _dp_max(self, value: int) -> int:
        if dp_world_size(self.dp_group) == 1:
            return value
        t = torch.tensor([value], device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.dp_group)
        return int(t.item())

    @torch.no_grad()
    def _inference(self, batch, fn, micro_batch_size: int | None) -> tuple[list, torch.Tensor]:
        """``fn(micro_batch)`` in eval mode under autocast, ``micro_batch_size`` rows at a time (or
        token-budget micro-batches); returns the outputs and the order that restores the rows."""
        was_training = self.model.training
        self.model.eval()
        chunks = self._chunks(batch, micro_batch_size, self.options.forward_budget)
        try:
            outputs = []
            for chunk in chunks:
                with self.autocast():
                    outputs.append(fn(_take(batch, chunk, self.device)))
            return outputs, torch.cat(chunks).argsort()
        finally:
            self.model.train(was_training)

    def compute_logprobs(
        self,
        batch: dict[str, torch.Tensor],
        *,
        temperature: float = 1.0,
        micro_batch_size: int | None = None,
        with_entropy: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Response-token log-probs ``[B, R]`` (0 on padding); with entropy ``[B, R]`` if asked.

        Runs in eval mode (no dropout) without gradients, ``micro_batch_size`` rows at a time.
        """
        outputs, order = self._inference(
            batch,
            lambda mb: response_logprobs(self.model, mb, temperature=temperature, with_entropy=with_entropy,
                                         packing=self.packing, truncation=self.options.truncation),
            micro_batch_size,
        )
        logprobs = torch.cat([lp for lp, _ in outputs])[order.to(outputs[0][0].device)]
        if with_entropy:
            return logprobs, torch.cat([ent for _, ent in outputs])[order.to(logprobs.device)]
        return logprobs

    def compute_values(
        self, batch: dict[str, torch.Tensor], *, micro_batch_size: int | None = None
    ) -> torch.Tensor:
        """Critic values ``[B, R]`` at the response positions (0 on padding), no gradients."""
        outputs, order = self._inference(batch, lambda mb: response_values(self.model, mb), micro_batch_size)
        return torch.cat(outputs)[order.to(outputs[0].device)]

    def compute_pair_logps(
        self, batch: dict[str, torch.Tensor], *, average: bool = False, micro_batch_size: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """DPO: per-pair sequence log-probs ``(chosen [N], rejected [N])`` of a ``chosen_*`` /
        ``rejected_*`` batch (:func:`posttrain.training.loss_fns.pair_logps`), no gradients."""
        outputs, order = self._inference(
            batch, lambda mb: pair_logps(self.model, mb, average, self.packing)[:2], micro_batch_size)
        order = order.to(outputs[0][0].device)
        return torch.cat([c for c, _ in outputs]).float()[order], torch.cat([r for _, r in outputs]).float()[order]

    def update(
        self,
        batch: dict[str, torch.Tensor],
        loss_fn: LossFn,
        *,
        mini_batch_size: int,
        epochs: int = 1,
        shuffle: bool = False,
        seed: int = 0,
        micro_batch_size: int | None = None,
    ) -> list[dict[str, float]]:
        """``epochs`` passes over ``batch`` in mini-batches; returns one metrics dict per step.

        Batch tensors may live on the CPU: each micro-batch is moved to the model's device. The
        model is put in train mode for the update and returned to its previous mode afterwards.

        With ``shuffle`` the rows are permuted (``torch.Generator`` seeded with ``seed + epoch``)
        before being cut into mini-batches.
        """
        assert self.optimizer is not None, "update() needs an optimizer"
        steps = minibatch_order(_num_rows(batch), mini_batch_size, epochs=epochs, shuffle=shuffle, seed=seed)
        was_training = self.model.training
        self.model.train()
        step_metrics = []
        if self.offload is not None:
            self.offload.to_device()
        try:
            self.choose_regions(batch, epochs)
            for rows in steps:
                step_metrics.append(self._step(_take(batch, rows), loss_fn, micro_batch_size))
        finally:
            self.model.train(was_training)
            if self.offload is not None:
                self.offload.to_host()
        return step_metrics

    def _step(self, mini_batch, loss_fn: LossFn, micro_batch_size: int | None) -> dict[str, float]:
        """One optimizer step over a mini-batch (gradient accumulation over micro-batches)."""
        local_rows = _num_rows(mini_batch)
        mask = mini_batch.get(self.options.loss_mask_key)
        num_tokens = None if mask is None else mask.sum().to(torch.float32)
        num_tokens, num_seqs = global_counts(num_tokens, local_rows, self.device, self.dp_group)
        loss_scale = dp_world_size(self.dp_group)  # DDP/FSDP average gradients over ranks
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, torch.Tensor] = {}
        bad_loss = None
        chunks = self._chunks(mini_batch, micro_batch_size, self.options.update_budget)
        for i, rows in enumerate(chunks):
            with maybe_no_sync(self.model, i < len(chunks) - 1):
                with self.autocast(), self.compiled_regions():
                    micro_batch = _take(mini_batch, rows, self.device)
                    loss, metrics = loss_fn(self.model, micro_batch, num_tokens=num_tokens, num_seqs=num_seqs,
                                            packing=self.packing)
                if not torch.isfinite(loss):
                    bad_loss = loss.item()
                    if loss_scale == 1:
                        self._raise_nan(f"The loss is {bad_loss}")
                # with several ranks, backward still runs so the NaN reaches every rank's gradients
                # through the all-reduce and all ranks stop together at the gradient-norm check
                (loss * loss_scale if loss_scale > 1 else loss).backward()
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value.detach().float()
        if bad_loss is not None:
            self._raise_nan(f"The loss is {bad_loss}")
        grad_norm = self._clip_gradients()
        lr = self.optimizer.param_groups[0]["lr"]
        self._check_hyperparameters()
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        out = reduce_metric_totals(totals, self.dp_group)
        out[f"{self.metric_prefix}/grad_norm"] = grad_norm
        out[f"{self.metric_prefix}/lr"] = lr
        return out

    def release_gradients(self) -> None:
        """Free the gradients until the next step's backward makes them again (each step starts from
        none): a loop calls it after its update, so the rest of the iteration does not hold them."""
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def _clip_gradients(self) -> float:
        """Clip the global gradient norm to ``clip_grad`` (if > 0); returns the norm before clipping."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.clip_grad if self.clip_grad and self.clip_grad > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        if not math.isfinite(grad_norm):
            self._raise_nan(f"The gradient norm is {grad_norm}")
        return grad_norm

    def _check_hyperparameters(self) -> None:
        """A NaN/inf learning rate or weight decay turns every weight to NaN in one step: stop first."""
        for group in self.optimizer.param_groups:
            for key in ("lr", "weight_decay"):
                value = group.get(key)
                if value is not None and not math.isfinite(float(value)):
                    self._raise_nan(f"The optimizer's {key} is {float(value)}")

    def _raise_nan(self, what: str) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        raise NaNLossError(
            f"{what}; the optimizer step was skipped. Lower the learning rate, train in float32, "
            "or check the batch for empty or invalid rows."
        )

    def state_dict(self) -> dict:
        """Optimizer and scheduler state (the model weights are saved by the checkpoint module)."""
        state = {"optimizer": self.optimizer.state_dict() if self.optimizer is not None else None}
        state["scheduler"] = self.scheduler.state_dict() if self.scheduler is not None else None
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
