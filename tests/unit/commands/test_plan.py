"""``posttrain plan`` (commands/plan.py): a bad ``--hf-config`` is named with the key at fault (the
reliability probe's case, docs/reliability.md)."""

from __future__ import annotations

import pytest

from tests.helpers.runs import run_cli, write_config


@pytest.mark.parametrize("text,why", [("{bad", "not valid JSON"),
                                      ('{"hidden_size": 8}', "missing key 'num_hidden_layers'"),
                                      ('{"num_hidden_layers": 2, "hidden_size": 8, "vocab_size": 8}',
                                       "missing key 'num_attention_heads'"),
                                      ("[1, 2]", "JSON object"),
                                      ('{"num_hidden_layers": 2, "hidden_size": 8, "vocab_size": 8, '
                                       '"num_attention_heads": 0}', "num_attention_heads must be a positive integer")],
                         ids=["malformed", "no_layers", "no_heads", "list", "zero_heads"])
def test_bad_hf_config_names_the_file_and_key(mini_world, tmp_path, capsys, text, why):
    """Probe X15: ``--hf-config`` malformed JSON, a list, a missing or zero key."""
    hf = tmp_path / "hf.json"
    hf.write_text(text)
    code, err = run_cli(["plan", *write_config(mini_world, tmp_path / "run"), "--hf-config", str(hf)], capsys)
    assert code == 2 and str(hf) in err and why in err
