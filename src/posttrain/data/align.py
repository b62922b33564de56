"""``map_keys`` and the conversion of raw rows to conversations (the seed's "alignment").

``map_keys`` maps fixed attributes to source columns (``""`` = absent)::

    prompt   instruction / question      (default column "instruction")
    query    extra input, joined to the prompt with "\\n"   (default "input")
    response reference answer             (default "output")
    system   system prompt column         (default: none)
    history  list of [user, assistant] pairs (default: none)
    chosen / rejected   pairwise answers  (defaults "chosen" / "rejected")
    label    unpaired preference label, a JSON/Parquet bool (default "label"; UnpairedPreferenceHandler)
    images / videos     multimodal media  (defaults "images" / "videos"; posttrain.data.media)

A row becomes an :class:`Aligned` conversation, or a skip reason (a short string that the
closing summary counts). Prompt, query, system and answer cells must be text: numbers become
their string (an answer ``8`` is ``"8"``), a dict or list where text is expected skips the row
(``prompt is a dict, expected text``); a one-element answer list is that answer.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any

from posttrain.errors import ConfigError, DataError

MAP_KEY_DEFAULTS: dict[str, str | None] = {"prompt": "instruction", "query": "input", "response": "output",
                                           "system": None, "history": None, "chosen": "chosen",
                                           "rejected": "rejected", "images": "images", "videos": "videos",
                                           "label": "label"}

SKIP_EMPTY_PROMPT = "empty prompt"
SKIP_EMPTY_RESPONSE = "empty response"
SKIP_BAD_HISTORY = "invalid history"


@dataclass
class Aligned:
    """One conversation: ``prompt`` ends with a user turn; ``responses`` are answer texts."""

    prompt: list[dict[str, str]]
    responses: list[str]
    system: str = ""
    extras: dict[str, Any] = field(default_factory=dict)


def resolve_map_keys(map_keys: dict | None, columns: list[str], needed: tuple[str, ...]) -> dict[str, str | None]:
    """Attribute -> column (or None). Errors use the seed's messages and list the columns that exist."""
    map_keys = dict(map_keys or {})
    have = f"The input has columns: {', '.join(sorted(columns))}."
    if len(map_keys) > len(MAP_KEY_DEFAULTS):
        raise ConfigError(f"Please check map_keys: at most {len(MAP_KEY_DEFAULTS)} keys "
                          f"({', '.join(MAP_KEY_DEFAULTS)}), got {len(map_keys)}.")
    for key, value in map_keys.items():
        if key not in MAP_KEY_DEFAULTS:
            raise ConfigError(f" {key} is invalid, Please check map_keys. Known keys: {', '.join(MAP_KEY_DEFAULTS)}.")
        if value and value not in columns:
            raise ConfigError(f" {value} is invalid, Please check map_keys: map_keys.{key} names column "
                              f"'{value}', which does not exist. {have}")
    resolved: dict[str, str | None] = {}
    for key, default in MAP_KEY_DEFAULTS.items():
        value = map_keys[key] if key in map_keys else default
        resolved[key] = value if value and value in columns else None
    for key in needed:
        if resolved[key] is None:
            raise ConfigError(f"map_keys.{key}: this handler needs a {key} column but '{map_keys.get(key, MAP_KEY_DEFAULTS[key])}' "
                              f"is not one. {have} Set map_keys, e.g. map_keys='{{\"{key}\": \"COLUMN\"}}'.")
    return resolved


