"""No silent key (issue 40 item 1): every key that docs/config_reference.md marks honoured changes
something observable.

* an architecture key: the model built (tests/unit/docs/test_reference_claims.py);
* every other honoured key: the plan (:class:`posttrain.config.plan.Plan`, every derived value a run
  reads) of a shipped tiny config, with the context the key needs
  (tests/unit/docs/honoured_observers.py), or, for what a plan does not carry (a tokenizer, a logger,
  the Ray cluster's environment...), a named test that reads the key's effect.

A new honoured key without an observer fails :func:`test_every_honoured_key_has_an_observer`."""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

import pytest

from posttrain.config.fields import ARCH_WHY, Status, field_rule
from posttrain.config.plan import resolve_plan
from posttrain.config.reference import SECTIONS
from posttrain.config.run import load_run_config
from posttrain.errors import ConfigError
from tests.unit.docs.honoured_observers import (BASE, ELSEWHERE, OBSERVERS, SECTION_OF, current_value, flat,
                                                other_values)

ROOT = Path(__file__).resolve().parents[3]


def honoured_keys() -> dict[str, tuple[type, str]]:
    """``section.key`` -> (its schema class, its name) for every honoured key but the architecture's."""
    keys = {}
    for _, cls, _ in SECTIONS:
        section = SECTION_OF.get(cls.__name__)
        for name in cls.model_fields:
            rule = field_rule(cls, name)
            if rule.status is Status.HONOURED and rule.why != ARCH_WHY:
                assert section is not None, f"{cls.__name__}.{name}: honoured in a section without observers"
                keys[f"{section}.{name}"] = (cls, name)
    return keys


@lru_cache(maxsize=None)
def plan_values(config: str, overrides: tuple[str, ...]) -> dict[str, str]:
    return flat(resolve_plan(load_run_config(config, None, list(overrides))))


@lru_cache(maxsize=None)
def functions_of(path: str) -> dict[str, str]:
    """The source of each function of the test file ``path``."""
    source = (ROOT / path).read_text(encoding="utf-8")
    return {node.name: ast.get_source_segment(source, node) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.FunctionDef)}


def test_every_honoured_key_has_an_observer():
    keys = honoured_keys()
    assert len(keys) > 150, len(keys)
    assert not set(OBSERVERS) & set(ELSEWHERE)
    stale = sorted((set(OBSERVERS) | set(ELSEWHERE)) - set(keys))
    assert not stale, f"observers of keys that are not honoured (or not keys): {stale}"


@pytest.mark.parametrize("key", sorted(k for k in honoured_keys() if k not in ELSEWHERE))
def test_changing_an_honoured_key_changes_the_plan(key):
    cls, name = honoured_keys()[key]
    config, context, change = OBSERVERS.get(key, (BASE, [], []))
    changes = [change]
    if not change:  # the values of the key's type other than the config's, the first the config check accepts
        current = current_value(load_run_config(config, None, list(context)), key.rsplit(".", 1)[0], name)
        changes = [[f"{key}={value}"] for value in other_values(cls, name, current)]
    before = plan_values(config, tuple(context))
    for change in changes:
        try:
            after = plan_values(config, (*context, *change))
        except ConfigError:
            continue
        assert after != before, f"{key}: {change} on {config} changed nothing in the plan"
        return
    pytest.fail(f"{key}: no change the config check accepts ({changes}); give OBSERVERS an entry")


@pytest.mark.parametrize("key", sorted(ELSEWHERE))
def test_a_key_the_plan_does_not_carry_is_observed_by_a_named_test(key):
    path, test = ELSEWHERE[key].split("::")
    functions = functions_of(path)
    assert test in functions, f"{ELSEWHERE[key]}: no such test"
    assert key.rsplit(".", 1)[1] in functions[test], f"{ELSEWHERE[key]} does not name {key}"
