"""The roles a run builds once and its loops drive: :class:`~posttrain.roles.policy.Policy` (actor,
reference, rollout) and :class:`~posttrain.roles.critic.Critic`. The same objects are built in
process and inside each Ray worker (:mod:`posttrain.cluster`)."""
