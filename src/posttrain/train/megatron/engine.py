"""The Megatron-Core backend's engine (issue 17, in progress): :class:`MegatronEngine` offers the
HF engine's interface (:class:`posttrain.train.engine.TrainEngine`: ``compute_logprobs`` and
``update`` over a batch in the training layout of :mod:`posttrain.train.layout`) on this rank's
Megatron-Core model, through Megatron's pipeline schedule and optimizer.

* Micro-batches of ``micro_batch_size`` rows through ``get_forward_backward_func``; each row's
  attention mask hides its padding (:func:`_inputs`), so left padding changes nothing (RoPE is
  relative: Megatron rotates by index, HF by position id, and the scores are the same).
* Log-probs and entropy come from the vocab-parallel logits (:mod:`.vocab_parallel`), never the
  gathered vocabulary.
* The loss is the algorithm's own: a loss function of :mod:`posttrain.train.loss_fns` exposes
  ``on_logprobs(logprobs, entropy, micro_batch, num_tokens=, num_seqs=)`` (the critic's:
  ``on_values(values, micro_batch, ...)``, on a model with a value head), the part after the
  forward, with the token and row counts of the whole mini-batch (a token-mean is over the
  mini-batch, as in the HF engine).
* Data parallel replicas (Megatron's ``DistributedDataParallel`` averages gradients over them):
  the token and row counts and the metrics are summed over the data-parallel group and each
  rank's loss is scaled by its size, as in the HF engine (:mod:`posttrain.train.parallel`).
* Results are computed on the last pipeline stage and broadcast to the others, so every rank
  returns the same values.

The Ray worker groups build it (:mod:`posttrain.roles.megatron_policy`); docs/parallelism.md.
"""

from __future__ import annotations

import math

import torch

from posttrain.train.engine import NaNLossError, minibatch_order
from posttrain.train.parallel import dp_world_size, global_counts, reduce_metric_totals
from posttrain.train.megatron.vocab_parallel import vocab_parallel_entropy, vocab_parallel_logprobs


def _inputs(batch: dict[str, torch.Tensor], rows: slice):
    """Token ids, positions and the attention mask (True: masked; causal and padding) of ``rows`` of
    the training layout (left-padded prompt || right-padded response)."""
    from posttrain.train.layout import default_position_ids

    attention = batch["attention_mask"][rows]
    width = attention.shape[1]
    causal = torch.triu(torch.ones(width, width, dtype=torch.bool, device=attention.device), diagonal=1)
    mask = causal | ~attention.bool()[:, None, :]  # [B, T, T]: a query never sees a padded key
    return batch["input_ids"][rows], default_position_ids(attention), mask[:, None]