def text(value: Any) -> str:
    """A cell as text: None -> "", strings as they are, numbers str(), lists/dicts as JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


class _NotText(Exception):
    """A dict or list where text is expected; the message is the skip reason."""


def _plain(value: Any, name: str) -> str:
    """A cell that must be text: as :func:`text`, but a dict or list raises :class:`_NotText`."""
    if isinstance(value, (dict, list)):
        raise _NotText(f"{name} is a {type(value).__name__}, expected text")
    return text(value)


def _skip_structured(fn):
    """An align function that returns the :class:`_NotText` reason instead of raising it."""
    @functools.wraps(fn)
    def wrapper(row: dict, keys: dict, extra_keys: list[str]) -> Aligned | str:
        try:
            return fn(row, keys, extra_keys)
        except _NotText as err:
            return str(err)
    return wrapper


def _history(value: Any) -> list[dict[str, str]] | None:
    if not value:
        return []
    messages = []
    for pair in value:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            return None
        messages += [{"role": "user", "content": text(pair[0])}, {"role": "assistant", "content": text(pair[1])}]
    return messages


def _prompt_messages(row: dict, keys: dict, prompt_text: str) -> list[dict[str, str]] | str:
    query = _plain(row.get(keys["query"]), "query") if keys["query"] else ""
    content = "\n".join(p for p in (prompt_text, query) if p)
    if not content.strip():
        return SKIP_EMPTY_PROMPT
    history = _history(row.get(keys["history"])) if keys["history"] else []
    if history is None:
        return SKIP_BAD_HISTORY
    return history + [{"role": "user", "content": content}]


def _extras(row: dict, extra_keys: list[str]) -> dict[str, Any]:
    return {k: row.get(k) for k in extra_keys if k != "labels"}


def _single_response(value: Any) -> str:
    if isinstance(value, list):
        return _plain(value[0], "response") if len(value) == 1 else ""  # several answers: invalid here
    return _plain(value, "response")


@_skip_structured
def align_alpaca(row: dict, keys: dict, extra_keys: list[str]) -> Aligned | str:
    prompt = _prompt_messages(row, keys, _plain(row.get(keys["prompt"]), "prompt"))
    if isinstance(prompt, str):
        return prompt
    response = _single_response(row.get(keys["response"])) if keys["response"] else ""
    if not response.strip():
        return SKIP_EMPTY_RESPONSE
    system = _plain(row.get(keys["system"]), "system") if keys["system"] else ""
    return Aligned(prompt, [response], system, _extras(row, extra_keys))


@_skip_structured
def align_math17k(row: dict, keys: dict, extra_keys: list[str]) -> Aligned | str:
    """DAPO-Math-17k: ``prompt`` is a list of messages (first content used), ``reward_model`` a dict."""
    raw_prompt = row.get(keys["prompt"])
    if isinstance(raw_prompt, list):
        first = raw_prompt[0] if raw_prompt else {}
        raw_prompt = first.get("content", "") if isinstance(first, dict) else first
    prompt = _prompt_messages(row, keys, _plain(raw_prompt, "prompt"))
    if isinstance(prompt, str):
        return prompt
    raw = row.get(keys["response"]) if keys["response"] else None
    if isinstance(raw, dict):
        raw = raw.get("ground_truth", "")
    response = _single_response(raw)
    if not response.strip():
        return SKIP_EMPTY_RESPONSE
    system = _plain(row.get(keys["system"]), "system") if keys["system"] else ""
    return Aligned(prompt, [response], system, _extras(row, extra_keys))


def _answer(value: Any, name: str) -> str:
    if isinstance(value, list) and value and isinstance(value[-1], dict):
        return _plain(value[-1].get("content"), name)  # a message list: the last (assistant) message
    return _plain(value, name)


@_skip_structured
def align_pairwise(row: dict, keys: dict, extra_keys: list[str]) -> Aligned | str:
    """Pairwise: ``chosen``/``rejected`` columns, or a ``response`` list ``[chosen, rejected]``."""
    prompt = _prompt_messages(row, keys, _plain(row.get(keys["prompt"]), "prompt"))
    if isinstance(prompt, str):
        return prompt
    if keys["chosen"] and keys["rejected"]:
        chosen, rejected = _answer(row.get(keys["chosen"]), "chosen"), _answer(row.get(keys["rejected"]), "rejected")
    else:
        both = row.get(keys["response"]) if keys["response"] else None
        if not isinstance(both, list) or len(both) < 2:
            return SKIP_EMPTY_RESPONSE
        chosen, rejected = _plain(both[0], "chosen"), _plain(both[1], "rejected")
    if not chosen.strip() or not rejected.strip():
        return SKIP_EMPTY_RESPONSE
    system = _plain(row.get(keys["system"]), "system") if keys["system"] else ""
    return Aligned(prompt, [chosen, rejected], system, _extras(row, extra_keys))


class RowError(DataError):
    """A row that cannot be trained on and must not be skipped silently (preprocess names the row)."""


@_skip_structured
def align_unpaired(row: dict, keys: dict, extra_keys: list[str]) -> Aligned | str:
    """Unpaired preference (KTO): a prompt, one completion (the ``response`` column) and a ``label``
    that is true (desirable) or false (undesirable); the label is kept in ``extras["label"]``. A
    missing or non-bool label raises :class:`RowError`."""
    label = row.get(keys["label"]) if keys["label"] else None
    if not isinstance(label, bool):
        what = "no label" if label is None else f"label {label!r} ({type(label).__name__})"
        raise RowError(f"{what}: an unpaired preference row needs a JSON/Parquet bool label, true (desirable) or "
                       f"false (undesirable), in column '{keys['label'] or 'label'}' (map_keys.label)")
    aligned = align_alpaca.__wrapped__(row, keys, extra_keys)
    if isinstance(aligned, Aligned):
        aligned.extras["label"] = label
    return aligned
