"""The roles a run builds once and its loops drive: :class:`~posttrain.roles.policy.Policy` (actor,
reference, rollout; on the Megatron backend each rank's :class:`~posttrain.roles.megatron_policy.MegatronPolicy`),
:class:`~posttrain.roles.critic.Critic` and the frozen reward model
(:mod:`posttrain.roles.reward_model`). The same objects are built in process and inside each Ray
worker (:mod:`posttrain.cluster`)."""
