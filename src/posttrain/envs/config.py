"""``rl_config.env_config``: which environment a run trains on, checked before anything is built.

    env_config: {type: verifiers, id: my_taskset, args: {...}, limit: 64}

``type`` names the adapter (``verifiers``: a taskset of the ``verifiers`` package, 0.4.0);
``id`` the taskset as ``verifiers`` resolves it (an installed package or an importable module
exporting one ``Taskset`` subclass in ``__all__``); ``args`` the fields of the taskset's config
(its ``TasksetConfig`` subclass); ``limit`` keeps the first tasks only. ``openenv`` is refused
here with the reason (docs/environments.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from posttrain.errors import ConfigError

KEY = "rl_config.env_config"
TYPES = ("verifiers",)
KEYS = ("type", "id", "args", "limit")
OPENENV_REFUSAL = (
    f"{KEY}.type: openenv is not supported: an openenv-core environment is reached through its EnvClient "
    "(HTTP/WebSocket to a server or a container, as verifiers' own openenv taskset does), which posttrain does "
    "not drive, and openenv-core is not installed with posttrain (its dependencies conflict with verifiers'); "
    "train on a verifiers taskset (type: verifiers) whose tasks hold the prompts and whose rewards score them")


@dataclass(frozen=True)
class EnvOptions:
    """The environment a run trains on: its prompts and its reward (see the module docstring)."""

    type: str
    id: str
    args: Mapping[str, Any] = field(default_factory=dict)
    limit: int | None = None


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
                          "(the taskset's own settings go under args)")
    kind = raw.get("type")
    if kind == "openenv":
        raise ConfigError(OPENENV_REFUSAL)
    if kind not in TYPES:
        raise ConfigError(f"{KEY}.type: {kind!r} is not an environment type; known: {', '.join(TYPES)}")
    ident = raw.get("id")
    if not isinstance(ident, str) or not ident.strip():
        raise ConfigError(f"{KEY}.id: give the taskset's id (an installed verifiers taskset package, or a "
                          "module path whose __all__ exports one Taskset subclass), not {ident!r}")
    args = raw.get("args") or {}
    if not isinstance(args, Mapping):
        raise ConfigError(f"{KEY}.args must be a mapping of the taskset config's fields, not {type(args).__name__}")
    limit = raw.get("limit")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ConfigError(f"{KEY}.limit must be a whole number >= 1 (the first tasks kept), not {limit!r}")
    return EnvOptions(type=kind, id=ident.strip(), args=dict(args), limit=limit)
