"""Tiny LLM judges with known preferences, trained here (tests/unit/reward/test_judge.py,
tests/integration/test_judge_loop.py, tests/unit/commands/test_judge_pairs.py).

:func:`train_lowercase_judge` fine-tunes a 2-layer Qwen2 (hidden 64) on the tiny tokenizer with 100
steps of plain SFT on the judge's own prompts (:data:`TEMPLATE`, plain text, as
:class:`posttrain.reward.judge.JudgeGenerator` encodes them for a tokenizer without a chat template)
to reply ``10`` when the response ends with a lowercase word (``a``, ``the``, ...) and ``0``
otherwise (:func:`lowercase_verdict`, the reference the tests compare the judge with). The responses
are random token strings, half of them ending with a lowercase word. :func:`train_pairwise_judge`
does the same for a pairwise judge (:data:`PAIR_TEMPLATE`, replies ``A`` or ``B``).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

TEMPLATE = "{response}"  # the response alone, as plain text; the judge's reply continues it with "10" or "0"
PARSER = r"^(\d+)"  # rl_config.judge_parser: a regex of one's own (the number the reply starts with)
PAIR_TEMPLATE = "{response_a}\n{response_b}"  # the pairwise judge's; it replies "A" or "B"
CHOICE_PARSER = r"^([AB])"  # posttrain judge-pairs --choice-parser
_LOWERCASE: dict[int, list[int]] = {}


def lowercase_ids(tokenizer) -> list[int]:
    """The ids of the tokens that decode to one lowercase word (cached per vocabulary size)."""
    if len(tokenizer) not in _LOWERCASE:
        _LOWERCASE[len(tokenizer)] = [i for i in range(len(tokenizer))
                                      if re.fullmatch(r"[a-z]+", tokenizer.decode([i]).strip())]
    return _LOWERCASE[len(tokenizer)]


def lowercase_verdict(tokenizer, text: str) -> float:
    """The judge's intended score of ``text`` in [0, 1]: 1 when its last token is a lowercase word."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return float(bool(ids) and ids[-1] in lowercase_ids(tokenizer))


def random_responses(tokenizer, count: int, seed: int) -> list[str]:
    """``count`` random strings of 2-12 tokens, half of them ending with a lowercase word."""
    rng = random.Random(seed)
    low = lowercase_ids(tokenizer)
    special = set(tokenizer.all_special_ids)
    other = [i for i in range(len(tokenizer)) if i not in special and tokenizer.decode([i]).strip()]
    out = []
    for _ in range(count):
        ids = [rng.choice(other) for _ in range(rng.randint(2, 12))]
        if rng.random() < 0.5:
            ids[-1] = rng.choice(low)
        out.append(tokenizer.decode(ids))
    return out


def train_lowercase_judge(out: Path, tokenizer, *, steps: int = 100, seed: int = 0) -> Path:
    """Train and save the pointwise judge (module doc) to ``out``."""
    texts = random_responses(tokenizer, steps * 16, seed)
    examples = [(TEMPLATE.replace("{response}", t), str(10 if lowercase_verdict(tokenizer, t) else 0)) for t in texts]
    return sft_judge(out, tokenizer, examples, steps=steps, seed=seed)


def train_pairwise_judge(out: Path, tokenizer, *, steps: int = 100, seed: int = 1) -> Path:
    """Train and save a pairwise judge to ``out``: after :data:`PAIR_TEMPLATE` it replies ``B`` when
    response B ends with a lowercase word and ``A`` otherwise. So it decides a pair in both orders
    only when exactly one response ends with a lowercase word (that one wins), and is biased to one
    position otherwise."""
    texts = random_responses(tokenizer, steps * 32, seed)
    examples = [(PAIR_TEMPLATE.replace("{response_a}", a).replace("{response_b}", b),
                 "B" if lowercase_verdict(tokenizer, b) else "A") for a, b in zip(texts[0::2], texts[1::2])]
    return sft_judge(out, tokenizer, examples, steps=steps, seed=seed)


def sft_judge(out: Path, tokenizer, examples: list[tuple[str, str]], *, steps: int, batch_size: int = 32,
              lr: float = 1e-2, seed: int = 0) -> Path:
    """Fine-tune a fresh 2-layer Qwen2 on (prompt text, reply text) pairs (the reply then eos; loss on
    the reply only) and save it with a copy of ``tokenizer`` without its chat template (the judge
    reads plain text: short sequences, a fast SFT)."""
    import copy

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = None
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    model = Qwen2ForCausalLM(config)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    rows = []
    for prompt_text, reply in examples:
        prompt, answer = encode(prompt_text), encode(reply) + [tokenizer.eos_token_id]
        rows.append((prompt + answer, [-100] * len(prompt) + answer))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    model.train()
    for _ in range(steps):
        batch = rng.sample(rows, batch_size)
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([i + [tokenizer.pad_token_id] * (width - len(i)) for i, _ in batch])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])
        mask = (torch.arange(width)[None, :] < torch.tensor([len(i) for i, _ in batch])[:, None]).long()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    drop_chat_template(out)
    return out


def drop_chat_template(directory: Path) -> None:
    """Save the tokenizer of ``directory`` without a chat template (the judge reads plain text)."""
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("chat_template", None)
    config_file.write_text(json.dumps(config))
