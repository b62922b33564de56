"""Ready-made loss functions for an engine's ``update``: actor (GRPO/DAPO/PPO), critic, SFT, DPO.

Each factory takes the hyperparameters and returns a :class:`~posttrain.training.base.LossFn`:
``loss_fn(model, micro_batch, *, num_tokens, num_seqs, packing) -> (loss, metrics)`` runs the
forward its fields declare, then its ``after_forward`` (the part a backend that runs its own
forward calls: the Megatron engine). The engine passes ``packing`` (a
:class:`~posttrain.training.remove_padding.Packing` when its options turn remove padding on, else
None). Batch keys (layout in :mod:`posttrain.training.forward`):

* actor: ``input_ids``, ``attention_mask``, ``response_mask``, ``advantages``, optional
  ``old_logprobs`` (when absent: the seed's on-policy skip, ``old_logprobs = logprobs.detach()``,
  ratio 1), ``ref_logprobs`` (GRPO's KL term, weighted by ``kl_coef``) and ``rollout_weights``
  (the rollout correction's per-token weights: each token's policy loss is scaled by its weight,
  and a token of weight 0 leaves the loss)
* critic: ``input_ids``, ``attention_mask``, ``response_mask``, ``values`` (old), ``returns``
* sft: ``input_ids``, ``attention_mask``, ``response_mask``
* dpo: ``chosen_*`` and ``rejected_*`` versions of the three model keys, plus per-pair
  ``ref_chosen_logps [N]`` and ``ref_rejected_logps [N]`` (sums over response tokens under the
  reference; see :func:`sequence_logps`). DPO normalises by pairs (``num_seqs``), whatever the
  engine's ``loss_mask_key``.
* kto: the rows' model keys plus per-row ``ref_logps [N]``, ``kto_desirable [N]`` (1 / 0),
  ``kto_reference_point [N]`` (the batch's ``z0``, repeated) and ``kto_num_desirable`` /
  ``kto_num_undesirable [N]`` (the mini-batch's counts, repeated; for the metrics).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from posttrain.algo.dpo_loss import AVERAGED, dpo_loss
from posttrain.algo.kto_loss import kto_loss
from posttrain.algo.policy_loss import actor_loss
from posttrain.algo.value_loss import value_loss
from posttrain.training.base import AfterForward, Batch, LossFn, LossOutput
from posttrain.training.forward import response_logprobs
from posttrain.training.options import ActorLossOptions
from posttrain.training.remove_padding import Packing

MODEL_KEYS = ("input_ids", "attention_mask", "position_ids", "response_mask")


def make_actor_loss_fn(options: ActorLossOptions = ActorLossOptions(), *, kl_coef: float = 0.0,
                       report_entropy: bool = True) -> LossFn:
    """GRPO/DAPO/PPO actor loss (:func:`posttrain.algo.policy_loss.actor_loss`) with ``options``.

    With ``report_entropy`` the entropy is reported (``actor/entropy``); it carries gradient only
    when ``entropy_coeff`` is non-zero (the seed computes it only then). ``kl_coef`` is fixed per
    function: build a new one each iteration from ``kl_controller.value``.
    """
    o = options

    def after_forward(logprobs, entropy, micro_batch, *, num_tokens=None, num_seqs=None):
        old = micro_batch.get("old_logprobs")
        ref = micro_batch.get("ref_logprobs")  # reported as actor/kl_loss even when kl_coef is 0
        advantages, mask = micro_batch["advantages"], micro_batch["response_mask"]
        weights = micro_batch.get("rollout_weights")  # the rollout correction (tis: min(rho, C); mis: 0 or 1)
        if weights is not None:  # w * pg_token == pg_token with advantages scaled by w, for w >= 0
            advantages, mask = advantages * weights, mask * (weights > 0).to(mask.dtype)
        return actor_loss(
            logprobs,
            logprobs.detach() if old is None else old,
            advantages,
            mask,
            policy_loss=o.policy_loss,
            clip_low=o.clip_low,
            clip_high=o.clip_high,
            clip_ratio_c=o.clip_ratio_c,
            policy_params=dict(o.policy_params),
            entropy=entropy,
            entropy_coeff=o.entropy_coeff,
            ref_logprobs=ref,
            kl_coef=kl_coef,
            kl_penalty=o.kl_penalty,
            loss_agg_mode=o.loss_agg_mode,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            norm_length=o.norm_length,
        )

    return LossFn(after_forward, temperature=o.temperature, truncation=o.truncation,
                  with_entropy=report_entropy or bool(o.entropy_coeff), entropy_grad=bool(o.entropy_coeff))


def make_critic_loss_fn(*, cliprange_value: float = 0.5, loss_agg_mode: str = "token-mean") -> LossFn:
    """PPO clipped value loss (:func:`posttrain.algo.value_loss.value_loss`)."""

    def after_forward(values, micro_batch, *, num_tokens=None, num_seqs=None):
        return value_loss(
            values,
            micro_batch["values"],
            micro_batch["returns"],
            micro_batch["response_mask"],
            cliprange_value=cliprange_value,
            loss_agg_mode=loss_agg_mode,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
        )

    return LossFn(after_forward, consumes="values")


def _sft_loss(logprobs, entropy, micro_batch, *, num_tokens=None, num_seqs=None) -> LossOutput:
    mask = micro_batch["response_mask"].to(logprobs.dtype)
    denom = mask.sum() if num_tokens is None else num_tokens
    loss = -(logprobs * mask).sum() / torch.clamp(torch.as_tensor(denom, dtype=logprobs.dtype), min=1e-8)
    return loss, {"sft/loss": loss.detach()}


def make_sft_loss_fn() -> LossFn:
    """Cross-entropy on response tokens, token-mean over the mini-batch. Metric ``sft/loss``."""
    return LossFn(_sft_loss)


def _side(micro_batch, prefix):
    return {key: micro_batch[f"{prefix}_{key}"] for key in MODEL_KEYS if f"{prefix}_{key}" in micro_batch}


def _joint_sides(micro_batch) -> dict[str, torch.Tensor] | None:
    """The chosen rows then the rejected rows as one batch (responses right-padded to the wider
    side), so a packed forward stores each pair's prompt once; None if the prompt widths differ."""
    chosen, rejected = _side(micro_batch, "chosen"), _side(micro_batch, "rejected")
    widths = [b["input_ids"].shape[1] - b["response_mask"].shape[1] for b in (chosen, rejected)]
    if widths[0] != widths[1] or set(chosen) != set(rejected):
        return None
    resp = max(b["response_mask"].shape[1] for b in (chosen, rejected))
    # every key of a side is R_side columns short of the joint width (the prompt part is equal)
    return {key: torch.cat([torch.nn.functional.pad(side[key], (0, resp - side["response_mask"].shape[1]))
                            for side in (chosen, rejected)]) for key in chosen}


