"""Pure RL math: tensors and scalars in, tensors (and metric dicts) out. Imports torch only.

Modules: ``masked`` (masked mean/var/whiten), ``logprob`` (log-probs, entropy), ``aggregation``
(loss reduction modes), ``advantages`` (estimators), ``kl`` (penalties, controllers),
``policy_loss`` (PPO/GRPO/DAPO/GSPO + actor loss), ``value_loss``, ``dpo_loss``. Each selectable
family is a :class:`posttrain.registry.Registry`: ``ADVANTAGE_ESTIMATORS``, ``AGGREGATIONS``,
``KL_PENALTIES``, ``POLICY_LOSSES``, ``DPO_LOSSES``. See docs/algorithms.md for the formulas.
"""

from posttrain.algo.advantages import ADVANTAGE_ESTIMATORS, compute_advantages, scores_to_token_level_rewards
from posttrain.algo.aggregation import AGGREGATIONS, aggregate_loss
from posttrain.algo.dpo_loss import DPO_LOSSES, dpo_loss
from posttrain.algo.kl import (
    KL_PENALTIES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_in_reward,
    build_kl_controller,
    kl_penalty,
)
from posttrain.algo.logprob import entropy_from_logits, logprobs_from_logits
from posttrain.algo.masked import masked_mean, masked_sum, masked_var, masked_whiten
from posttrain.algo.policy_loss import POLICY_LOSSES, actor_loss
from posttrain.algo.value_loss import value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "DPO_LOSSES",
    "KL_PENALTIES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "FixedKLController",
    "actor_loss",
    "apply_kl_in_reward",
    "aggregate_loss",
    "build_kl_controller",
    "compute_advantages",
    "dpo_loss",
    "entropy_from_logits",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "scores_to_token_level_rewards",
    "value_loss",
]
