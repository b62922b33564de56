"""``map_keys`` and the conversion of raw rows to conversations (the seed's "alignment").

``map_keys`` maps fixed attributes to source columns (``""`` = absent)::

    prompt   instruction / question      (default column "instruction")
    query    extra input, joined to the prompt with "\\n"   (default "input")
    response reference answer             (default "output")
    system   system prompt column         (default: none)
    history  list of [user, assistant] pairs (default: none)
    chosen / rejected   pairwise answers  (defaults "chosen" / "rejected")

A row becomes an :class:`Aligned` conversation, or a skip reason (a short string that the
closing summary counts).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from posttrain.errors import ConfigError

MAP_KEY_DEFAULTS: dict[str, str | None] = {"prompt": "instruction", "query": "input", "response": "output",
                                           "system": None, "history": None, "chosen": "chosen",
                                           "rejected": "rejected"}

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
    query = text(row.get(keys["query"])) if keys["query"] else ""
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
        return text(value[0]) if len(value) == 1 else ""  # several answers: invalid for one-answer data
    return text(value)


def align_alpaca(row: dict, keys: dict, extra_keys: list[str]) -> Aligned | str:
    prompt = _prompt_messages(row, keys, text(row.get(keys["prompt"])))
    if isinstance(prompt, str):
        return prompt
    response = _single_response(row.get(keys["response"])) if keys["response"] else ""
    if not response.strip():
        return SKIP_EMPTY_RESPONSE
    system = text(row.get(keys["system"])) if keys["system"] else ""
    return Aligned(prompt, [response], system, _extras(row, extra_keys))


def align_math17k(row: dict, keys: dict, extra_keys: list[str]) -> Aligned | str:
    """DAPO-Math-17k: ``prompt`` is a list of messages (first content used), ``reward_model`` a dict."""
    raw_prompt = row.get(keys["prompt"])
    if isinstance(raw_prompt, list):
        first = raw_prompt[0] if raw_prompt else {}
        raw_prompt = first.get("content", "") if isinstance(first, dict) else first
    prompt = _prompt_messages(row, keys, text(raw_prompt))
    if isinstance(prompt, str):
        return prompt
    raw = row.get(keys["response"]) if keys["response"] else None
    if isinstance(raw, dict):
        raw = raw.get("ground_truth", "")
    response = _single_response(raw)
    if not response.strip():
        return SKIP_EMPTY_RESPONSE
    system = text(row.get(keys["system"])) if keys["system"] else ""
    return Aligned(prompt, [response], system, _extras(row, extra_keys))


def _answer(value: Any) -> str:
    if isinstance(value, list) and value and isinstance(value[-1], dict):
        return text(value[-1].get("content"))  # a message list: the last (assistant) message
    return text(value)


def align_pairwise(row: dict, keys: dict, extra_keys: list[str]) -> Aligned | str:
    """Pairwise: ``chosen``/``rejected`` columns, or a ``response`` list ``[chosen, rejected]``."""
    prompt = _prompt_messages(row, keys, text(row.get(keys["prompt"])))
    if isinstance(prompt, str):
        return prompt
    if keys["chosen"] and keys["rejected"]:
        chosen, rejected = _answer(row.get(keys["chosen"])), _answer(row.get(keys["rejected"]))
    else:
        both = row.get(keys["response"]) if keys["response"] else None
        if not isinstance(both, list) or len(both) < 2:
            return SKIP_EMPTY_RESPONSE
        chosen, rejected = text(both[0]), text(both[1])
    if not chosen.strip() or not rejected.strip():
        return SKIP_EMPTY_RESPONSE
    system = text(row.get(keys["system"])) if keys["system"] else ""
    return Aligned(prompt, [chosen, rejected], system, _extras(row, extra_keys))
