"""Golden renderings of the shipped chat templates (texts from the seed's templates.json)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from posttrain.data.encoding import TemplateEncoder, eos_token_id, stop_token_ids
from posttrain.data.templates import get_template, load_templates
from posttrain.errors import ConfigError

R1 = ("A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
      "The assistant first thinks about the reasoning process in the mind and then provides the user with the "
      "answer. The reasoning process and answer are enclosed within <think> </think> and <answer> </answer> tags, "
      "respectively, i.e., <think> reasoning process here </think><answer> answer here </answer>. "
      "Put your final answer within \\boxed{}.")
SYS = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
TOK = SimpleNamespace(bos_token="<BOS>", eos_token="<EOS>")
Q = "What is 2+3?"

GOLDEN_PROMPTS = {
    "empty": Q,
    "default": f"Human: {Q}\nAssistant:",
    "qwen": f"{SYS}<|im_start|>user\n{Q}<|im_end|>\n<|im_start|>assistant\n",
    "qwen_r1": f"{SYS}<|im_start|>user\n{R1}\n{Q}<|im_end|>\n<|im_start|>assistant\n",
    "qwen_math_r1": ("<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}."
                     f"<|im_end|>\n<|im_start|>user\n{Q}<|im_end|>\n<|im_start|>assistant\n"),
    "qwen3": f"<|im_start|>user\n{Q}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "llama3": (f"<BOS><|start_header_id|>user<|end_header_id|>\n\n{Q}<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "alpaca": ("Below is an instruction that describes a task. Write a response that appropriately completes the "
               f"request.\n\n### Instruction:\n{Q}\n\n### Response:\n"),
    "deepseek3": f"<BOS><｜User｜>{Q}<｜Assistant｜>",
    "deepseek3_r1": f"<BOS>{R1} <｜User｜>{Q}<｜Assistant｜>",
}


@pytest.mark.parametrize("name", sorted(GOLDEN_PROMPTS))
def test_golden_prompt(name):
    assert get_template(name).render_prompt(Q, tokenizer=TOK) == GOLDEN_PROMPTS[name]


def test_every_shipped_template_loads_and_renders():
    names = sorted(load_templates())
    for required in GOLDEN_PROMPTS:
        assert required in names
    for name in names:
        assert Q in get_template(name).render_prompt(Q, tokenizer=TOK)


def test_system_prompt_and_multiturn_qwen():
    t = get_template("qwen")
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    assert t.render_conversation(msgs, system="S") == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>"
        "\n<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\nd<|im_end|>")
    # prompt of the same conversation without its last answer: history answers kept
    assert t.render_prompt(msgs[:3], system="S").endswith("b<|im_end|>\n<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n")


def test_default_template_eos_is_tokenizer_eos_without_replace_eos():
    t = get_template("default")
    text = t.render_conversation([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], tokenizer=TOK)
    assert text == "Human: x\nAssistant:y<EOS>"


def test_qwen3_thinking_modes():
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>why</think>\n\nA"}]
    off = get_template("qwen3", enable_thinking=False).render_conversation(msgs)
    assert off == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nA<|im_end|>\n"
    on = get_template("qwen3", enable_thinking=True)
    assert on.render_conversation(msgs).endswith("assistant\n<think>why</think>\n\nA<|im_end|>\n")
    # no thought in the answer: the empty one goes on the answer side (trained on)
    pairs = on.pair_elements([{"role": "user", "content": "q"}, {"role": "assistant", "content": "A"}])
    assert on.to_text(pairs[-1][1]).startswith("<think>\n\n</think>\n\n")
    assert not on.to_text(pairs[-1][0]).endswith("</think>\n\n")


def test_stop_words():
    assert get_template("qwen_r1").get_stop_words() == ["<|im_end|>"]
    assert get_template("llama3").get_stop_words() == ["<|eot_id|>"]
    assert get_template("empty").get_stop_words(TOK) == ["<EOS>"]


def test_unknown_template_lists_known():
    with pytest.raises(ConfigError) as err:
        get_template("qwen_r2")
    assert "qwen_r1" in str(err.value) and "hf_chat_template" in str(err.value)


def test_user_template_file(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps([{"name": "mine", "format_user": {"slots": ["<<{{content}}>>"]},
                                 "default_system": "SYS|", "stop_words": ["<|im_end|>"]}]))
    t = get_template("mine", path)
    assert t.render_prompt("hi") == "SYS|<<hi>>"
    assert get_template("qwen", path).name == "qwen"  # shipped templates still there
    bad = tmp_path / "bad.json"
    bad.write_text("[{\"name\": ")
    with pytest.raises(ConfigError, match="bad.json: malformed JSON at line 1"):
        get_template("mine", bad)


def test_encoding_matches_text_and_special_ids(tok_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    t = get_template("qwen_r1")
    enc = TemplateEncoder(t, tok)
    ids = enc.encode_prompt(Q)
    assert tok.decode(ids) == t.render_prompt(Q)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert eos_token_id(t, tok) == im_end and stop_token_ids(t, tok) == [im_end]
    # the answer ends with the replaced eos (<|im_end|>)
    (src, tgt), = enc.encode_pairs_batch([([{"role": "user", "content": Q}, {"role": "assistant", "content": "5"}], None)])[0]
    assert src == ids and tgt[-1] == im_end and tok.decode(tgt) == "5<|im_end|>"


def test_hf_chat_template(tok_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    t = get_template("hf_chat_template")
    msgs = [{"role": "user", "content": "a"}]
    assert t.render_prompt(msgs, system="S", tokenizer=tok) == tok.apply_chat_template(
        [{"role": "system", "content": "S"}, *msgs], tokenize=False, add_generation_prompt=True)
    (src, tgt), = TemplateEncoder(t, tok).encode_pairs_batch([([*msgs, {"role": "assistant", "content": "b"}], None)])[0]
    assert tok.decode(src) == "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tgt) == "b<|im_end|>\n"
    assert t.get_stop_words(tok) == ["<|im_end|>"]