def _from_last_stage(value):
    """``value`` as the last pipeline stage has it, on every stage (a picklable object)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return value
    group = ps.get_pipeline_model_parallel_group()
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_process_group_ranks(group)[-1], group=group)
    return box[0]


class MegatronEngine:
    """``compute_logprobs`` and ``update`` on ``model`` (this rank's chunk, in Megatron's
    ``DistributedDataParallel``) with Megatron's ``optimizer``."""

    def __init__(self, model, optimizer=None, scheduler=None, *, vocab_size: int, micro_batch_size: int = 1,
                 metric_prefix: str = "actor", value_head: bool = False):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.vocab_size, self.micro_batch_size, self.metric_prefix = vocab_size, micro_batch_size, metric_prefix
        self.value_head = value_head  # the critic: the model returns values, the loss takes them (on_values)

    def _micro_batches(self, rows: int, micro_batch_size: int | None) -> list[slice]:
        """Equal micro-batches (the pipeline's p2p buffers have one shape): ``micro_batch_size`` rows,
        or the largest divisor of ``rows`` below it."""
        size = math.gcd(rows, max(1, micro_batch_size or self.micro_batch_size)) or 1
        return [slice(start, start + size) for start in range(0, rows, size)]

    def _run(self, batch: dict[str, torch.Tensor], micro_batches: list[slice], on_logits, *,
             forward_only: bool) -> None:
        """Every micro-batch through the schedule; ``on_logits(rows, response_logits) -> loss`` on
        the last stage."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        width = batch["input_ids"].shape[1]
        prompt = width - batch["response_mask"].shape[1]

        def forward_step(micro_iter, model):
            rows = next(micro_iter)
            # the positions that predict the response tokens
            return model(*_inputs(batch, rows)), lambda logits: (on_logits(rows, logits[:, prompt - 1:-1]), {})

        # micro_batch_size and seq_length size the pipeline's p2p buffers: every micro-batch has them
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(micro_batches),
                                    model=[self.model], num_microbatches=len(micro_batches), seq_length=width,
                                    micro_batch_size=micro_batches[0].stop - micro_batches[0].start,
                                    forward_only=forward_only)

    def _response_logprobs(self, batch, rows: slice, logits, temperature: float, with_entropy: bool,
                           entropy_grad=False):
        width = batch["response_mask"].shape[1]
        targets = batch["input_ids"][rows, -width:]
        logprobs = vocab_parallel_logprobs(logits, targets, vocab_size=self.vocab_size, temperature=temperature)
        entropy = None
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                entropy = vocab_parallel_entropy(logits, vocab_size=self.vocab_size, temperature=temperature)
        return logprobs, entropy

    def compute_logprobs(self, batch: dict[str, torch.Tensor], *, temperature: float = 1.0,
                         micro_batch_size: int | None = None, with_entropy: bool = False):
        """Response-token log-probs ``[B, R]`` (0 on padding), with the entropy if asked."""
        mask = batch["response_mask"].float()
        out: list[tuple] = []

        def on_logits(rows, logits):
            out.append(self._response_logprobs(batch, rows, logits, temperature, with_entropy))
            return logits.new_zeros(())

        with torch.no_grad():
            self._run(batch, self._micro_batches(mask.shape[0], micro_batch_size), on_logits, forward_only=True)
        result = None
        if out:  # the last stage
            logprobs = torch.cat([lp for lp, _ in out]) * mask
            result = (logprobs, torch.cat([e for _, e in out]) * mask) if with_entropy else logprobs
        return _from_last_stage(result)

    def compute_values(self, batch: dict[str, torch.Tensor], *, micro_batch_size: int | None = None):
        """The critic's values ``[B, R]`` at the positions of the log-probs (0 on padding)."""
        mask = batch["response_mask"].float()
        out: list[torch.Tensor] = []

        def on_values(rows, values):
            out.append(values[..., 0].float())
            return values.new_zeros(())

        with torch.no_grad():
            self._run(batch, self._micro_batches(mask.shape[0], micro_batch_size), on_values, forward_only=True)
        return _from_last_stage(torch.cat(out) * mask if out else None)

    def update(self, batch: dict[str, torch.Tensor], loss_fn, *, mini_batch_size: int, epochs: int = 1,
               shuffle: bool = False, seed: int = 0, micro_batch_size: int | None = None) -> list[dict[str, float]]:
        """``epochs`` passes over ``batch`` in mini-batches (the HF engine's order and shuffle), one
        optimizer step each; one metrics dict per step, the same on every rank. A loss over pairs
        (DPO) gives its batch as rows (``loss_fn.rows``: two per pair, next to each other); sizes
        then count pairs, as in the HF engine."""
        steps = minibatch_order(next(iter(batch.values())).shape[0], mini_batch_size, epochs=epochs,
                                shuffle=shuffle, seed=seed)
        rows_of = getattr(loss_fn, "rows", None)
        self.model.train()
        out = []
        for chosen in steps:
            mini_batch = {k: v[chosen] for k, v in batch.items()}
            out.append(self._step(rows_of(mini_batch), loss_fn, 2) if rows_of else self._step(mini_batch, loss_fn))
        return out

    def _step(self, mini_batch: dict[str, torch.Tensor], loss_fn, rows_per_item: int = 1) -> dict[str, float]:
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import finalize_model_grads

        rows = mini_batch["input_ids"].shape[0]
        micro_batches = self._micro_batches(rows, self.micro_batch_size * rows_per_item)
        dp_group = ps.get_data_parallel_group()
        num_tokens, num_seqs = global_counts(mini_batch["response_mask"].sum().float(), rows, "cpu", dp_group)
        # the schedule averages the micro-batches' losses, Megatron's DDP the ranks' gradients
        loss_scale = len(micro_batches) * dp_world_size(dp_group)
        totals: dict[str, torch.Tensor] = {}
        temperature = getattr(loss_fn, "temperature", 1.0)

        def on_logits(rows, logits):
            micro_batch = {k: v[rows] for k, v in mini_batch.items()}
            if self.value_head:  # the critic's values, not logits
                values = logits[..., 0].float() * micro_batch["response_mask"].float()
                loss, metrics = loss_fn.on_values(values, micro_batch, num_tokens=num_tokens, num_seqs=num_seqs)
            else:
                logprobs, entropy = self._response_logprobs(mini_batch, rows, logits, temperature, True,
                                                            entropy_grad=getattr(loss_fn, "entropy_grad", False))
                loss, metrics = loss_fn.on_logprobs(logprobs, entropy, micro_batch, num_tokens=num_tokens,
                                                    num_seqs=num_seqs)
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value.detach().float()
            return loss * loss_scale

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._run(mini_batch, micro_batches, on_logits, forward_only=False)
        finalize_model_grads([self.model])
        lr = float(self.optimizer.param_groups[0]["lr"])
        updated, grad_norm, _ = self.optimizer.step()
        if not updated or grad_norm is None or not torch.isfinite(torch.tensor(float(grad_norm))):
            raise NaNLossError(f"The gradient norm is {grad_norm}; the optimizer step was skipped. Lower the "
                               f"learning rate, train in float32, or check the batch for empty or invalid rows.")
        if self.scheduler is not None:
            self.scheduler.step()
        metrics = _from_last_stage(reduce_metric_totals(totals, dp_group))
        metrics[f"{self.metric_prefix}/grad_norm"] = float(grad_norm)
        metrics[f"{self.metric_prefix}/lr"] = lr
        return metrics
