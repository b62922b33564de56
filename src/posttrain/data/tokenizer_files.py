"""Megatron's file-based tokenizers (``tokenizer_type``) as Hugging Face fast tokenizers.

* ``PretrainedFromHF`` / ``HuggingFaceTokenizer`` (or unset): a Hugging Face tokenizer directory
  (``tokenizer_name_or_path``, else the model's);
* ``GPT2BPETokenizer``: GPT-2's byte-level BPE from ``vocab_file`` (vocab.json) and ``merge_file``
  (merges.txt), as Megatron builds it: GPT-2's pre-tokenizing regex, no prefix space, and
  ``<|endoftext|>`` as the end-of-document (eos) token, which also pads. It is the ``tokenizers``
  library's BPE, the same ids as Megatron's GPT-2 tokenizer.
* ``SentencePieceTokenizer``: a SentencePiece model (``tokenizer_model``, a ``.model`` file, BPE or
  unigram), converted to the ``tokenizers`` library by transformers' SentencePiece converter, which
  follows the model's own normalizer (dummy prefix, whitespace escaping, byte fallback): the same
  ids as ``sentencepiece.SentencePieceProcessor.encode``. The model's ``<s>`` / ``</s>`` / ``<unk>``
  (its trainer's ids) are bos / eos / unk; eos ends each document (Megatron's ``eod``) and pads when
  the model has no pad piece. The file is read with transformers' own protobuf schema, so the
  ``sentencepiece`` package is not needed.

A run writes the built tokenizer once into ``<run dir>/tokenizer`` (:func:`write_tokenizer_dir`),
a Hugging Face directory that every process of the run and every checkpoint then read.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from posttrain.errors import ConfigError

HF_TYPES = (None, "PretrainedFromHF", "HuggingFaceTokenizer")
FILE_KEYS = {"GPT2BPETokenizer": ("vocab_file", "merge_file"), "SentencePieceTokenizer": ("tokenizer_model",)}
FILE_TYPES = tuple(FILE_KEYS)
WHAT = {"vocab_file": "GPT-2's vocab.json", "merge_file": "GPT-2's merges.txt",
        "tokenizer_model": "a SentencePiece .model file"}
EOD = "<|endoftext|>"


@dataclass(frozen=True)
class TokenizerFiles:
    """A tokenizer built from files: its Megatron ``tokenizer_type`` and the files it reads."""

    tokenizer_type: str
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None

    def paths(self) -> dict[str, str]:
        """The files this type reads, by key."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in FILE_KEYS[self.tokenizer_type]}


def tokenizer_files(tokenizer_type: str | None, vocab_file: str | None = None, merge_file: str | None = None,
                    where: str = "", tokenizer_model: str | None = None) -> TokenizerFiles | None:
    """The files of a file-based ``tokenizer_type`` (None for a Hugging Face one); ``where`` prefixes
    the key names in messages (``megatron_training.``)."""
    given = {"vocab_file": vocab_file, "merge_file": merge_file, "tokenizer_model": tokenizer_model}
    if tokenizer_type not in HF_TYPES and tokenizer_type not in FILE_TYPES:
        raise ConfigError(f"{where}tokenizer_type={tokenizer_type}: posttrain builds PretrainedFromHF "
                          f"(HuggingFaceTokenizer), GPT2BPETokenizer and SentencePieceTokenizer; set one of them")
    wanted = FILE_KEYS.get(tokenizer_type, ())
    for key, value in given.items():
        if value and key not in wanted:
            readers = [t for t, keys in FILE_KEYS.items() if key in keys]
            raise ConfigError(f"{where}{key}={value}: it is read with {where}tokenizer_type: {readers[0]} only "
                              f"(the tokenizer is {tokenizer_type or 'a Hugging Face one'} here); remove it, or set "
                              f"tokenizer_type")
    if tokenizer_type in HF_TYPES:
        return None
    for key in wanted:
        if not given[key]:
            raise ConfigError(f"{where}tokenizer_type={tokenizer_type} reads {where}{key}; set it ({WHAT[key]})")
    return TokenizerFiles(tokenizer_type, **{key: str(given[key]) for key in wanted})


def build_tokenizer(files: TokenizerFiles, where: str = ""):
    """The Hugging Face fast tokenizer of ``files`` (module docstring)."""
    for key, value in files.paths().items():
        if not Path(value).is_file():
            raise ConfigError(f"{where}{key}={value}: no such file")
    if files.tokenizer_type == "SentencePieceTokenizer":
        return _sentencepiece(files.tokenizer_model, where)
    return _gpt2_bpe(files, where)


def _gpt2_bpe(files: TokenizerFiles, where: str):
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

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


def _sentencepiece(model_file: str, where: str):
    import inspect

    from google.protobuf.message import DecodeError
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SpmConverter
    from transformers.utils import sentencepiece_model_pb2_new as spm_schema

    proto = spm_schema.ModelProto()
    try:
        proto.ParseFromString(Path(model_file).read_bytes())
    except DecodeError as err:
        raise ConfigError(f"{where}tokenizer_model={model_file}: not a SentencePiece model ({err})") from None
    spec = proto.trainer_spec
    if not proto.pieces or spec.model_type not in (spec.UNIGRAM, spec.BPE):
        raise ConfigError(f"{where}tokenizer_model={model_file}: not a SentencePiece BPE or unigram model "
                          f"({len(proto.pieces)} pieces, model type {spec.model_type})")
    if "legacy" not in inspect.signature(SpmConverter.build_tokenizer_from_spm_proto).parameters:
        import transformers

        raise ConfigError(f"{where}tokenizer_type=SentencePieceTokenizer: transformers {transformers.__version__}'s "
                          f"SentencePiece converter ignores the model's normalizer (its ids differ from "
                          f"SentencePiece's); install a newer transformers (5.25 is tested)")
    if spec.model_type == spec.BPE:
        vocab = {piece.piece: i for i, piece in enumerate(proto.pieces)}
    else:
        vocab = [(piece.piece, piece.score) for piece in proto.pieces]
    converted = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab)

    def piece(index: int) -> str | None:
        return proto.pieces[index].piece if 0 <= index < len(proto.pieces) else None

    eos = piece(spec.eos_id)
    if eos is None:
        raise ConfigError(f"{where}tokenizer_model={model_file} has no end-of-sentence piece (eos_id "
                          f"{spec.eos_id}), which ends every document; train it with one")
    return PreTrainedTokenizerFast(tokenizer_object=converted, bos_token=piece(spec.bos_id), eos_token=eos,
                                   unk_token=piece(spec.unk_id), pad_token=piece(spec.pad_id) or eos)


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
