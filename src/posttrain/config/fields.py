"""Shared helpers for the typed config sections: fields, their status, unknown-key checks.

Every key of the schema carries one :class:`Status`, stored next to the field
(``F(default, doc, rule)`` puts the :class:`Rule` in the field's ``json_schema_extra``):

* **honoured**: the key changes what runs, or describes the model (architecture keys feed
  ``posttrain plan`` and ``posttrain init-model``);
* **refused**: a feature posttrain does not have yet; an active value is a
  :class:`~posttrain.errors.ConfigError` (:func:`posttrain.config.features.check_features`);
* **ignored**: a knob with no effect on this hardware; the keys a config sets are listed in one
  start-up warning (:func:`posttrain.config.features.startup_warnings`).

A refused or ignored key may be honoured on the megatron backend (``Rule.megatron``; the backend is
chosen by :mod:`posttrain.config.backend`): there it is neither refused nor warned about. Likewise a
``generate_config`` key with ``Rule.vllm`` under ``rl_config.rollout_engine: vllm``: there
:mod:`posttrain.config.vllm` passes it to vLLM or refuses it.

``docs/config_reference.md`` is generated from these rules (:mod:`posttrain.config.reference`).
"""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from posttrain.errors import ConfigError

DEVICES = ("cpu", "cuda")


class Status(str, Enum):
    HONOURED = "honoured"
    REFUSED = "refused"
    IGNORED = "ignored"


# When a value counts as "set" (active) for a refused or ignored key.
#   changed: the value is not one of ``ok`` (default: the field's default)
#   gt1:     the value is > 1
#   set:     the value is not None / empty
#   backend: the value is not the torch.distributed backend used on the device (gloo / nccl)
#   actor_devices: (rl_config.critic_resource, reward_resource: roles colocated with the actor) a
#                  device count other than actor_resource's
ACTIVE = ("changed", "gt1", "set", "backend", "actor_devices")


@dataclass(frozen=True)
class Rule:
    """The status of one key, and for refused / ignored keys when and why."""

    status: Status
    why: str = ""  # refused: what is missing; ignored: why the key has no effect
    todo: str = ""  # refused: what to do (default: derived from ``active`` and the default value)
    active: str = "changed"
    ok: tuple[Any, ...] = ()  # values that are fine under "changed" (default: the field's default)
    devices: tuple[str, ...] = DEVICES  # refused: where it is refused (elsewhere: ignored and warned);
    # ignored: where it has no effect
    explicit: bool = False  # active only when the config writes the key (not for schema defaults)
    switch: str | None = None  # checked only when this key of the same section is active
    group: str | None = None  # active keys of one group are reported together
    megatron: bool = False  # honoured on the megatron backend (posttrain.config.backend): neither refused nor warned
    megatron_with: str | None = None  # ... only while this key of the same section is active (else as above)
    vllm: bool = False  # with rl_config.rollout_engine: vllm, checked by posttrain.config.vllm (passed to vLLM or
    # refused there): neither refused nor warned here

    def __post_init__(self) -> None:
        if self.active not in ACTIVE:
            raise ValueError(f"unknown active predicate {self.active!r}")
        if any(d not in DEVICES for d in self.devices):
            raise ValueError(f"unknown device in {self.devices}")

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.value
        data["ok"] = list(self.ok)
        data["devices"] = list(self.devices)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Rule":
        data = dict(data)
        data["status"] = Status(data["status"])
        data["ok"] = tuple(data.get("ok", ()))
        data["devices"] = tuple(data.get("devices", DEVICES))
        return cls(**data)

    def is_active(self, value: Any, default: Any, device: str | None = None) -> bool:
        """Whether ``value`` sets the key (``device`` only matters to ``backend``; None: never)."""
        if self.active == "gt1":
            return value is not None and value > 1
        if self.active == "set":
            return value not in (None, "", [], {}, ())
        if self.active == "backend":
            return device is not None and value != ("gloo" if device == "cpu" else "nccl")
        if self.active == "actor_devices":
            raise ValueError("actor_devices needs the whole config (posttrain.config.features)")
        allowed = self.ok if self.ok else (default,)
        return not any(_same(value, a) for a in allowed)

    def default_todo(self, default: Any) -> str:
        if self.todo:
            return self.todo
        if self.active == "gt1":
            return "set it to 1"
        if self.active == "set" or default is None:
            return "remove the key"
        good = self.ok[0] if self.ok else default
        return f"remove the key or set it to {fmt_value(good)}"


def _same(a: Any, b: Any) -> bool:
    # True == 1 in Python; a boolean key is only "the same" as a boolean
    return a == b and isinstance(a, bool) == isinstance(b, bool)


HONOURED = Rule(Status.HONOURED)


def refused(why: str, todo: str = "", **kw: Any) -> Rule:
    """A feature posttrain does not have yet: an active value is an error naming ``why`` and ``todo``."""
    return Rule(Status.REFUSED, why, todo, **kw)


def ignored(why: str, **kw: Any) -> Rule:
    """No effect on (some) hardware: listed in the one start-up warning when the config writes it."""
    kw.setdefault("explicit", True)
    return Rule(Status.IGNORED, why, **kw)


def F(default: Any, doc: str, rule: Rule, **kw: Any) -> Any:
    """A field with its default, its documentation and its :class:`Rule`."""
    if not isinstance(rule, Rule):
        raise TypeError(f"F({default!r}, {doc!r}): the third argument must be a Rule, got {rule!r}")
    return Field(default=default, description=doc, json_schema_extra={"status": rule.to_json()}, **kw)


def field_rule(cls: type[BaseModel], name: str) -> Rule | None:
    """The :class:`Rule` stored on field ``name`` of ``cls`` (None when it has none)."""
    extra = cls.model_fields[name].json_schema_extra
    if not isinstance(extra, dict) or not isinstance(extra.get("status"), dict):
        return None
    return Rule.from_json(extra["status"])


def fmt_value(value: Any) -> str:
    """A value the way it is written in YAML (true, null, [a, b], {k: v})."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, BaseModel):
        value = value.model_dump()
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {fmt_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(fmt_value(v) for v in value) + "]"
    if isinstance(value, str):
        return value if value else '""'
    return str(value)


class Section(BaseModel):
    """A config section: unknown keys are rejected (see :func:`check_known_keys`)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


def check_known_keys(section: str, data: dict[str, Any], cls: type[BaseModel], where: Any = "") -> None:
    """Raise the seed's message for an unknown key, naming the section and the closest known key.
    ``where`` (a string, or a function of the key) goes first: ``"file.yaml line 3: "``."""
    known = list(cls.model_fields)
    for f in cls.model_fields.values():
        known += [c for c in getattr(f.validation_alias, "choices", []) if isinstance(c, str)]
    check_known_names(section, data, known, where)


def check_known_names(section: str, keys: Any, known: list[str], where: Any = "") -> None:
    """:func:`check_known_keys` against a plain list of names."""
    for key in keys:
        if key not in known:
            if callable(where):
                where = where(str(key))
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ConfigError(
                f"{where}{section}: The key: {key} is missing, causing the setup to fail. Please check. "
                f"If necessary, register it in the config file.{hint}")
