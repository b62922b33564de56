"""Pure RL math: tensors and scalars in, tensors (and metric dicts) out. Imports torch only.

Modules: ``masked`` (masked mean/var/whiten), ``logprob`` (log-probs, entropy), ``aggregation``
(loss reduction modes), ``advantages`` (estimator registry), ``kl`` (penalties, controllers),
``policy_loss`` (PPO/GRPO/DAPO/GSPO + actor loss), ``value_loss``, ``dpo_loss``.
See docs/algorithms.md for the formulas.
"""

from posttrain.algo.advantages import (
    advantage_estimators,
    get_advantage_estimator,
    register_advantage_estimator,
    scores_to_token_level_rewards,
)
from posttrain.algo.aggregation import aggregate_loss, aggregation_modes
from posttrain.algo.dpo_loss import dpo_loss, dpo_loss_types
from posttrain.algo.kl import (
    apply_kl_in_reward,
    AdaptiveKLController,
    FixedKLController,
    build_kl_controller,
    kl_penalty,
    kl_penalty_types,
)
from posttrain.algo.logprob import entropy_from_logits, logprobs_from_logits
from posttrain.algo.masked import masked_mean, masked_sum, masked_var, masked_whiten
from posttrain.algo.policy_loss import actor_loss, compute_policy_loss, get_policy_loss, policy_losses
from posttrain.algo.value_loss import value_loss

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "actor_loss",
    "apply_kl_in_reward",
    "advantage_estimators",
    "aggregate_loss",
    "aggregation_modes",
    "build_kl_controller",
    "compute_policy_loss",
    "dpo_loss",
    "dpo_loss_types",
    "entropy_from_logits",
    "get_advantage_estimator",
    "get_policy_loss",
    "kl_penalty",
    "kl_penalty_types",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "policy_losses",
    "register_advantage_estimator",
    "scores_to_token_level_rewards",
    "value_loss",
]
