"""Megatron's file-based tokenizers (``tokenizer_type``) as Hugging Face fast tokenizers.

* ``PretrainedFromHF`` / ``HuggingFaceTokenizer`` (or unset): a Hugging Face tokenizer directory
  (``tokenizer_name_or_path``, else the model's);
* ``GPT2BPETokenizer``: GPT-2's byte-level BPE from ``vocab_file`` (vocab.json) and ``merge_file``
  (merges.txt), as Megatron builds it: GPT-2's pre-tokenizing regex, no prefix space, and
  ``<|endoftext|>`` as the end-of-document (eos) token, which also pads. It is transformers'
  ``GPT2TokenizerFast`` (the ``tokenizers`` library's BPE), the same ids as Megatron's GPT-2
  tokenizer.

``SentencePieceTokenizer`` (a ``.model`` file) needs the ``sentencepiece`` package, which this
build does not install: it is refused by the config check.

A run writes the built tokenizer once into ``<run dir>/tokenizer`` (:func:`write_tokenizer_dir`),
a Hugging Face directory that every process of the run and every checkpoint then read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from posttrain.errors import ConfigError

HF_TYPES = (None, "PretrainedFromHF", "HuggingFaceTokenizer")
FILE_TYPES = ("GPT2BPETokenizer",)
EOD = "<|endoftext|>"


@dataclass(frozen=True)
class TokenizerFiles:
    """A tokenizer built from files: its Megatron ``tokenizer_type`` and the files it reads."""

    tokenizer_type: str
    vocab_file: str
    merge_file: str


def tokenizer_files(tokenizer_type: str | None, vocab_file: str | None, merge_file: str | None,
                    where: str = "") -> TokenizerFiles | None:
    """The files of a file-based ``tokenizer_type`` (None for a Hugging Face one); ``where`` prefixes
    the key names in messages (``megatron_training.``)."""
    if tokenizer_type in HF_TYPES:
        for key, value in (("vocab_file", vocab_file), ("merge_file", merge_file)):
            if value:
                raise ConfigError(f"{where}{key}={value}: it is read with {where}tokenizer_type: GPT2BPETokenizer "
                                  f"only (the tokenizer is a Hugging Face one here); remove it, or set tokenizer_type")
        return None
    if tokenizer_type not in FILE_TYPES:
        raise ConfigError(f"{where}tokenizer_type={tokenizer_type}: posttrain builds PretrainedFromHF "
                          f"(HuggingFaceTokenizer) and GPT2BPETokenizer (SentencePieceTokenizer needs the "
                          f"sentencepiece package, which this build does not install); set one of them")
    for key, value in (("vocab_file", vocab_file), ("merge_file", merge_file)):
        if not value:
            raise ConfigError(f"{where}tokenizer_type={tokenizer_type} reads {where}{key}; set it (GPT-2's "
                              f"{'vocab.json' if key == 'vocab_file' else 'merges.txt'})")
    return TokenizerFiles(tokenizer_type, str(vocab_file), str(merge_file))


def build_tokenizer(files: TokenizerFiles, where: str = ""):
    """The Hugging Face fast tokenizer of ``files`` (module docstring)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    for key, value in (("vocab_file", files.vocab_file), ("merge_file", files.merge_file)):
        if not Path(value).is_file():
            raise ConfigError(f"{where}{key}={value}: no such file")
    try:
        bpe = Tokenizer(BPE.from_file(files.vocab_file, files.merge_file))
    except Exception as err:  # noqa: BLE001 (json / merges parse errors of several types)
        raise ConfigError(f"{where}vocab_file={files.vocab_file}, merge_file={files.merge_file}: not GPT-2 BPE "
                          f"files ({type(err).__name__}: {err})") from None
    if bpe.token_to_id(EOD) is None:
        raise ConfigError(f"{where}vocab_file={files.vocab_file} has no {EOD} token (GPT-2's end of document, "
                          f"which ends and pads every sequence); add it to the vocabulary")
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's regex
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    bpe.add_special_tokens([EOD])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=EOD, eos_token=EOD, unk_token=EOD, pad_token=EOD)


def write_tokenizer_dir(files: TokenizerFiles, out: str | Path, where: str = "") -> Path:
    """Build the tokenizer of ``files`` and save it as a Hugging Face directory ``out`` (written to a
    temporary directory, then renamed: never half-written)."""
    import shutil
    import tempfile

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=out.parent))
    try:
        build_tokenizer(files, where).save_pretrained(str(tmp))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
