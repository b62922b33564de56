"""A checkpoint's model card (posttrain.checkpoint.card): what it says (a run writing it into its
checkpoints: tests/integration/test_grpo_loop.py)."""

from __future__ import annotations


from posttrain.checkpoint.card import CardInfo, render_card, write_model_card


def test_the_card_names_the_base_model_algorithm_data_config_metrics_and_command(tmp_path):
    info = CardInfo(algorithm="grpo", base_model="models/tiny", data="data/rl", config_json='{"a": 1}',
                    iteration=7, metrics={"grpo/score/mean": 0.5, "actor/lr": 1e-5}, command="posttrain train x")
    text = render_card(info)
    assert text.startswith("---\nbase_model: \"models/tiny\"\nlibrary_name: transformers\n")
    for needle in ("iteration 7", "`data/rl`", "`posttrain train x`", "| `grpo/score/mean` | 0.5 |", info.config_digest):
        assert needle in text, needle
    assert text.index("grpo/score/mean") < text.index("actor/lr")  # the headline metric first
    other = CardInfo(**{**info.__dict__, "config_json": '{"a": 2}'})
    assert other.config_digest != info.config_digest
    assert "library_name: peft" in render_card(CardInfo(**{**info.__dict__, "adapter": True}))
    path = write_model_card(tmp_path, info)
    assert path.read_text() == text and not list(tmp_path.glob(".*tmp*"))
