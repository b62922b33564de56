"""``posttrain init-model``: a random-init HF model directory, with a tokenizer trained locally.

Nothing here touches the network. Tests and the CI demo build their models with this.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer,
                          PreTrainedTokenizerFast)

from posttrain.checkpoint import make_readable
from posttrain.errors import ConfigError
from posttrain.models.arch import arch_from_model_yaml
from posttrain.models.vision_arch import VLM_TYPES
from posttrain.models.vlm import add_vision_tokens, save_processor

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen-style chat template: the one the tiny models share with Qwen2.5.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def default_corpus(num_lines: int = 4000, seed: int = 0) -> list[str]:
    """A small built-in corpus: arithmetic, chat markup and plain English, for a tiny BPE."""
    rng = random.Random(seed)
    words = ("the answer is what sum of numbers add plus minus equals think step first then so "
             "question solve result total value compute final please give reason because").split()
    lines = []
    for _ in range(num_lines):
        a, b, c = rng.randint(0, 99), rng.randint(0, 9), rng.randint(0, 9)
        lines.append(f"What is {a} + {b} - {c}? <think> {a} + {b} = {a + b}, then {a + b} - {c} = {a + b - c}"
                     f" </think> <answer>{a + b - c}</answer> \\boxed{{{a + b - c}}} #### {a + b - c}")
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))).capitalize() + ".")
    return lines


def train_tokenizer(texts: list[str], vocab_size: int = 512):
    """A byte-level BPE tokenizer with the chat special tokens and a chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


# the byte-level BPE's 256 byte tokens plus the special tokens: a smaller vocabulary cannot be trained
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)


def check_output_dir(output: str | Path, force: bool = False) -> Path:
    """Where init-model may write, checked before any work. A new or empty directory is fine; a
    directory holding files only with ``force`` (and then only init-model's own files in it are
    replaced, nothing is deleted); the current directory (or one above it) and a file never."""
    output = Path(output)
    resolved = output.resolve()
    cwd = Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        raise ConfigError(f"--output {output}: is the current directory (or one above it); give a new directory "
                          f"for the model, e.g. --output {Path('models') / 'tiny'}")
    if output.exists() and not output.is_dir():
        raise ConfigError(f"--output {output} is an existing file; give a directory path for the model")
    if output.is_dir():
        found = sorted(p.name for p in output.iterdir())
        if found and not force:
            shown = ", ".join(found[:5]) + (", ..." if len(found) > 5 else "")
            raise ConfigError(f"--output {output} is not empty ({shown}); init-model writes only into a new or "
                              f"empty directory. Give a new directory, or --force to replace only "
                              f"init-model's own files there (config.json, weights, tokenizer files; nothing else "
                              f"is deleted)")
    return output


SIZE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "num_query_groups", "kv_channels",
             "max_position_embeddings")


def check_model_sizes(name: str, keys: dict) -> None:
    """The model yaml's sizes can build a model: whole numbers >= 1, the heads dividing the hidden
    size (unless ``kv_channels`` sets the head size) and the key-value groups dividing the heads."""
    for key in SIZE_KEYS:
        value = keys.get(key)
        if value is None and key in SIZE_KEYS[3:]:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"model '{name}': {key}={value!r} must be a whole number >= 1")
    heads, hidden = keys["num_attention_heads"], keys["hidden_size"]
    if not keys.get("kv_channels") and hidden % heads:
        raise ConfigError(f"model '{name}': hidden_size={hidden} is not a multiple of num_attention_heads={heads} "
                          f"(each head gets hidden_size / num_attention_heads features); change one, or set "
                          f"kv_channels")
    groups = keys.get("num_query_groups") if keys.get("group_query_attention") else None
    if groups and heads % groups:
        raise ConfigError(f"model '{name}': num_attention_heads={heads} is not a multiple of "
                          f"num_query_groups={groups} (each key-value group serves the same number of heads)")


def _install(tmp: Path, output: Path, force: bool = False) -> None:
    """Move the files written in ``tmp`` into ``output``: one rename when ``output`` is new or an
    empty directory, else (``force``) file by file (each replaced atomically). Stale weight files of
    an earlier model there (shards, index) are removed, since a loader would mix them with the new
    ones; no other file in ``output`` is touched. Without ``force``, a directory that another
    process filled while this one worked is refused, and nothing of this run is written."""
    if not output.is_symlink():
        try:
            os.rename(tmp, output)  # atomic; replaces only a missing or empty directory
            return
        except OSError as err:
            if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
    if not force:
        found = sorted(p.name for p in output.iterdir())
        shown = ", ".join(found[:5]) + (", ..." if len(found) > 5 else "")
        raise ConfigError(f"--output {output}: another process wrote into it while this one built the model (it "
                          f"was new or empty when checked, and now holds {shown}); nothing of this run was written. "
                          f"Give a new directory, or --force to replace init-model's own files there")
    written = {p.name for p in tmp.iterdir()}
    for stale in output.iterdir():
        is_weights = stale.name.startswith("model") and (stale.name.endswith(".safetensors")
                                                         or stale.name == "model.safetensors.index.json")
        if is_weights and stale.name not in written and (stale.is_file() or stale.is_symlink()):
            stale.unlink()
    for name in sorted(written):
        os.replace(tmp / name, output / name)


