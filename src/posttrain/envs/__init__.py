"""Environments from the ecosystem as prompt sources and rewards (``rl_config.env_config``;
docs/environments.md): :mod:`~posttrain.envs.config` reads the key, :mod:`~posttrain.envs.verifiers_tasks`
adapts a ``verifiers`` taskset, :mod:`~posttrain.envs.dataset` turns its tasks into prompts and
:mod:`~posttrain.envs.reward` scores responses with its own reward functions."""