def pair_logps(model, micro_batch, average: bool, packing: Packing | None = None):
    """(chosen, rejected, chosen NLL) per pair; one forward over both sides with ``packing`` (the
    pair's shared prompt is then packed once), else one forward per side."""
    joint = _joint_sides(micro_batch) if packing is not None else None
    if joint is None:
        chosen, chosen_nll = sequence_logps(model, _side(micro_batch, "chosen"), average=average, packing=packing)
        rejected, _ = sequence_logps(model, _side(micro_batch, "rejected"), average=average, packing=packing)
        return chosen, rejected, chosen_nll
    logps, nll = sequence_logps(model, joint, average=average, packing=packing)
    pairs = logps.shape[0] // 2
    return logps[:pairs], logps[pairs:], nll[:pairs]


def sequence_logps(model, batch, *, average: bool = False,
                   packing: Packing | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row sum (or, with ``average``, mean) of response log-probs, and the per-row mean NLL."""
    logprobs, _ = response_logprobs(model, batch, packing=packing)
    count = batch["response_mask"].sum(-1).clamp(min=1).to(logprobs.dtype)
    total = logprobs.sum(-1)
    return (total / count if average else total), -total / count


def interleave_pairs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A DPO batch as rows for an engine that takes rows (the Megatron backend): each pair's chosen
    row then its rejected row (responses right-padded to the wider side), with each row's
    reference sequence log-prob ``ref_logps`` when the batch has the reference's."""
    joint = _joint_sides(batch)  # every chosen row, then every rejected row
    if joint is None:
        raise ValueError("the chosen and rejected sides of a DPO batch must share their prompt columns")
    pairs = batch["chosen_input_ids"].shape[0]
    order = torch.arange(2 * pairs).view(2, pairs).t().reshape(-1)
    rows = {key: value[order] for key, value in joint.items()}
    if "ref_chosen_logps" in batch:
        rows["ref_logps"] = torch.stack([batch["ref_chosen_logps"], batch["ref_rejected_logps"]], 1).reshape(-1)
    return rows


def row_sequence_logps(logprobs: torch.Tensor, response_mask: torch.Tensor, average: bool):
    """Per-row sum (``average``: mean) of the response log-probs, and the per-row mean NLL, from
    token log-probs that are 0 on padding (as :func:`sequence_logps` computes them after a forward)."""
    count = response_mask.sum(-1).clamp(min=1).to(logprobs.dtype)
    total = logprobs.sum(-1)
    return (total / count if average else total), -total / count



@dataclass(frozen=True, kw_only=True)
class PairLossFn(LossFn):
    """A loss over preference pairs (DPO). Called on a ``chosen_*`` / ``rejected_*`` micro-batch it
    runs :func:`pair_logps` (one forward over both sides with ``packing``) and ``after_pairs``; a
    backend that takes rows (the Megatron engine) runs its log-prob forward on ``rows(batch)``
    (:func:`interleave_pairs`: two rows per pair, next to each other) and ``after_forward``, whose
    ``num_seqs`` then counts rows.

    ``after_pairs(chosen [N], rejected [N], chosen_nll [N], micro_batch, *, num_seqs)``: the loss
    from the pairs' sequence log-probs (sums; means with ``average``)."""

    after_pairs: AfterForward
    average: bool = False
    rows: Callable[[Batch], Batch] | None = interleave_pairs

    def __call__(self, model: torch.nn.Module, micro_batch: Batch, *, num_tokens=None, num_seqs=None,
                 packing: Packing | None = None) -> LossOutput:
        chosen, rejected, chosen_nll = pair_logps(model, micro_batch, self.average, packing)
        return self.after_pairs(chosen, rejected, chosen_nll, micro_batch, num_seqs=num_seqs)


def make_dpo_loss_fn(
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    pref_ftx: float = 0.0,
) -> PairLossFn:
    """DPO (:func:`posttrain.algo.dpo_loss.dpo_loss`); ``ipo`` and ``orpo`` use length-averaged log-probs.

    The reference log-probs in the batch must be computed the same way (``average`` for ipo).
    """
    average = loss_type in AVERAGED

    def pair_loss(chosen, rejected, ref_chosen, ref_rejected, chosen_nll, num_pairs):
        return dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=beta, loss_type=loss_type,
                        label_smoothing=label_smoothing, pref_ftx=pref_ftx, chosen_nll=chosen_nll,
                        num_pairs=num_pairs)

    def after_pairs(chosen, rejected, chosen_nll, micro_batch, *, num_seqs=None):
        return pair_loss(chosen, rejected, micro_batch["ref_chosen_logps"], micro_batch["ref_rejected_logps"],
                         chosen_nll, num_seqs)

    def after_forward(logprobs, entropy, micro_batch, *, num_tokens=None, num_seqs=None):
        """The loss from the token log-probs of :func:`interleave_pairs` rows (``num_seqs``: rows,
        two per pair)."""
        logps, nll = row_sequence_logps(logprobs, micro_batch["response_mask"], average)
        ref = micro_batch["ref_logps"]
        return pair_loss(logps[0::2], logps[1::2], ref[0::2], ref[1::2], nll[0::2],
                         None if num_seqs is None else num_seqs / 2)

    return PairLossFn(after_forward, after_pairs=after_pairs, average=average)


def make_kto_loss_fn(*, beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> LossFn:
    """KTO (:func:`posttrain.algo.kto_loss.kto_loss`) on unpaired rows: each row's sequence log-prob
    (sum over its response tokens), averaged over the mini-batch's rows (``num_seqs``). Metrics
    ``dpo/loss``, ``rewards/chosen`` (desirable rows), ``rewards/rejected`` (undesirable rows)."""

    def after_forward(logprobs, entropy, micro_batch, *, num_tokens=None, num_seqs=None):
        logps, _ = row_sequence_logps(logprobs, micro_batch["response_mask"], average=False)
        loss, metrics = kto_loss(logps, micro_batch["ref_logps"].to(logps.dtype), micro_batch["kto_desirable"],
                                 micro_batch["kto_reference_point"][0], beta=beta, desirable_weight=desirable_weight,
                                 undesirable_weight=undesirable_weight, num_rows=num_seqs,
                                 num_desirable=micro_batch["kto_num_desirable"][0],
                                 num_undesirable=micro_batch["kto_num_undesirable"][0])
        return loss, {"dpo/loss": loss.detach(), **metrics}

    return LossFn(after_forward)
