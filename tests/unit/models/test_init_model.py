"""`posttrain init-model`: a random-init HF model directory with a local tokenizer."""

from __future__ import annotations

import json

import pytest


def test_tiny_model_dir(tiny_model_dir, tiny_tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen2"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["intermediate_size"]) == (384, 6, 6, 2, 1024)
    assert (tiny_model_dir / "model.safetensors").is_file()
    assert cfg["vocab_size"] == len(tiny_tokenizer) == 300
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    n = sum(p.numel() for p in model.parameters())
    assert 9.0e6 < n < 10.5e6
    ids = torch.tensor([tiny_tokenizer("What is 1 + 2?").input_ids])
    assert model(ids).logits.shape == (1, ids.shape[1], cfg["vocab_size"])


def test_tokenizer_chat_tokens_and_template(tiny_tokenizer):
    for tok in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert tiny_tokenizer.convert_tokens_to_ids(tok) is not None
        assert len(tiny_tokenizer(tok, add_special_tokens=False).input_ids) == 1
    assert tiny_tokenizer.eos_token == "<|im_end|>" and tiny_tokenizer.pad_token == "<|endoftext|>"
    text = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                              add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tiny_tokenizer("What is 12 + 7?").input_ids
    assert tiny_tokenizer.decode(ids) == "What is 12 + 7?"


def test_same_seed_same_weights(tmp_path):
    import torch
    from safetensors.torch import load_file

    from posttrain.commands.init_model import init_model

    a = init_model("tiny_qwen2", tmp_path / "a", seed=7)
    b = init_model("tiny_qwen2", tmp_path / "b", seed=7)
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_cli_init_model(tmp_path, capsys):
    from posttrain.cli import main

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"{i} plus {i} is {2 * i}" for i in range(200)))
    assert main(["init-model", "--model", "tiny_qwen2", "--output", str(tmp_path / "m"),
                 "--corpus", str(corpus), "--vocab-size", "280"]) == 0
    assert "Qwen2ForCausalLM" in capsys.readouterr().out
    assert json.loads((tmp_path / "m" / "config.json").read_text())["vocab_size"] == 280
    assert main(["init-model", "--output", str(tmp_path / "x"), "--corpus", str(tmp_path / "nope.txt")]) == 2


@pytest.mark.parametrize("name", ["qwen25_7b", "qwen3_8b", "smollm2_135m"])
def test_arch_param_counts(name):
    from posttrain.config.loader import load_model_yaml
    from posttrain.models.arch import arch_from_model_yaml

    expected = {"qwen25_7b": 7.62e9, "qwen3_8b": 8.19e9, "smollm2_135m": 1.35e8}[name]
    _, keys = load_model_yaml(name)
    assert arch_from_model_yaml(name, keys).num_params() == pytest.approx(expected, rel=0.01)
