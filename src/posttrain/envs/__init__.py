"""Environments from the ecosystem as prompt sources and rewards (``rl_config.env_config``;
docs/environments.md): :mod:`~posttrain.envs.config` reads the key; :mod:`~posttrain.envs.verifiers_tasks`
adapts a ``verifiers`` taskset (single-turn, scored by its reward functions) and
:mod:`~posttrain.envs.openenv_local` an OpenEnv-style environment (multi-turn, run in process; its
turns: :mod:`posttrain.loops.env_turns`); :mod:`~posttrain.envs.dataset` turns the tasks into prompts and
:mod:`~posttrain.envs.reward` scores a taskset's responses."""
