"""Shared helpers for the typed config sections."""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from posttrain.errors import ConfigError


def F(default: Any, doc: str) -> Any:
    """A field with its default and its documentation (shown by ``posttrain plan --help`` and docs)."""
    return Field(default=default, description=doc)


class Section(BaseModel):
    """A config section: unknown keys are rejected (see :func:`check_known_keys`)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


def check_known_keys(section: str, data: dict[str, Any], cls: type[BaseModel]) -> None:
    """Raise the seed's message for an unknown key, naming the section and the closest known key."""
    known = list(cls.model_fields)
    for f in cls.model_fields.values():
        known += [c for c in getattr(f.validation_alias, "choices", []) if isinstance(c, str)]
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ConfigError(
                f"{section}: The key: {key} is missing, causing the setup to fail. Please check. "
                f"If necessary, register it in the config file.{hint}")
