"""The verifier registry.

A verifier is a plain function ``fn(response: str, label: str, **kw) -> float``. Register one with
the decorator and select it by name in ``rl_config.verifier_function``::

    from posttrain.reward.verifiers import register_verifier

    @register_verifier("my_exact")
    def my_exact(response: str, label: str, **kw) -> float:
        return 1.0 if response.strip() == label.strip() else 0.0

Keyword arguments a verifier may receive (only those its signature accepts are passed):
``prompt`` (the decoded prompt) and any extra per-sample column the caller provides
(e.g. ``tool_call_num``).

Look one up with ``VERIFIERS.get(name)`` (a :class:`VerifierSpec`; ``.fn`` is the function) and
list them with ``VERIFIERS.names()``. The built-in verifiers (the seed's names plus ``math_equiv``
and the number verifiers) are registered on first lookup; user modules are imported with
:func:`import_verifier_modules`.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Callable

from posttrain.errors import ConfigError
from posttrain.registry import Registry

VerifierFn = Callable[..., float]

_BUILTIN_MODULES = (
    "posttrain.reward.verifiers.formats",
    "posttrain.reward.verifiers.seed_math",
    "posttrain.reward.verifiers.minerva",
    "posttrain.reward.verifiers.numbers",
    "posttrain.reward.verifiers.equiv",
)


@dataclass(frozen=True)
class VerifierSpec:
    """A registered verifier: its name, function and the keyword arguments it accepts."""

    name: str
    fn: VerifierFn
    accepts: frozenset[str] | None  # None = accepts any keyword (**kw)

    def call(self, response: str, label: str, kwargs: dict) -> float:
        """Call the function with the keyword arguments it accepts; returns a float."""
        if self.accepts is None:
            kw = kwargs
        else:
            kw = {k: v for k, v in kwargs.items() if k in self.accepts}
        return float(self.fn(response, label, **kw))


VERIFIERS = Registry(
    "verifier", key="rl_config.verifier_function", modules=_BUILTIN_MODULES,
    hint="A verifier of your own must be registered with @register_verifier in a module listed in "
         "rl_config.verifier_modules.")


def _accepted_kwargs(fn: VerifierFn) -> frozenset[str] | None:
    params = list(inspect.signature(fn).parameters.values())
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params[2:] if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))


def register_verifier(name: str, *, overwrite: bool = False) -> Callable[[VerifierFn], VerifierFn]:
    """Decorator: register ``fn(response, label, **kw) -> float`` under ``name``.

    Registering a second, different function under a taken name raises unless ``overwrite``.
    """

    def deco(fn: VerifierFn) -> VerifierFn:
        VERIFIERS.add_unique(name, VerifierSpec(name, fn, _accepted_kwargs(fn)), identity=lambda spec: spec.fn,
                             replace=overwrite)
        return fn

    return deco


def import_verifier_modules(modules: list[str] | tuple[str, ...]) -> None:
    """Import user modules whose ``@register_verifier`` decorators register verifiers."""
    for mod in modules or ():
        try:
            importlib.import_module(mod)
        except ImportError as e:
            raise ConfigError(
                f"rl_config.verifier_modules: cannot import {mod!r} ({e}); make it importable "
                f"(install the package or add its folder to PYTHONPATH)") from e

