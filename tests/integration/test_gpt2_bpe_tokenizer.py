"""``tokenizer_type: GPT2BPETokenizer`` (Megatron's GPT-2 BPE from vocab.json + merges.txt), against
a byte-level BPE trained locally by the ``tokenizers`` library:

* the built tokenizer gives the trained BPE's ids on every text, decodes them back, and ends and
  pads with ``<|endoftext|>``; bad files and key combinations are refused naming the key;
* ``posttrain preprocess`` with the files writes the same dataset as with the Hugging Face directory
  of that tokenizer, and a GRPO run with the files equals, metric for metric, the run that names that
  directory in ``tokenizer_name_or_path``.
"""

from __future__ import annotations

import filecmp
from pathlib import Path

import pytest

from posttrain.errors import ConfigError
from posttrain.data.tokenizer_files import EOD, TokenizerFiles, build_tokenizer, tokenizer_files
from tests.helpers.data import addition_rows, write_jsonl
from tests.helpers.runs import metrics_by_iteration
from tests.integration.test_grpo_loop import grpo_config

TEXTS = ["What is 12 + 30? The answer is 42.", "Question: 7 + 8 = ?\nAnswer: 15", "hello world, 2024 ünïcode"]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A byte-level BPE (vocab 400) trained on addition prompts; its vocab.json and merges.txt."""
    from tokenizers import ByteLevelBPETokenizer

    out = tmp_path_factory.mktemp("gpt2_bpe")
    trained = ByteLevelBPETokenizer()
    corpus = [f"{r['problem']} {r['answer']}" for r in addition_rows(300, 5)] + TEXTS
    trained.train_from_iterator(corpus, vocab_size=400, special_tokens=[EOD], show_progress=False)
    trained.save_model(str(out))
    return trained, TokenizerFiles("GPT2BPETokenizer", str(out / "vocab.json"), str(out / "merges.txt"))


def test_built_tokenizer_has_the_trained_bpe_ids(bpe):
    trained, files = bpe
    tok = build_tokenizer(files)
    for text in [*TEXTS, " leading space", "x" * 50]:
        assert tok(text)["input_ids"] == trained.encode(text).ids, text
        assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.eos_token == tok.pad_token == EOD and tok.eos_token_id == trained.token_to_id(EOD)


def test_bad_files_and_keys_are_refused(bpe, tmp_path):
    _, files = bpe
    with pytest.raises(ConfigError, match=r"^megatron_training\.tokenizer_type=GPT2BPETokenizer reads "
                                          r"megatron_training\.merge_file; set it"):
        tokenizer_files("GPT2BPETokenizer", files.vocab_file, None, "megatron_training.")
    with pytest.raises(ConfigError, match=r"^vocab_file=v\.json: it is read with tokenizer_type: GPT2BPETokenizer"):
        tokenizer_files("PretrainedFromHF", "v.json", None)
    with pytest.raises(ConfigError, match="merge_file=.*missing.txt: no such file"):
        build_tokenizer(TokenizerFiles("GPT2BPETokenizer", files.vocab_file, str(tmp_path / "missing.txt")))
    (tmp_path / "vocab.json").write_text('{"a": 0, "b": 1}')
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(ConfigError, match=r"has no <\|endoftext\|> token"):
        build_tokenizer(TokenizerFiles("GPT2BPETokenizer", str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")))
    with pytest.raises(ConfigError, match=r"vocab_file=.*merge_file=.*: not GPT-2 BPE files"):
        build_tokenizer(TokenizerFiles("GPT2BPETokenizer", str(tmp_path / "vocab.json"), files.merge_file))


def preprocess_rows(jsonl: Path, prefix: Path, **tokenizer) -> str:
    from posttrain.data.preprocess import preprocess

    preprocess({"input": str(jsonl), "handler_name": "R1AlpacaStyleInstructionHandler", "prompt_type": "default",
                "output_prefix": str(prefix), "map_keys": {"prompt": "problem", "response": "answer"},
                "dataset_additional_keys": ["labels"], **tokenizer}, progress=False)
    return str(prefix)


def test_grpo_with_the_bpe_files_equals_the_run_with_its_hf_directory(bpe, tmp_path):
    _, files = bpe
    assert files.paths() == {"vocab_file": files.vocab_file, "merge_file": files.merge_file}
    assert_files_run_like_the_hf_directory(build_tokenizer(files), "GPT2BPETokenizer", files.paths(), tmp_path)


def assert_files_run_like_the_hf_directory(tok, tokenizer_type: str, paths: dict[str, str], tmp_path: Path) -> None:
    """``preprocess`` with the tokenizer's files writes the same dataset as with its Hugging Face directory, and
    a GRPO iteration with the files equals, metric for metric, the one naming that directory."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from posttrain.commands.train import train_config as train

    hf_dir = tmp_path / "hf_tokenizer"
    tok.save_pretrained(str(hf_dir))
    model_dir = tmp_path / "model"
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                 tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id)).save_pretrained(str(model_dir))
    write_jsonl(tmp_path / "rows.jsonl", addition_rows(16, 1))
    from_files = preprocess_rows(tmp_path / "rows.jsonl", tmp_path / "files" / "data", tokenizer_type=tokenizer_type,
                                 **paths)
    preprocess_rows(tmp_path / "rows.jsonl", tmp_path / "dir" / "data", tokenizer_name_or_path=str(hf_dir))
    written = sorted(p.name for p in (tmp_path / "files").iterdir())
    assert written and written == sorted(p.name for p in (tmp_path / "dir").iterdir())
    for name in written:
        assert filecmp.cmp(tmp_path / "files" / name, tmp_path / "dir" / name, shallow=False), name
    runs = {"files": dict(megatron_training__tokenizer_type=tokenizer_type, megatron_training__tokenizer_name_or_path=None,
                          **{f"megatron_training__{key}": path for key, path in paths.items()}),
            "dir": dict(megatron_training__tokenizer_name_or_path=str(hf_dir))}
    for name, keys in runs.items():
        train(grpo_config(model_dir, from_files, tmp_path / name, actor_config__load=str(model_dir),
                          megatron_training__save=None, **keys))
    a, b = (metrics_by_iteration(tmp_path / name / "run")[1] for name in runs)
    assert (tmp_path / "files" / "run" / "tokenizer" / "tokenizer.json").is_file()
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean", "grpo/score/mean"):
        assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key