def init_model_dir(name: str, keys: dict, output: str | Path, corpus: str | Path | None = None,
                   vocab_size: int | None = None, tokenizer: str | Path | None = None,
                   seed: int = 1234, force: bool = False) -> Path:
    """Write ``config.json``, ``model.safetensors`` and the tokenizer of the model yaml ``name`` (its
    architecture ``keys``) into ``output`` (atomically).

    ``output`` must be new or empty; with ``force`` an existing directory gets init-model's files
    replaced and keeps every other file (:func:`check_output_dir`)."""
    output = check_output_dir(output, force)
    check_model_sizes(name, keys)
    if vocab_size is not None and vocab_size < MIN_VOCAB_SIZE:
        raise ConfigError(f"--vocab-size {vocab_size}: must be at least {MIN_VOCAB_SIZE} (the byte-level "
                          f"tokenizer's 256 byte tokens plus {len(SPECIAL_TOKENS)} special tokens)")
    if tokenizer is not None:
        if not Path(tokenizer).is_dir():
            raise ConfigError(f"--tokenizer {tokenizer}: no such directory (give a local Hugging Face tokenizer or "
                              f"model directory; init-model does not download)")
        try:
            tok = AutoTokenizer.from_pretrained(str(tokenizer))
        except (OSError, ValueError, TypeError, KeyError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(f"--tokenizer {tokenizer}: cannot load a tokenizer from it ({first})") from None
    else:
        if corpus is not None:
            path = Path(corpus)
            if not path.is_file():
                raise ConfigError(f"--corpus {path}: no such file")
            texts = path.read_text(encoding="utf-8").splitlines()
        else:
            texts = default_corpus()
        tok = train_tokenizer(texts, vocab_size or int(keys.get("tokenizer_vocab_size", 512)))
    vision_ids = add_vision_tokens(tok) if keys.get("hf_model_type") in VLM_TYPES else {}
    divisor = int(keys.get("make_vocab_size_divisible_by") or 1)
    special = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    net, arch = random_model(name, keys, _round_up(len(tok), divisor), {**special, **vision_ids}, seed)

    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    except OSError as err:
        raise ConfigError(f"--output {output}: cannot write in {output.parent} ({err})") from None
    try:
        net.save_pretrained(tmp, safe_serialization=True)
        if arch.vision is not None:  # the tokenizer and the image processor
            save_processor(tmp, tok, arch.vision)
        else:
            tok.save_pretrained(tmp)
        make_readable(tmp)  # 0644 files, 0755 dir (not save_pretrained's 0600, mkdtemp's 0700)
        _install(tmp, output, force)
    except OSError as err:
        full = err.errno in (errno.ENOSPC, errno.EDQUOT)
        raise ConfigError(f"--output {output}: cannot write the model ("
                          f"{'the disk is full' if full else err.strerror or err}); nothing was written. "
                          f"{'Free some space or give' if full else 'Give'} another directory") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return output


def random_model(name: str, keys: dict, vocab_size: int, token_ids: dict, seed: int,
                 text_config: dict | None = None):
    """The random-init model of the model yaml ``name`` (its architecture ``keys``) and its
    :class:`~posttrain.models.arch.ModelArch`: ``vocab_size`` rows, the tokenizer's special
    ``token_ids`` (``bos/eos/pad_token_id``, a VLM's vision token ids), ``text_config``: more HF
    config values of the language model (a VLM's) or the model (e.g. ``initializer_range``)."""
    vlm = keys.get("hf_model_type") in VLM_TYPES
    arch = arch_from_model_yaml(name, keys, vocab_size=vocab_size)
    hf_cfg = arch.to_hf_config()
    special = {k: v for k, v in token_ids.items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    hf_cfg.update(token_ids)
    if "text_config" in hf_cfg:  # a VLM: its language model reads them too
        hf_cfg["text_config"].update(special, **(text_config or {}))
    else:
        hf_cfg.update(text_config or {})
    return _random_model(name, hf_cfg, seed, vlm), arch


def _random_model(name: str, hf_cfg: dict, seed: int, vlm: bool) -> torch.nn.Module:
    """The random-init model of ``hf_cfg`` (fp32, seeded); Transformers' own size checks as a ConfigError."""
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if vlm else AutoModelForCausalLM
    try:
        return auto.from_config(AutoConfig.for_model(**hf_cfg), dtype=torch.float32)
    except (ValueError, ZeroDivisionError) as err:  # Transformers' own checks of the architecture
        first = str(err).strip().splitlines()[-1].strip() if str(err).strip() else type(err).__name__
        raise ConfigError(f"model '{name}': Transformers cannot build this architecture ({first}); fix the model "
                          f"yaml's sizes") from None
