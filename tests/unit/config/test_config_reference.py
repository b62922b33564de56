"""Every schema key has a status, and docs/config_reference.md is the generated table of them."""

from __future__ import annotations

import pytest

from posttrain.config.fields import Rule, Status, field_rule
from posttrain.config.reference import DOC_PATH, REGENERATE, SECTIONS, render_reference


@pytest.mark.parametrize("cls", [cls for _, cls, _ in SECTIONS], ids=[cls.__name__ for _, cls, _ in SECTIONS])
def test_every_field_has_a_status(cls):
    missing = [name for name in cls.model_fields if field_rule(cls, name) is None]
    assert not missing, f"{cls.__name__}: fields without a status (give F(...) a Rule): {missing}"
    for name in cls.model_fields:
        rule = field_rule(cls, name)
        assert isinstance(rule, Rule) and isinstance(rule.status, Status)
        if rule.status is not Status.HONOURED:
            assert rule.why, f"{cls.__name__}.{name}: a {rule.status.value} key needs its reason"
        if rule.switch is not None:
            assert rule.switch in cls.model_fields, f"{cls.__name__}.{name}: unknown switch {rule.switch}"


def test_the_reference_covers_every_section_class():
    from posttrain.config.megatron import MegatronConfig
    from posttrain.config.sections import (GenerateConfig, MsprobeConfig, ProfilerConfig, Resource, RLConfig,
                                           SamplingConfig)

    classes = {cls for _, cls, _ in SECTIONS}
    assert classes == {MegatronConfig, RLConfig, Resource, GenerateConfig, SamplingConfig, ProfilerConfig,
                       MsprobeConfig}


def test_reference_doc_is_up_to_date():
    expected = render_reference()
    actual = DOC_PATH.read_text(encoding="utf-8") if DOC_PATH.is_file() else ""
    assert actual == expected, f"{DOC_PATH} is stale: regenerate it with `{REGENERATE}`"


def test_reference_explains_the_three_statuses_and_lists_every_key():
    text = render_reference()
    for status in Status:
        assert f"**{status.value}**" in text
    for _, cls, _ in SECTIONS:
        for name in cls.model_fields:
            assert f"| `{name}` |" in text
