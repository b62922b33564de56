"""The Megatron-Core backend's engine: :class:`MegatronEngine` provides
:class:`posttrain.training.base.Engine` (the HF engine's interface: ``compute_logprobs``,
``compute_values``, ``compute_pair_logps`` and ``update`` over a batch in the training layout of
:mod:`posttrain.training.batch`) on this rank's Megatron-Core model, through Megatron's pipeline
schedule and optimizer.

* Micro-batches of ``micro_batch_size`` rows through ``get_forward_backward_func``; each row's
  attention mask hides its padding (:func:`_inputs`), so left padding changes nothing (RoPE is
  relative: Megatron rotates by index, HF by position id, and the scores are the same). Under
  sequence parallelism the sequences are padded to a multiple of the tensor-parallel size.
* Log-probs and entropy come from the vocab-parallel logits (:mod:`.vocab_parallel`), never the
  gathered vocabulary.
* The loss is the algorithm's own: the engine runs the forward a
  :class:`~posttrain.training.base.LossFn` declares (log-probs at its ``temperature``, the entropy
  when ``with_entropy``; the values of a model with a value head when it ``consumes`` values) and
  calls its ``after_forward``, with the token and row counts of the whole mini-batch (a
  token-mean is over the mini-batch, as in the HF engine). A loss over pairs (DPO) gives its
  batch as rows (``rows``, two per pair).
* Data parallel replicas (Megatron's ``DistributedDataParallel`` averages gradients over them):
  the token and row counts and the metrics are summed over the data-parallel group and each
  rank's loss is scaled by its size, as in the HF engine (:mod:`posttrain.training.parallel`).
* Results are computed on the last pipeline stage and broadcast to the others, so every rank
  returns the same values.
* Expert parallelism (a mixture-of-experts model's experts split over data-parallel ranks): the
  token dispatcher all-gathers every layer's tokens over the expert-parallel group, so its ranks run
  in lockstep: packed micro-batches of one length and count on every data-parallel rank (empty ones
  pad the count, as with virtual stages).

* A vision-language model (``vision``, :class:`posttrain.training.megatron.vision.VisionInputs`):
  each micro-batch's rows carry their images (``images``); the model gets their 3-D rotary
  positions and, as ``decoder_input``, its word embeddings with the frozen tower's features at the
  image tokens (packed or padded).

The Ray worker groups build it (:mod:`posttrain.roles.megatron_policy`); docs/parallelism.md.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from posttrain.training.base import LossFn
from posttrain.training.batch import default_position_ids
from posttrain.training.dynamic_batch import split_by_tokens
from posttrain.training.engine import NaNLossError, minibatch_order
from posttrain.training.loss_fns import interleave_pairs, row_sequence_logps
from posttrain.training.options import EngineOptions
from posttrain.training.parallel import dp_world_size, global_counts, reduce_metric_totals
from posttrain.training.megatron.vocab_parallel import vocab_parallel_entropy, vocab_parallel_logprobs
from posttrain.training.offload import StateOffload, return_freed_memory


def _inputs(batch: dict[str, torch.Tensor], rows: torch.Tensor, length: int):
    """Token ids, positions and the attention mask (True: masked; causal and padding) of ``rows`` of
    the training layout (left-padded prompt || right-padded response), right-padded to ``length``
    tokens, and for each row the positions of its logits that predict its response tokens."""
    attention = batch["attention_mask"][rows]
    width = attention.shape[1]
    prompt = width - batch["response_mask"].shape[1]
    attention = F.pad(attention, (0, length - width))  # padding for sequence parallelism: masked keys
    causal = torch.triu(torch.ones(length, length, dtype=torch.bool, device=attention.device), diagonal=1)
    mask = causal | ~attention.bool()[:, None, :]  # [B, T, T]: a query never sees a padded key
    ids = F.pad(batch["input_ids"][rows], (0, length - width))
    return ids, default_position_ids(attention), mask[:, None], slice(prompt - 1, width - 1)


def _packed_inputs(batch: dict[str, torch.Tensor], rows: torch.Tensor, length: int):
    """``rows`` packed into one sequence of ``length`` tokens (their valid tokens one after the
    other, then padding): the ids, positions, a block-diagonal causal mask (a token sees the earlier
    tokens of its own row only; Megatron's rotary embedding is relative, so no position resets), and
    for each row the packed positions whose logits predict its response tokens ``[B, R]`` (0 where
    the response is padding; the loss masks those)."""
    attention = batch["attention_mask"][rows].bool()
    response_width = batch["response_mask"].shape[1]
    prompt_lengths = attention[:, :-response_width].sum(1)
    lengths = attention.sum(1)
    starts = torch.cumsum(lengths, 0) - lengths
    ids = torch.zeros(1, length, dtype=batch["input_ids"].dtype, device=attention.device)
    ids[0, :int(lengths.sum())] = batch["input_ids"][rows][attention]
    segment = torch.repeat_interleave(torch.arange(len(rows), device=attention.device), lengths)
    segment = torch.cat([segment, torch.full((length - len(segment),), -1, device=attention.device)])
    index = torch.arange(length, device=attention.device)
    visible = (segment[:, None] == segment[None, :]) & (index[None, :] <= index[:, None]) & (segment[:, None] >= 0)
    column = torch.arange(response_width, device=attention.device)
    gather = starts[:, None] + prompt_lengths[:, None] - 1 + column[None, :]
    gather = torch.where(attention[:, -response_width:], gather, torch.zeros_like(gather))
    return ids, index[None], ~visible[None, None], gather


def _from_last_stage(value):
    """``value`` as the last pipeline stage has it, on every stage (a picklable object)."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return value
    group = ps.get_pipeline_model_parallel_group()
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_process_group_ranks(group)[-1], group=group)
    return box[0]


