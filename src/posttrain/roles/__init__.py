"""The roles a run builds once and its loops drive: :class:`~posttrain.roles.policy.Policy` (actor,
reference, rollout), :class:`~posttrain.roles.critic.Critic` and the frozen reward model
(:mod:`posttrain.roles.reward_model`). The same objects are built in process and inside each Ray
worker (:mod:`posttrain.cluster`)."""
