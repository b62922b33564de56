"""An OpenEnv-style environment run in this process: ``reset(**kwargs) -> observation``,
``step(action) -> observation`` (``observation.done``, ``observation.reward``), the interface of
``openenv.core.env_server.interfaces.Environment`` (openenv-core 0.3.0), used duck-typed: the
package is not imported, so an environment class written for OpenEnv's server side trains here as
it is, without its HTTP server.

* ``id: module:Name`` names the environment class (or a factory), built with ``args`` once per
  episode; ``resets`` lists the tasks, one set of ``reset`` keyword arguments each (default one
  task, ``reset()``).
* The model's turn (its text, special tokens skipped) becomes the action: an instance of the
  environment's action class (its ``action_type`` attribute, else the first type argument of its
  ``Environment[Action, Observation, State]`` base) with the text in its one string field.
* An observation becomes text: its one string field (``done``, ``reward`` and ``metadata`` aside),
  else its fields as JSON. The reset observation is the prompt (a user message); later ones are
  the environment's turns. The episode's reward is the sum of its steps' rewards.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, get_args

from posttrain.envs.config import KEY, EnvOptions
from posttrain.errors import ConfigError

SKIPPED_FIELDS = ("done", "reward", "metadata")


@dataclass
class Episode:
    """One environment instance's episode: its reward so far, turns taken and whether it ended."""

    env: Any
    reward: float = 0.0
    turns: int = 0
    done: bool = False


class LocalEnvironment:
    """The tasks of an OpenEnv-style environment (the module docstring) and its episodes."""

    def __init__(self, options: EnvOptions):
        self.options = options
        self.factory = _import(options.id)
        self.tasks: list[Mapping[str, Any]] = list(options.resets or [{}])
        if options.limit:
            self.tasks = self.tasks[:options.limit]
        probe = self._build()
        self.action_type, self.action_field = action_type(probe, options.id)
        self.prompts = [observation_text(self._reset(self._build(), i)) for i in range(len(self.tasks))]

    def messages(self, index: int) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.prompts[index]}]

    def start(self, index: int) -> Episode:
        """A new episode of task ``index`` (a fresh environment, reset with the task's arguments)."""
        episode = Episode(self._build())
        self._reset(episode.env, index)
        return episode

    def step(self, episode: Episode, text: str) -> str:
        """The model's turn ``text`` as the action; the observation's text (the episode's reward,
        turn count and end are updated)."""
        observation = episode.env.step(self.action_type(**{self.action_field: text}))
        episode.turns += 1
        episode.reward += float(getattr(observation, "reward", None) or 0.0)
        episode.done = bool(getattr(observation, "done", False))
        return observation_text(observation)

    def score(self, indexes, completions):
        raise ConfigError(f"{KEY}: an OpenEnv-style environment scores its episodes while they run (step "
                          "rewards), not finished texts")

    def _build(self):
        try:
            env = self.factory(**self.options.args)
        except (TypeError, ValueError) as err:  # pydantic's ValidationError is a ValueError
            raise ConfigError(f"{KEY}.args: {self.options.id} cannot be built with {dict(self.options.args)}: "
                              f"{err}") from None
        if not (callable(getattr(env, "reset", None)) and callable(getattr(env, "step", None))):
            raise ConfigError(f"{KEY}.id: {self.options.id} built {type(env).__name__}, which has no reset() and "
                              "step(action); name an OpenEnv Environment class or a factory returning one")
        return env

    def _reset(self, env, index: int):
        try:
            return env.reset(**self.tasks[index])
        except TypeError as err:
            raise ConfigError(f"{KEY}.resets[{index}]: {type(env).__name__}.reset refuses {dict(self.tasks[index])}: "
                              f"{err}") from None


def _import(ident: str):
    module_name, _, attr = ident.partition(":")
    if not attr:
        raise ConfigError(f"{KEY}.id: name the environment as module:ClassName (or module:factory), not {ident!r}")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"{KEY}.id: cannot import {ident!r}: {err}") from None


def action_type(env, ident: str) -> tuple[type, str]:
    """The environment's action class and the name of its one string field."""
    cls = getattr(env, "action_type", None)
    if cls is None:
        for klass in type(env).__mro__:
            for base in getattr(klass, "__orig_bases__", ()):
                args = [a for a in get_args(base) if isinstance(a, type)]
                if args and cls is None:
                    cls = args[0]
    fields = getattr(cls, "model_fields", None)
    strings = [name for name, f in (fields or {}).items() if f.annotation is str and name not in SKIPPED_FIELDS]
    if len(strings) != 1:
        raise ConfigError(f"{KEY}.id: {ident}: the action class ({getattr(cls, '__name__', cls)}) must be a pydantic "
                          "model with exactly one string field (the model's turn goes there); give the environment "
                          "an action_type attribute naming such a class")
    return cls, strings[0]


def observation_text(observation) -> str:
    """An observation's text: its one string field, else its fields (``done``/``reward``/``metadata`` aside) as JSON."""
    values = {k: v for k, v in observation.model_dump().items() if k not in SKIPPED_FIELDS}
    strings = [v for v in values.values() if isinstance(v, str)]
    return strings[0] if len(strings) == 1 and len(values) == 1 else json.dumps(values, default=str)
