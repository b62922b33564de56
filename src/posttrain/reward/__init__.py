"""Rewards: rule verifiers (registry), the weighted rule reward with a timed worker pool,
DAPO's overlong penalty, reward-model scoring, LLM judges and decoding. See docs/rewards.md.

Public entry points (import the submodules; nothing heavy is imported here):

* :mod:`posttrain.reward.verifiers`: ``VERIFIERS`` (the registry), ``register_verifier``,
  ``import_verifier_modules``
* :class:`posttrain.reward.rule_reward.RuleReward`
* :func:`posttrain.reward.overlong.overlong_penalty`
* :class:`posttrain.reward.reward_model.RewardModelScorer`
* :class:`posttrain.reward.judge.JudgeScorer` (LLM-as-judge), :mod:`posttrain.reward.judge_pairwise`
  (the pairwise judge), :mod:`posttrain.reward.judge_parse`, :mod:`posttrain.reward.judge_template`
* :func:`posttrain.reward.decoding.decode_responses`, :func:`~posttrain.reward.decoding.decode_labels`
"""
