"""Name -> value registries: advantage estimators, policy losses, rollout engines, verifiers, ...

::

    ESTIMATORS = Registry("advantage estimator", key="rl_config.adv_estimator")

    @ESTIMATORS.register("group_norm", "grpo")
    def group_norm(...): ...

    ESTIMATORS.get("grpo")   # group_norm
    ESTIMATORS.get("remax")  # ConfigError: Unknown advantage estimator 'remax'; known: gae, group_norm,
                             #   grpo, ... Check rl_config.adv_estimator.

A value registered as a ``"module:attr"`` string is imported on its first ``get`` (so heavy
optional dependencies such as vLLM stay unimported until used). ``modules`` are imported before the
first lookup, for registries whose entries register themselves on import. Registering a taken name
is a programming error (ValueError) unless ``replace=True``. Imports only the standard library.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from posttrain.errors import ConfigError


class Registry:
    """Values by name; ``kind`` (and the config ``key`` that selects one, and a ``hint``) name it in errors."""

    def __init__(self, kind: str, *, key: str = "", hint: str = "", modules: tuple[str, ...] = ()):
        self.kind, self.key, self.hint = kind, key, hint
        self._modules = modules
        self._entries: dict[str, Any] = {}

    def add(self, name: str, value: Any, *, replace: bool = False) -> Any:
        """Register ``value`` (or a lazy ``"module:attr"`` string) as ``name``; returns ``value``."""
        if name in self._entries and not replace:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._entries[name] = value
        return value

    def add_unique(self, name: str, value: Any, *, identity: Callable[[Any], Any] = lambda v: v,
                   replace: bool = False) -> Any:
        """Register ``value`` as ``name`` for a user-facing decorator: a name taken by the same
        object re-imported (``identity(value)`` has the same module and qualified name) is
        re-registered; one taken by another object raises ConfigError unless ``replace``."""
        try:  # no lookup before a clash: that would import the built-ins while one of them registers
            return self.add(name, value, replace=replace)
        except ValueError:
            old, new = identity(self._entries[name]), identity(value)
            if old is not new and _qualname(old) != _qualname(new):
                raise ConfigError(f"{self.kind} {name!r} is already registered by {_qualname(old)}; "
                                  f"choose another name or pass overwrite=True") from None
            return self.add(name, value, replace=True)

    def register(self, *names: str) -> Callable[[Any], Any]:
        """Decorator: register the decorated object under each of ``names``."""

        def wrap(value: Any) -> Any:
            for name in names:
                self.add(name, value)
            return value

        return wrap

    def _load(self) -> None:
        modules, self._modules = self._modules, ()  # cleared first: those modules register while importing
        for module in modules:
            importlib.import_module(module)

    def get(self, name: str) -> Any:
        """The value registered as ``name``; ConfigError naming the known ones otherwise."""
        if name not in self:
            what = f"Unknown {self.kind} {name!r}" if name else f"No {self.kind} given"
            msg = f"{what}; known: {', '.join(self.names())}."
            if self.key:
                msg += f" Check {self.key}."
            raise ConfigError(f"{msg} {self.hint}".rstrip())
        value = self._entries[name]
        if isinstance(value, str):
            module, _, attr = value.partition(":")
            value = self._entries[name] = getattr(importlib.import_module(module), attr)
        return value

    def names(self) -> tuple[str, ...]:
        """The registered names (aliases included), sorted."""
        self._load()
        return tuple(sorted(self._entries))

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._entries


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"

