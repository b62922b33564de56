"""``tokenizer_type: SentencePieceTokenizer`` (Megatron's SentencePiece model, ``tokenizer_model``):

* a unigram model written here piece by piece gives the segmentation worked out by hand (the
  highest-scoring split, SentencePiece's Viterbi), with the model's normaliser (dummy prefix, extra
  spaces removed, spaces as ``▁``); bos / eos / unk / pad come from the model's trainer ids;
* where the ``sentencepiece`` package is installed (the dev extra), models it trains (BPE, unigram,
  byte fallback) give ``SentencePieceProcessor.encode``'s ids on every text;
* bad files and key combinations are refused naming the key; ``posttrain preprocess`` and a GRPO
  iteration with the model file equal those naming its Hugging Face directory.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from posttrain.data.tokenizer_files import TokenizerFiles, build_tokenizer, tokenizer_files
from posttrain.errors import ConfigError
from tests.helpers.data import addition_rows
from tests.integration.test_gpt2_bpe_tokenizer import assert_files_run_like_the_hf_directory

WORDS = {"▁What": -1.0, "▁is": -1.0, "▁the": -1.5, "▁answer": -2.0, "▁": -3.0}


def write_unigram_model(path: Path, chars: str) -> Path:
    """A SentencePiece unigram model: <unk> <s> </s>, the ``WORDS`` and every character of ``chars``
    (score -10 each), SentencePiece's default normaliser flags without a character map."""
    from transformers.utils import sentencepiece_model_pb2_new as schema

    proto = schema.ModelProto()
    for piece, kind in (("<unk>", 2), ("<s>", 3), ("</s>", 3)):  # UNKNOWN, CONTROL
        proto.pieces.add(piece=piece, score=0.0, type=kind)
    for piece, score in {**WORDS, **{c: -10.0 for c in sorted(set(chars) - {" "})}}.items():
        proto.pieces.add(piece=piece, score=score, type=1)  # NORMAL
    proto.trainer_spec.model_type = proto.trainer_spec.UNIGRAM
    proto.trainer_spec.unk_id, proto.trainer_spec.bos_id, proto.trainer_spec.eos_id = 0, 1, 2
    proto.trainer_spec.pad_id = -1
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = True
    proto.normalizer_spec.remove_extra_whitespaces = True
    proto.normalizer_spec.escape_whitespaces = True
    path.write_bytes(proto.SerializeToString())
    return path


@pytest.fixture(scope="module")
def unigram(tmp_path_factory) -> TokenizerFiles:
    corpus = "".join(f"{r['problem']} {r['answer']}" for r in addition_rows(300, 5)) + "What is the answer?"
    path = write_unigram_model(tmp_path_factory.mktemp("spm") / "unigram.model", corpus)
    return tokenizer_files("SentencePieceTokenizer", tokenizer_model=str(path))


def test_a_hand_written_unigram_model_segments_as_worked_out_by_hand(unigram):
    tok = build_tokenizer(unigram)
    ids = {tok.convert_ids_to_tokens(i): i for i in range(len(tok))}
    # "▁What▁is▁the▁answer" in words (-5.5) beats any split with characters (-10 each)
    assert tok("What is  the answer", add_special_tokens=False).input_ids == [
        ids["▁What"], ids["▁is"], ids["▁the"], ids["▁answer"]]
    # "▁7" has no piece: "▁" (-3) and "7" (-10); "?" stays a character
    assert tok("7?", add_special_tokens=False).input_ids == [ids["▁"], ids["7"], ids["?"]]
    assert tok("~", add_special_tokens=False).input_ids == [ids["▁"], 0]  # no piece for "~": <unk> (id 0)
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2, 2)  # no pad: eos
    assert tok.decode(tok("What is the answer 42?").input_ids, skip_special_tokens=True) == "What is the answer 42?"


@pytest.mark.parametrize("model_type, byte_fallback", [("bpe", False), ("unigram", False), ("bpe", True)])
def test_models_sentencepiece_trains_give_its_ids(tmp_path, model_type, byte_fallback):
    spm = pytest.importorskip("sentencepiece", reason="the reference needs the sentencepiece package (dev extra)")
    rng = random.Random(0)
    corpus = [f"{r['problem']} {r['answer']} " + " ".join(rng.choice(["alpha", "beta", "sum", "of"]) for _ in range(4))
              for r in addition_rows(400, 3)]
    (tmp_path / "corpus.txt").write_text("\n".join(corpus), encoding="utf-8")
    prefix = str(tmp_path / model_type)
    spm.SentencePieceTrainer.train(input=str(tmp_path / "corpus.txt"), model_prefix=prefix, model_type=model_type,
                                   vocab_size=300 if byte_fallback else 40, byte_fallback=byte_fallback,
                                   unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    reference = spm.SentencePieceProcessor(model_file=prefix + ".model")
    tok = build_tokenizer(tokenizer_files("SentencePieceTokenizer", tokenizer_model=prefix + ".model"))
    for text in [*corpus[:20], "What is  12 + 30?\nAnswer: 42", " leading space", "ünïcode ~ 😀", ""]:
        assert tok(text, add_special_tokens=False).input_ids == reference.encode(text), text


def test_bad_files_and_keys_are_refused(unigram, tmp_path):
    with pytest.raises(ConfigError, match=r"^megatron_training\.tokenizer_type=SentencePieceTokenizer reads "
                                          r"megatron_training\.tokenizer_model; set it \(a SentencePiece \.model"):
        tokenizer_files("SentencePieceTokenizer", where="megatron_training.")
    with pytest.raises(ConfigError, match=r"^vocab_file=v\.json: it is read with tokenizer_type: GPT2BPETokenizer "
                                          r"only \(the tokenizer is SentencePieceTokenizer here\)"):
        tokenizer_files("SentencePieceTokenizer", "v.json", tokenizer_model=unigram.tokenizer_model)
    with pytest.raises(ConfigError, match=r"^tokenizer_model=m\.model: it is read with tokenizer_type: "
                                          r"SentencePieceTokenizer only"):
        tokenizer_files(None, tokenizer_model="m.model")
    with pytest.raises(ConfigError, match="tokenizer_model=.*missing.model: no such file"):
        build_tokenizer(TokenizerFiles("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "missing.model")))
    (tmp_path / "bad.model").write_bytes(b"\xff\x00 not a model")
    with pytest.raises(ConfigError, match=r"tokenizer_model=.*bad.model: not a SentencePiece"):
        build_tokenizer(TokenizerFiles("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "bad.model")))


def test_grpo_with_the_model_file_equals_the_run_with_its_hf_directory(unigram, tmp_path):
    assert unigram.paths() == {"tokenizer_model": unigram.tokenizer_model}  # megatron_training.tokenizer_model
    assert_files_run_like_the_hf_directory(build_tokenizer(unigram), "SentencePieceTokenizer", unigram.paths(), tmp_path)
