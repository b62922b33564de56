"""What docs/config_reference.md says about keys that nothing reads is true of the code.

The reference lists the architecture keys marked honoured that neither ``posttrain plan`` nor
``posttrain init-model`` reads (``posttrain.config.reference.ARCH_NOT_READ``). Changing one of them
must change nothing those commands build; when a key starts to be read, this test fails and the
list (and the doc generated from it) must lose the key."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

from posttrain.config.fields import Status, field_rule
from posttrain.config.megatron import MegatronConfig
from posttrain.config.reference import ARCH_NOT_READ, RULE_ONLY, render_reference
from posttrain.models.arch import arch_from_model_yaml

SRC = Path(__file__).resolve().parents[3] / "src" / "posttrain"
# the rest of what plan's memory estimate and init-model's model are built from (models/arch.py, which
# also reads Hugging Face configs, is checked by its behaviour)
READERS = ("models/init_model.py", "config/arch.py", "config/memory.py", "config/plan.py")
BASE = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4,
        "group_query_attention": True, "num_query_groups": 2, "add_qkv_bias": True, "padded_vocab_size": 256}


def _other_value(name: str):
    """A value of the key's type that differs from its default."""
    annotation = MegatronConfig.model_fields[name].annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    kind = args[0]
    if kind is bool:
        return not MegatronConfig.model_fields[name].default
    if kind is int:
        return 7
    if kind is float:
        return 3.5
    return "yarn"


@pytest.mark.parametrize("name", ARCH_NOT_READ)
def test_a_key_listed_as_not_read_is_an_honoured_megatron_key(name):
    assert name in MegatronConfig.model_fields
    assert field_rule(MegatronConfig, name).status is Status.HONOURED


@pytest.mark.parametrize("name", ARCH_NOT_READ)
def test_plan_and_init_model_build_the_same_model_whatever_the_key_says(name):
    assert arch_from_model_yaml("m", {**BASE, name: _other_value(name)}) == arch_from_model_yaml("m", BASE)
    for reader in READERS:
        assert name not in (SRC / reader).read_text(encoding="utf-8"), f"{reader} names {name}: is it read now?"


def test_the_reference_lists_them_and_marks_their_rows():
    text = render_reference()
    assert "Keys that nothing reads yet" in text
    for name in (*ARCH_NOT_READ, *RULE_ONLY):
        row = next(line for line in text.splitlines() if line.startswith(f"| `{name}` |"))
        assert "Nothing reads it yet" in row or "changes nothing that runs" in row, row
