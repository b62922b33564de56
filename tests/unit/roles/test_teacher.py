"""On-policy distillation's teacher (posttrain.roles.policy.build_teacher): it must share the actor's
vocabulary (the same output size, and the same tokenizer where its directory has one), and a missing
path names the key."""

from __future__ import annotations

import pytest

from posttrain.errors import ConfigError
from posttrain.roles.policy import check_teacher_vocab


def qwen2(vocab: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))


def test_a_teacher_with_another_vocabulary_is_refused_naming_the_key(tmp_path, tiny_tokenizer):
    vocab = len(tiny_tokenizer) + 8
    actor = qwen2(vocab)
    with pytest.raises(ConfigError, match=r"rl_config.teacher_model: .* vocabulary of .* the actor's tokenizer"):
        check_teacher_vocab(qwen2(vocab + 1), actor, tiny_tokenizer, str(tmp_path))
    teacher = qwen2(vocab)
    teacher.save_pretrained(tmp_path / "same")
    tiny_tokenizer.save_pretrained(tmp_path / "same")
    check_teacher_vocab(teacher, actor, tiny_tokenizer, str(tmp_path / "same"))  # the same vocabulary passes
    other = type(tiny_tokenizer).from_pretrained(str(tmp_path / "same"))
    other.add_tokens(["<only_in_the_teacher>"])
    teacher.save_pretrained(tmp_path / "other")
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(ConfigError, match=r"rl_config.teacher_model: the tokenizer in .* differs from the actor's"):
        check_teacher_vocab(teacher, actor, tiny_tokenizer, str(tmp_path / "other"))


def test_a_missing_teacher_names_the_key(tmp_path):
    from types import SimpleNamespace

    from posttrain.config.distill import DistillOptions
    from posttrain.roles.policy import build_teacher

    plan = SimpleNamespace(distill=DistillOptions(teacher=str(tmp_path / "nowhere")))
    with pytest.raises(ConfigError, match=r"rl_config.teacher_model: .*nowhere does not exist"):
        build_teacher(plan, "cpu", None, None)
