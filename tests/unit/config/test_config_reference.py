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


# ---- the compatibility matrix: generated from posttrain.config.compat ------------------------------------
def _matrix_lines(text: str) -> dict[str, list[str]]:
    """The matrix of the doc: feature -> its cells (one per column after the feature)."""
    from posttrain.config.compat import FEATURES

    names = {f.describe() for f in FEATURES.values()}
    section = text.split("## Compatibility matrix", 1)[1].split("### Every row", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in section.splitlines()
            if line.startswith("| ")]
    return {cells[0]: cells[1:] for cells in rows if cells[0] in names}


def test_the_doc_has_the_compatibility_matrix_of_the_table():
    from posttrain.config.compat import FEATURES, ROWS
    from posttrain.config.reference import MATRIX_COLUMNS

    text = DOC_PATH.read_text(encoding="utf-8")
    lines = _matrix_lines(text)
    assert set(lines) == {FEATURES[row.feature].describe() for row in ROWS}  # one line per feature of a row
    columns = [f"{d}={v}" for d, v in MATRIX_COLUMNS]
    for name, cells in lines.items():
        assert len(cells) == len(columns) + 2, name
    assert "actor_config.lora_target_modules (set)" not in lines  # LoRA runs on both backends: no row refuses it
    threads = dict(zip(columns, lines["rl_config.num_threads (set)"]))
    assert (threads["placement=process"], threads["placement=ray-ddp"], threads["placement=ray-fsdp2"]) == (
        "", "refused", "refused")
    assert dict(zip(columns, lines["actor_config.bf16 (written as true)"]))["backend=megatron"] == \
        "no effect (device cpu)"
    for row in ROWS:  # every row, with its message
        assert f"| `{row.id}` |" in text


def test_the_matrix_follows_the_table(monkeypatch):
    """A row added to the table shows in the matrix: the doc is rendered from the data."""
    from posttrain.config import compat, reference

    extra = compat.Row("test-lora-ray-ddp", "lora", "{setting}: not with DDP", placement=("ray-ddp",), device=("cuda",))
    monkeypatch.setattr(compat, "ROWS", (*compat.ROWS, extra))
    monkeypatch.setattr(reference, "ROWS", compat.ROWS)
    columns = [f"{d}={v}" for d, v in reference.MATRIX_COLUMNS]
    cells = dict(zip(columns, _matrix_lines(reference.render_reference())["actor_config.lora_target_modules (set)"]))
    assert cells["placement=ray-ddp"] == "refused (device cuda)" and cells["placement=ray-fsdp2"] == ""
    assert "| `test-lora-ray-ddp` |" in reference.render_reference()
