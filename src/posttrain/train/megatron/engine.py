"""The Megatron-Core backend's engine (issue 17, in progress): :class:`MegatronEngine` offers the
HF engine's interface (:class:`posttrain.train.engine.TrainEngine`: ``compute_logprobs`` and
``update`` over a batch in the training layout of :mod:`posttrain.train.layout`) on this rank's
Megatron-Core model, through Megatron's pipeline schedule and optimizer.

* One row per micro-batch through ``get_forward_backward_func``; each row's attention mask hides
  its padding and its positions are HF's (:func:`_row_inputs`), so left padding changes nothing.
* Log-probs and entropy come from the vocab-parallel logits (:mod:`.vocab_parallel`), never the
  gathered vocabulary.
* The loss is the algorithm's own: a loss function of :mod:`posttrain.train.loss_fns` exposes
  ``on_logprobs(logprobs, entropy, micro_batch, num_tokens=, num_seqs=)``, the part after the
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

import torch

from posttrain.train.engine import NaNLossError, minibatch_order
from posttrain.train.parallel import dp_world_size, global_counts, reduce_metric_totals
from posttrain.train.megatron.vocab_parallel import vocab_parallel_entropy, vocab_parallel_logprobs


def _row_inputs(batch: dict[str, torch.Tensor], row: int):
    """Token ids, positions and the attention mask (True: masked; causal and padding) of one row of
    the training layout (left-padded prompt || right-padded response)."""
    from posttrain.train.layout import default_position_ids

    attention = batch["attention_mask"][row:row + 1]
    width = attention.shape[1]
    causal = torch.triu(torch.ones(width, width, dtype=torch.bool), diagonal=1)
    mask = causal | ~attention.bool()[:, None, :]  # [1, T, T]: a query never sees a padded key
    return batch["input_ids"][row:row + 1], default_position_ids(attention), mask[:, None]


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

    def __init__(self, model, optimizer=None, scheduler=None, *, vocab_size: int, metric_prefix: str = "actor"):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.vocab_size, self.metric_prefix = vocab_size, metric_prefix

    def _run(self, batch: dict[str, torch.Tensor], per_row, *, forward_only: bool) -> None:
        """Every row through the schedule; ``per_row(row, response_logits) -> loss`` on the last stage."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        rows, width = batch["input_ids"].shape
        prompt = width - batch["response_mask"].shape[1]

        def forward_step(row_iter, model):
            row = next(row_iter)
            # the positions that predict the response tokens
            return model(*_row_inputs(batch, row)), lambda logits: (per_row(row, logits[:, prompt - 1:-1]), {})

        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(range(rows)),
                                    model=[self.model], num_microbatches=rows, seq_length=width, micro_batch_size=1,
                                    forward_only=forward_only)

    def _response_logprobs(self, batch, row: int, logits, temperature: float, with_entropy: bool, entropy_grad=False):
        width = batch["response_mask"].shape[1]
        targets = batch["input_ids"][row:row + 1, -width:]
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
        out: dict[int, tuple] = {}

        def per_row(row, logits):
            out[row] = self._response_logprobs(batch, row, logits, temperature, with_entropy)
            return logits.new_zeros(())

        with torch.no_grad():
            self._run(batch, per_row, forward_only=True)
        result = None
        if out:  # the last stage
            logprobs = torch.cat([out[r][0] for r in range(len(out))]) * mask
            result = (logprobs, torch.cat([out[r][1] for r in range(len(out))]) * mask) if with_entropy else logprobs
        return _from_last_stage(result)

    def update(self, batch: dict[str, torch.Tensor], loss_fn, *, mini_batch_size: int, epochs: int = 1,
               shuffle: bool = False, seed: int = 0, micro_batch_size: int | None = None) -> list[dict[str, float]]:
        """``epochs`` passes over ``batch`` in mini-batches (the HF engine's order and shuffle), one
        optimizer step each; one metrics dict per step, the same on every rank."""
        steps = minibatch_order(next(iter(batch.values())).shape[0], mini_batch_size, epochs=epochs,
                                shuffle=shuffle, seed=seed)
        self.model.train()
        return [self._step({k: v[rows] for k, v in batch.items()}, loss_fn) for rows in steps]

    def _step(self, mini_batch: dict[str, torch.Tensor], loss_fn) -> dict[str, float]:
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import finalize_model_grads

        rows = mini_batch["input_ids"].shape[0]
        dp_group = ps.get_data_parallel_group()
        num_tokens, num_seqs = global_counts(mini_batch["response_mask"].sum().float(), rows, "cpu", dp_group)
        loss_scale = rows * dp_world_size(dp_group)  # the schedule averages over micro-batches, DDP over ranks
        totals: dict[str, torch.Tensor] = {}
        temperature = getattr(loss_fn, "temperature", 1.0)

        def per_row(row, logits):
            logprobs, entropy = self._response_logprobs(mini_batch, row, logits, temperature, True,
                                                        entropy_grad=getattr(loss_fn, "entropy_grad", False))
            micro_batch = {k: v[row:row + 1] for k, v in mini_batch.items()}
            loss, metrics = loss_fn.on_logprobs(logprobs, entropy, micro_batch, num_tokens=num_tokens,
                                                num_seqs=num_seqs)
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value.detach().float()
            return loss * loss_scale

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._run(mini_batch, per_row, forward_only=False)
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