class MegatronOffload:
    """``generate_config.offload_train_optimizer`` / ``offload_train_grad`` on this backend, between
    updates: the optimizer state (AdamW's moments of each of Megatron's torch optimizers) to the host
    through :class:`posttrain.training.offload.StateOffload`, and the gradient buffers of Megatron's
    ``DistributedDataParallel`` freed by Megatron-Core's own ``offload_grad_buffers`` (their storage
    resized to 0; ``restore_grad_buffers`` gives it back zeroed, the ``main_grad`` views intact)."""

    def __init__(self, models: list, optimizer, *, optimizer_state: bool, grads: bool):
        self.models, self.grads = models, grads
        torch_optimizers = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
        self.states = [StateOffload(o, optimizer_state=True, grads=False) for o in torch_optimizers] \
            if optimizer_state else []

    def to_host(self) -> None:
        if self.grads:
            cuda = torch.cuda.is_available() and next(self.models[0].parameters()).is_cuda
            for model in self.models:
                model.offload_grad_buffers(synchronize=cuda, empty_cache=cuda)
            if not cuda:
                return_freed_memory()
        for state in self.states:
            state.to_host()

    def to_device(self) -> None:
        if self.grads:
            for model in self.models:
                model.restore_grad_buffers(synchronize=False)
        for state in self.states:
            state.to_device()

    def grad_bytes(self) -> int:
        """Bytes the gradient buffers hold now (0 while freed)."""
        return sum(b.grad_data.untyped_storage().nbytes() for model in self.models for b in model.buffers)


