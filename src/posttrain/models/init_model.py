"""``posttrain init-model``: a random-init HF model directory, with a tokenizer trained locally.

Nothing here touches the network. Tests and the CI demo build their models with this.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path

from posttrain.errors import ConfigError

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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

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


def init_model_dir(model: str, output: str | Path, corpus: str | Path | None = None,
                   vocab_size: int | None = None, tokenizer: str | Path | None = None,
                   seed: int = 1234) -> Path:
    """Write ``config.json``, ``model.safetensors`` and the tokenizer into ``output`` (atomically)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from posttrain.config.loader import load_model_yaml
    from posttrain.models.arch import arch_from_model_yaml

    name, keys = load_model_yaml(model)
    if tokenizer is not None:
        tok = AutoTokenizer.from_pretrained(str(tokenizer))
    else:
        if corpus is not None:
            path = Path(corpus)
            if not path.is_file():
                raise ConfigError(f"--corpus {path}: no such file")
            texts = path.read_text(encoding="utf-8").splitlines()
        else:
            texts = default_corpus()
        tok = train_tokenizer(texts, vocab_size or int(keys.get("tokenizer_vocab_size", 512)))
    divisor = int(keys.get("make_vocab_size_divisible_by") or 1)
    arch = arch_from_model_yaml(name, keys, vocab_size=_round_up(len(tok), divisor))
    hf_cfg = arch.to_hf_config()
    hf_cfg.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = AutoConfig.for_model(**hf_cfg)
    torch.manual_seed(seed)
    net = AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        net.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if output.exists():
            shutil.rmtree(output)
        tmp.rename(output)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return output
