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

A field may also declare the values that make sense (``F(0.2, doc, rule, ge=0, finite=True)``, a
``Literal`` type for a closed set of names): pydantic refuses a value outside them when the config
loads, and :func:`range_refusal` words that refusal (``rl_config.clip_ratio=-0.5: must be a finite
number >= 0``) with the field's ``note``. :func:`value_range` reads the declared range back (the
reference prints it).

``docs/config_reference.md`` is generated from these rules (:mod:`posttrain.config.reference`).
"""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any, Literal

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
#   actor_devices: (rl_config.critic_resource, reward_resource: roles colocated with the actor in integrated mode) a
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
# the honoured architecture keys of a model yaml (posttrain.config.megatron.ARCH): they change the model built
ARCH_WHY = "describes the model that posttrain init-model builds and posttrain plan sizes"


def refused(why: str, todo: str = "", **kw: Any) -> Rule:
    """A feature posttrain does not have yet: an active value is an error naming ``why`` and ``todo``."""
    return Rule(Status.REFUSED, why, todo, **kw)


def ignored(why: str, **kw: Any) -> Rule:
    """No effect on (some) hardware: listed in the one start-up warning when the config writes it."""
    kw.setdefault("explicit", True)
    return Rule(Status.IGNORED, why, **kw)


def F(default: Any, doc: str, rule: Rule, *, note: str = "", finite: bool = False, **kw: Any) -> Any:
    """A field with its default, its documentation and its :class:`Rule`. ``kw`` goes to pydantic's
    ``Field``: ``ge``, ``gt``, ``le``, ``lt`` declare the values that make sense; ``finite`` refuses
    NaN and infinities; ``note`` says in a few words what the number means (it ends the message of a
    value out of range: ``must be an integer >= 1 (prompts per iteration)``)."""
    if not isinstance(rule, Rule):
        raise TypeError(f"F({default!r}, {doc!r}): the third argument must be a Rule, got {rule!r}")
    extra: dict[str, Any] = {"status": rule.to_json()}
    if note:
        extra["note"] = note
    if finite:
        kw["allow_inf_nan"] = False
    return Field(default=default, description=doc, json_schema_extra=extra, **kw)


def field_rule(cls: type[BaseModel], name: str) -> Rule | None:
    """The :class:`Rule` stored on field ``name`` of ``cls`` (None when it has none)."""
    extra = cls.model_fields[name].json_schema_extra
    if not isinstance(extra, dict) or not isinstance(extra.get("status"), dict):
        return None
    return Rule.from_json(extra["status"])


# ---- declared ranges ----------------------------------------------------------------------------
# the pydantic error types of a value outside its field's declared range or choices
RANGE_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number",
                "literal_error")


@dataclass(frozen=True)
class ValueRange:
    """The values a field accepts: bounds (``ge``/``gt``/``le``/``lt``), finiteness, a closed set of
    ``choices``, and the field's ``note``."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    finite: bool = False
    integer: bool = False
    choices: tuple[Any, ...] = ()
    note: str = ""

    @property
    def declared(self) -> bool:
        return self.finite or bool(self.choices) or any(b is not None for b in (self.ge, self.gt, self.le, self.lt))

    def describe(self) -> str:
        """``an integer >= 1``, ``a finite number > 0``, ``a number in [0, 1)``, ``one of ddp, fsdp2``."""
        if self.choices:
            names = [fmt_value(c) for c in self.choices if c is not None]
            text = "one of " + ", ".join(names)
            return text + " or null" if None in self.choices else text
        low = f">= {_num(self.ge)}" if self.ge is not None else f"> {_num(self.gt)}" if self.gt is not None else ""
        high = f"<= {_num(self.le)}" if self.le is not None else f"< {_num(self.lt)}" if self.lt is not None else ""
        kind = "an integer" if self.integer else "a finite number" if self.finite and not (low and high) else \
            "a number"
        if low and high:
            left = "[" if self.ge is not None else "("
            right = "]" if self.le is not None else ")"
            return f"{kind} in {left}{low.split()[1]}, {high.split()[1]}{right}"
        return " ".join(part for part in (kind, low or high) if part)


def _num(value: float) -> str:
    return f"{value:g}"


def _optional_inner(annotation: Any) -> tuple[Any, bool]:
    """``(X, True)`` for ``Optional[X]``, else ``(annotation, False)``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return annotation, False


def _range_of(annotation: Any, metadata: list[Any], note: str) -> ValueRange:
    inner, nullable = _optional_inner(annotation)
    if typing.get_origin(inner) is typing.Annotated:
        inner, *more = typing.get_args(inner)
        metadata = [*metadata, *(m for extra in more for m in getattr(extra, "metadata", [extra]))]
    bounds: dict[str, Any] = {}
    finite = False
    for item in metadata:
        for name in ("ge", "gt", "le", "lt"):
            if getattr(item, name, None) is not None:
                bounds[name] = getattr(item, name)
        finite = finite or getattr(item, "allow_inf_nan", True) is False
    choices = typing.get_args(inner) + ((None,) if nullable else ()) if typing.get_origin(inner) is Literal else ()
    return ValueRange(**bounds, finite=finite, integer=inner is int, choices=choices, note=note)


def value_range(cls: type[BaseModel], *loc: Any) -> ValueRange | None:
    """The declared range of the value at ``loc`` (``("verifier_weight", 0)``, ``("sampling_config",
    "top_p")``) in section ``cls``; None when ``loc`` names no field."""
    info = cls.model_fields.get(str(loc[0])) if loc else None
    if info is None:
        return None
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    note = str(extra.get("note", ""))
    annotation, metadata = info.annotation, list(info.metadata)
    for i, part in enumerate(loc[1:], 1):
        inner, _ = _optional_inner(annotation)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            return value_range(inner, *loc[i:])
        if typing.get_origin(inner) is list and isinstance(part, int):
            annotation, metadata = typing.get_args(inner)[0], []
            continue
        return None
    return _range_of(annotation, metadata, note)


def range_refusal(cls: type[BaseModel], loc: tuple[Any, ...], value: Any) -> str | None:
    """``=VALUE: must be RANGE (NOTE)`` for a value outside the range declared at ``loc`` of ``cls``
    (None when none is declared there); the caller puts the key and where it was written first."""
    declared = value_range(cls, *loc)
    if declared is None or not declared.declared:
        return None
    shown = repr(value) if isinstance(value, str) and declared.choices else fmt_value(value)
    note = f" ({declared.note})" if declared.note else ""
    return f"={shown}: must be {declared.describe()}{note}"


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
