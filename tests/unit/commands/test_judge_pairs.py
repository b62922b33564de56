"""``posttrain judge-pairs``: two samples per prompt, a real tiny pairwise judge asked in both orders,
DPO rows for the pairs it decides.

The judge (tests/helpers/judge.py) was taught to reply "B" when response B ends with a lowercase
word, else "A" (so it decides a pair only when exactly one sample ends with one). The samples are
drawn again here with the same seed (keyed sampling: the same samples) and the judge's replies are
read with transformers' own ``generate``, so the rows the command must write are known."""

from __future__ import annotations

import json
from argparse import Namespace

import pytest

from tests.helpers.judge import CHOICE_PARSER, PAIR_TEMPLATE, lowercase_verdict
from tests.helpers.runs import run_cli


def run_both(argv, capsys) -> tuple[int, str]:
    """``posttrain ARGV`` in process: (exit status, stdout + stderr)."""
    from posttrain.cli import main

    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out + captured.err

PROMPTS = [f"What is {a} + {b}?" for a in range(4) for b in range(4)]


def samples_of(model_dir) -> list[str]:
    """The two samples per prompt the command draws (same model, seed and keys: keyed sampling)."""
    from posttrain.commands.judge_pairs import generator_of

    sampler, _ = generator_of(str(model_dir), Namespace(device="cpu", seed=3), max_tokens=4, temperature=1.0,
                              timeout_s=60.0)
    return sampler.generate([p for p in PROMPTS for _ in range(2)])[0]


def judge_replies(judge_dir, texts: list[str]) -> list[str]:
    """The judge's greedy replies, one prompt at a time, by transformers' own generate (a reference
    independent of posttrain's engine and batching)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(judge_dir), AutoModelForCausalLM.from_pretrained(judge_dir)
    replies = []
    for text in texts:
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
                             pad_token_id=tok.pad_token_id)
        replies.append(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return replies


def test_judge_pairs_writes_the_pairs_both_orders_agree_on(mini_qwen2_dir, pairwise_judge_dir, tiny_tokenizer,
                                                          tmp_path, capsys, one_thread):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"instruction": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "pairs.jsonl"
    code, text = run_both(["judge-pairs", "--model", str(mini_qwen2_dir), "--judge", str(pairwise_judge_dir),
                          "--prompts", str(prompts), "--output", str(out), "--template", PAIR_TEMPLATE,
                          "--choice-parser", CHOICE_PARSER, "--max-tokens", "4", "--seed", "3",
                          "--judge-max-tokens", "2"], capsys)
    assert code == 0, text
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    samples = samples_of(mini_qwen2_dir)
    pairs = [(x, y) for x, y in zip(samples[0::2], samples[1::2])]
    asked = [PAIR_TEMPLATE.replace("{response_a}", a).replace("{response_b}", b) for x, y in pairs
             for a, b in ((x, y), (y, x))]
    replies = [r[:1] for r in judge_replies(pairwise_judge_dir, asked)]
    taught = ["B" if lowercase_verdict(tiny_tokenizer, b) else "A" for x, y in pairs for b in (y, x)]
    assert sum(r == t for r, t in zip(replies, taught)) >= 0.8 * len(taught)  # the judge has the taught preference
    want = []
    for prompt, (x, y), first, second in zip(PROMPTS, pairs, replies[0::2], replies[1::2]):
        if (first, second) in (("A", "B"), ("B", "A")):  # both orders agree
            chosen, rejected = (x, y) if first == "A" else (y, x)
            want.append({"instruction": prompt, "chosen": chosen, "rejected": rejected})
    assert 2 <= len(want) < len(PROMPTS)  # some pairs decided, some not
    assert rows == want
    assert f"{len(rows)} of {len(PROMPTS)} pairs decided" in text


def test_judge_pairs_refuses_bad_input(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question": "hi"}) + "\n")
    argv = ["judge-pairs", "--model", str(tmp_path), "--judge", "policy", "--prompts", str(prompts), "--output",
            str(tmp_path / "o.jsonl")]
    code, text = run_cli(["judge-pairs", "--model", str(tmp_path), "--judge", "nowhere", "--prompts", str(prompts),
                          "--output", str(tmp_path / "o.jsonl")], capsys)
    assert code != 0 and "--judge nowhere: no such directory" in text
    code, text = run_cli(argv, capsys)
    assert code != 0 and "prompts.jsonl:1: no text in the field 'instruction' (keys: question); use --prompt-field" \
        in text
    code, text = run_cli([*argv, "--prompt-field", "question", "--choice-parser", "Better"], capsys)
    assert code != 0 and "--choice-parser='Better': the regex needs exactly one capture group" in text


@pytest.mark.parametrize("reply,choice", [("Better: A", "A"), ("B", "B"), ("b", "B"), ("C", None)])
def test_choice_parsers(reply, choice):
    from posttrain.reward.judge_parse import compile_choice, parse_choice

    parser = compile_choice(None) if reply.startswith("Better") else compile_choice("^([A-Za-z])")
    assert parse_choice(reply, parser) == choice
