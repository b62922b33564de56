"""``rl_config.env_config``: which environment a run trains on, checked before anything is built.

    env_config: {type: verifiers, id: my_taskset, args: {...}, limit: 64}
    env_config: {type: openenv, id: my_module:MyEnvironment, args: {...}, resets: [{seed: 1}], max_turns: 4}

``type`` names the adapter: ``verifiers``, a taskset of the ``verifiers`` package (0.4.0;
:mod:`posttrain.envs.verifiers_tasks`), single-turn; ``openenv``, an OpenEnv-style environment class
(``reset``/``step``) run in this process (:mod:`posttrain.envs.openenv_local`), multi-turn. ``id``
names the taskset or the environment; ``args`` configures it (the taskset config's fields, or the
environment's keyword arguments); ``limit`` keeps the first tasks only. ``openenv`` only:
``resets`` (one task per set of ``reset`` arguments) and ``max_turns`` (the most model turns of an
episode).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from posttrain.errors import ConfigError

KEY = "rl_config.env_config"
TYPES = ("verifiers", "openenv")
KEYS = ("type", "id", "args", "limit", "resets", "max_turns")
OPENENV_ONLY = ("resets", "max_turns")


@dataclass(frozen=True)
class EnvOptions:
    """The environment a run trains on: its prompts and its reward (see the module docstring)."""

    type: str
    id: str
    args: Mapping[str, Any] = field(default_factory=dict)
    limit: int | None = None
    resets: tuple[Mapping[str, Any], ...] = ()
    max_turns: int = 4

    @property
    def multi_turn(self) -> bool:
        """Whether the environment answers the model's turns (openenv) rather than scoring one reply."""
        return self.type == "openenv"


def _whole(value, name: str, default: int | None) -> int | None:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{KEY}.{name} must be a whole number >= 1, not {value!r}")
    return value


def env_options(raw: Mapping[str, Any] | None) -> EnvOptions | None:
    """``rl_config.env_config`` checked and typed (None when the key is not set)."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{KEY} must be a mapping such as {{type: verifiers, id: my_taskset}}, not "
                          f"{type(raw).__name__}")
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise ConfigError(f"{KEY}: unknown key(s) {', '.join(map(str, unknown))}; its keys are {', '.join(KEYS)} "
                          "(the environment's own settings go under args)")
    kind = raw.get("type")
    if kind not in TYPES:
        raise ConfigError(f"{KEY}.type: {kind!r} is not an environment type; known: {', '.join(TYPES)}")
    if kind != "openenv" and any(raw.get(k) is not None for k in OPENENV_ONLY):
        raise ConfigError(f"{KEY}: {' and '.join(k for k in OPENENV_ONLY if raw.get(k) is not None)} belong to "
                          f"type: openenv (a verifiers taskset's tasks and turns are its own); remove them")
    ident = raw.get("id")
    if not isinstance(ident, str) or not ident.strip():
        raise ConfigError(f"{KEY}.id: give the taskset's id (an installed verifiers taskset package, or a "
                          f"module path whose __all__ exports one Taskset subclass) or, for openenv, "
                          f"module:EnvironmentClass; not {ident!r}")
    args = raw.get("args") or {}
    if not isinstance(args, Mapping):
        raise ConfigError(f"{KEY}.args must be a mapping of the taskset config's fields, not {type(args).__name__}")
    resets = raw.get("resets") or ()
    if not isinstance(resets, (list, tuple)) or not all(isinstance(r, Mapping) for r in resets):
        raise ConfigError(f"{KEY}.resets must be a list of mappings (the reset() keyword arguments of each task)")
    return EnvOptions(type=kind, id=ident.strip(), args=dict(args), limit=_whole(raw.get("limit"), "limit", None),
                      resets=tuple(dict(r) for r in resets), max_turns=_whole(raw.get("max_turns"), "max_turns", 4))