class MegatronEngine:
    """``compute_logprobs`` and ``update`` on ``model`` (this rank's chunk, or its chunks, one per
    virtual pipeline stage, each in Megatron's ``DistributedDataParallel``) with Megatron's
    ``optimizer``."""

    optimizer: Any  # Megatron's (None for the reference); the checkpoints' state with the scheduler
    scheduler: Any

    def __init__(self, model, optimizer=None, scheduler=None, *, vocab_size: int, micro_batch_size: int = 1,
                 metric_prefix: str = "actor", value_head: bool = False, options: EngineOptions | None = None,
                 vision=None):
        self.models = list(model) if isinstance(model, (list, tuple)) else [model]
        self.model = self.models[0] if len(self.models) == 1 else torch.nn.ModuleList(self.models)
        self.optimizer, self.scheduler = optimizer, scheduler
        self.vocab_size, self.micro_batch_size, self.metric_prefix = vocab_size, micro_batch_size, metric_prefix
        self.value_head = value_head  # the critic: the model returns values, the loss consumes them
        self.options = options or EngineOptions()
        self.offload: MegatronOffload | None = None  # set by the policy (generate_config.offload_train_*)
        self.vision = vision  # a VLM's VisionInputs (training/megatron/vision.py): images, 3-D positions
        # packed micro-batches with remove padding, and always under a token budget or with virtual
        # stages (rows per micro-batch vary there, and the pipeline's buffers need one shape)
        from megatron.core import parallel_state as ps

        from megatron.core.utils import get_model_config

        self.lockstep = ps.get_expert_model_parallel_world_size() > 1  # see the module's docstring
        # sequence parallelism splits every sequence over the tensor-parallel ranks: lengths pad to a multiple
        self.length_multiple = ps.get_tensor_model_parallel_world_size() \
            if get_model_config(self.models[0]).sequence_parallel else 1
        self.packing = bool(self.options.use_remove_padding or self.options.forward_budget
                            or self.options.update_budget or len(self.models) > 1 or self.lockstep)

    def _most(self, value: int) -> int:
        """The largest ``value`` of the data-parallel ranks (the expert-parallel groups among them)."""
        from megatron.core import parallel_state as ps

        tensor = torch.tensor(value, device=next(self.models[0].parameters()).device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
        return int(tensor)

    def _micro_batches(self, batch: dict[str, torch.Tensor], micro_batch_size: int | None, budget,
                       rows_per_item: int = 1) -> list[torch.Tensor]:
        """Row indices of each micro-batch, ``rows_per_item`` consecutive rows kept together (a DPO
        pair's two rows): a token budget's balanced groups (packed), or ``micro_batch_size`` items,
        the same number in each unless packed (the pipeline's p2p buffers have one shape)."""
        rows = batch["input_ids"].shape[0]
        items = torch.arange(rows).view(-1, rows_per_item)
        if budget is not None:
            lengths = batch["attention_mask"].sum(-1).view(-1, rows_per_item).sum(-1).tolist()
            groups = [items[torch.tensor(group)].reshape(-1) for group in split_by_tokens(lengths, budget)]
        else:
            size = max(1, micro_batch_size or self.micro_batch_size)
            if not self.packing:
                size = math.gcd(len(items), size) or 1
            groups = [items[start:start + size].reshape(-1) for start in range(0, len(items), size)]
        if self.lockstep:
            groups += [items[:0].reshape(-1)] * (self._most(len(groups)) - len(groups))
        if len(self.models) > 1:  # the interleaved schedule takes a multiple of PP micro-batches: pad
            from megatron.core import parallel_state as ps  # with empty (all-padding) packed ones

            pp = ps.get_pipeline_model_parallel_world_size()
            groups += [items[:0].reshape(-1)] * (-len(groups) % pp)
        return groups

    def _run(self, batch: dict[str, torch.Tensor], micro_batches: list[torch.Tensor], on_logits, *,
             forward_only: bool) -> None:
        """Every micro-batch through the schedule; ``on_logits(rows, response_logits) -> loss`` on
        the last stage (``response_logits``: ``[B, R, ...]``, the logits that predict each row's
        response tokens)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if self.packing:  # every packed micro-batch padded to the longest, for the p2p buffers
            length = max(max(int(batch["attention_mask"][rows].sum()) for rows in micro_batches), 1)
            shape = (1, self._most(length) if self.lockstep else length)
        else:
            shape = (len(micro_batches[0]), batch["input_ids"].shape[1])
        shape = (shape[0], -(-shape[1] // self.length_multiple) * self.length_multiple)

        def forward_step(micro_iter, model):
            rows = next(micro_iter)
            if self.packing:
                *inputs, gather = _packed_inputs(batch, rows, shape[1])
                output = self._forward(model, batch, rows, inputs)
                return output, lambda logits: (on_logits(rows, logits[0][gather]), {})
            *inputs, response = _inputs(batch, rows, shape[1])
            return self._forward(model, batch, rows, inputs), lambda logits: (on_logits(rows, logits[:, response]), {})

        iterators = [iter(micro_batches) for _ in self.models]  # each chunk reads every micro-batch once
        get_forward_backward_func()(forward_step_func=forward_step,
                                    data_iterator=iterators if len(self.models) > 1 else iterators[0],
                                    model=self.models, num_microbatches=len(micro_batches), seq_length=shape[1],
                                    micro_batch_size=shape[0], forward_only=forward_only)

    def _forward(self, model, batch, rows: torch.Tensor, inputs: list):
        """``model``'s output on ``inputs`` (ids, positions, mask); a VLM's with its rows' images
        (:class:`posttrain.training.megatron.vision.VisionInputs`: the 3-D positions and ``decoder_input``)."""
        if self.vision is None:
            return model(*inputs)
        ids, positions, mask = inputs
        if self.packing:
            positions, embeds = self.vision.packed(model, batch, rows, ids)
        else:
            positions, embeds = self.vision.padded(model, batch, rows, ids, positions)
        return model(ids, positions, mask, decoder_input=embeds)

    def _inference(self, batch, micro_batch_size, on_logits) -> torch.Tensor | None:
        """``on_logits(rows, logits) -> [B, R]`` over every micro-batch without gradients; the rows'
        results in the batch's order times the response mask, on every rank."""
        micro_batches = self._micro_batches(batch, micro_batch_size, self.options.forward_budget)
        out: list[torch.Tensor] = []

        def collect(rows, logits):
            out.append(on_logits(rows, logits))
            return logits.new_zeros(())

        with torch.no_grad():
            self._run(batch, micro_batches, collect, forward_only=True)
        result = None
        if out:  # the last stage
            order = torch.cat(micro_batches)
            result = torch.empty(len(order), *out[0].shape[1:], dtype=out[0].dtype, device=out[0].device)
            result[order] = torch.cat(out)
        return _from_last_stage(result)

    def _response_logprobs(self, batch, rows: torch.Tensor, logits, temperature: float, with_entropy: bool,
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

        def on_logits(rows, logits):
            logprobs, entropy = self._response_logprobs(batch, rows, logits, temperature, with_entropy)
            return torch.stack([logprobs, entropy], -1) if with_entropy else logprobs

        result = self._inference(batch, micro_batch_size, on_logits)
        if result is None or not with_entropy:
            return None if result is None else result * mask
        return result[..., 0] * mask, result[..., 1] * mask

    def compute_values(self, batch: dict[str, torch.Tensor], *, micro_batch_size: int | None = None):
        """The critic's values ``[B, R]`` at the positions of the log-probs (0 on padding)."""
        result = self._inference(batch, micro_batch_size, lambda rows, values: values[..., 0].float())
        return None if result is None else result * batch["response_mask"].float()

    def compute_pair_logps(self, batch: dict[str, torch.Tensor], *, average: bool = False,
                           micro_batch_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """DPO: per-pair sequence log-probs ``(chosen [N], rejected [N])`` of a ``chosen_*`` /
        ``rejected_*`` batch, on the host: the token log-probs of its rows (:func:`interleave_pairs`,
        ``micro_batch_size`` pairs at a time) summed (``average``: averaged) per row."""
        rows = interleave_pairs(batch)
        logprobs = self.compute_logprobs(rows, micro_batch_size=2 * (micro_batch_size or self.micro_batch_size))
        logps, _ = row_sequence_logps(logprobs.cpu(), rows["response_mask"].cpu(), average)
        return logps[0::2].float(), logps[1::2].float()

    def update(self, batch: dict[str, torch.Tensor], loss_fn: LossFn, *, mini_batch_size: int, epochs: int = 1,
               shuffle: bool = False, seed: int = 0, micro_batch_size: int | None = None) -> list[dict[str, float]]:
        """``epochs`` passes over ``batch`` in mini-batches (the HF engine's order and shuffle), one
        optimizer step each; one metrics dict per step, the same on every rank. A loss over pairs
        (DPO) gives its batch as rows (``loss_fn.rows``: two per pair, next to each other); sizes
        then count pairs, as in the HF engine."""
        if (loss_fn.consumes == "values") != self.value_head:
            raise ValueError(f"a loss that consumes {loss_fn.consumes} on a model "
                             f"{'with' if self.value_head else 'without'} a value head")
        steps = minibatch_order(next(iter(batch.values())).shape[0], mini_batch_size, epochs=epochs,
                                shuffle=shuffle, seed=seed)
        self.model.train()
        out = []
        if self.offload is not None:
            self.offload.to_device()
        try:
            for chosen in steps:
                mini_batch = {k: v[chosen] for k, v in batch.items()}
                if loss_fn.rows is None:
                    out.append(self._step(mini_batch, loss_fn, micro_batch_size))
                else:
                    out.append(self._step(loss_fn.rows(mini_batch), loss_fn, micro_batch_size, 2))
        finally:
            if self.offload is not None:
                self.offload.to_host()
        return out

    def _step(self, mini_batch: dict[str, torch.Tensor], loss_fn: LossFn, micro_batch_size: int | None,
              rows_per_item: int = 1) -> dict[str, float]:
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import finalize_model_grads

        rows = mini_batch["input_ids"].shape[0]
        micro_batches = self._micro_batches(mini_batch, micro_batch_size, self.options.update_budget, rows_per_item)
        dp_group = ps.get_data_parallel_group()
        mask = mini_batch["response_mask"]  # the counts live where the collective runs (gloo: CPU, nccl: GPU)
        num_tokens, num_seqs = global_counts(mask.sum().float(), rows, mask.device, dp_group)
        # the schedule averages the micro-batches' losses, Megatron's DDP the ranks' gradients
        loss_scale = len(micro_batches) * dp_world_size(dp_group)
        totals: dict[str, torch.Tensor] = {}

        def on_logits(rows, logits):
            micro_batch = {k: v[rows] for k, v in mini_batch.items()}
            if self.value_head:  # the critic's values, not logits
                values = logits[..., 0].float() * micro_batch["response_mask"].float()
                loss, metrics = loss_fn.after_forward(values, micro_batch, num_tokens=num_tokens, num_seqs=num_seqs)
            else:
                logprobs, entropy = self._response_logprobs(mini_batch, rows, logits, loss_fn.temperature,
                                                            loss_fn.with_entropy, entropy_grad=loss_fn.entropy_grad)
                loss, metrics = loss_fn.after_forward(logprobs, entropy, micro_batch, num_tokens=num_tokens,
                                                      num_seqs=num_seqs)
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value.detach().float()
            return loss * loss_scale

        for model in self.models:
            model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._run(mini_batch, micro_batches, on_logits, forward_only=False)
        finalize_model_grads(self.models)
        lr = float(self.optimizer.param_groups[0]["lr"])
        updated, grad_norm, _ = self.optimizer.step()
        if not updated or grad_norm is None or not math.isfinite(float(grad_norm)):
            raise NaNLossError(f"The gradient norm is {grad_norm}; the optimizer step was skipped. Lower the "
                               f"learning rate, train in float32, or check the batch for empty or invalid rows.")
        if self.scheduler is not None:
            self.scheduler.step()
        metrics = _from_last_stage(reduce_metric_totals(totals, dp_group))
        metrics[f"{self.metric_prefix}/grad_norm"] = float(grad_norm)
        metrics[f"{self.metric_prefix}/lr"] = lr
        return metrics
