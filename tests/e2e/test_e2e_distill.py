"""On-policy distillation end to end (rl_config.teacher_model, posttrain.algo.distill) on CPU.

The teacher is a Qwen2 of another size and seed than the student (hidden 128 vs 64), made by a short
SFT on the addition prompts of the mini world (answer digits, then eos). The student is the mini
world's random-init model, far from it. A few iterations of distillation (distill_mode: reverse_kl:
the advantage is log q - log pi of each sampled token, the task reward unused) move the student
toward the teacher on held-out prompts it never trained on: its greedy next token agrees with the
teacher's along the teacher's greedy answers far more often, and the exact reverse KL there falls.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.configs import OMIT, run_config
from tests.helpers.data import addition_rows, preprocess_prompts
from tests.helpers.runs import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
ITERS = 40
ANSWER_TOKENS = 3  # the teacher's greedy answers are scored over this many tokens (digits, eos)


def prompts_and_answers(prefix: str | Path) -> list[tuple[list[int], list[int]]]:
    from posttrain.data.datasets import PromptDataset

    data = PromptDataset(prefix)
    return [(data[i]["prompts"].tolist(), data[i]["labels"].tolist()) for i in range(len(data))]


def sft_teacher(out: Path, tokenizer, rows: list[tuple[list[int], list[int]]], steps: int = 120) -> Path:
    """A 2-layer Qwen2 (hidden 128, seed 1) trained by SFT to answer each prompt with its sum and eos."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    model = Qwen2ForCausalLM(config)
    seqs = [(p, a + [tokenizer.eos_token_id]) for p, a in rows]
    width = max(len(p) + len(a) for p, a in seqs)
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
    labels = torch.full((len(seqs), width), -100)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (p, a) in enumerate(seqs):
        ids[i, :len(p) + len(a)] = torch.tensor(p + a)
        labels[i, len(p):len(p) + len(a)] = torch.tensor(a)
        mask[i, :len(p) + len(a)] = 1
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.3, loss.item()  # the teacher knows its task
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@torch.no_grad()
def agreement_and_kl(student, teacher, prompts: list[list[int]], eos: int) -> tuple[float, float]:
    """Along the teacher's greedy answer to each prompt (up to :data:`ANSWER_TOKENS` tokens): the share
    of positions where the student's argmax is the teacher's token, and the mean exact reverse KL
    ``sum_v pi(v) (log pi(v) - log q(v))`` over those positions."""
    matches = kl = total = 0.0
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(ANSWER_TOKENS):
            ids.append(int(teacher(torch.tensor([ids])).logits[0, -1].argmax()))
            if ids[-1] == eos:
                break
        x, answer = torch.tensor([ids]), torch.tensor(ids[len(prompt):])
        span = slice(len(prompt) - 1, len(ids) - 1)
        log_pi = torch.log_softmax(student(x).logits[0, span].double(), -1)
        log_q = torch.log_softmax(teacher(x).logits[0, span].double(), -1)
        matches += float((log_pi.argmax(-1) == answer).sum())
        kl += float((log_pi.exp() * (log_pi - log_q)).sum())
        total += len(answer)
    return matches / total, kl / total


def test_distillation_moves_the_student_to_the_teacher_on_held_out_prompts(tmp_path, mini_world):
    from posttrain.commands.train import train_config as train
    from posttrain.models.loading import load_causal_lm, load_tokenizer, resolve_model_dir

    tokenizer = load_tokenizer(mini_world / "model")
    teacher_dir = sft_teacher(tmp_path / "teacher", tokenizer, prompts_and_answers(mini_world / "data" / "rl"))
    held_out = preprocess_prompts(addition_rows(12, 7), tmp_path / "held.jsonl", mini_world / "model",
                                  tmp_path / "held" / "data", prompt_type="trl", workers=1)
    held_prompts = [p for p, _ in prompts_and_answers(held_out)]
    cfg = run_config(mini_world / "model", mini_world / "data" / "rl", tmp_path / "out", name="distill", iters=ITERS,
                     megatron_training={"global_batch_size": 16, "micro_batch_size": 64, "lr": 1e-2,
                                        "save": str(tmp_path / "ckpt")},
                     rl_config={"n_samples_per_prompt": 8, "mini_batch_size": 16,
                                "teacher_model": str(teacher_dir), "verifier_function": ["last_number"],
                                "verifier_modules": OMIT, "verifier_parallel": 0},
                     generate_config={"max_num_seqs": 256, "sampling_config": {"max_tokens": 3, "temperature": 1.0,
                                                                               "top_k": -1, "top_p": 1.0}})
    last = train(cfg)
    for key in ("timing/teacher_model", "distill/teacher_logprob", "distill/student_logprob"):
        assert key in last, key
    kls = [r["distill/reverse_kl"] for r in read_metrics(tmp_path / "out") if "distill/reverse_kl" in r]
    # on the student's own samples (measured, seed 1: 6.0 nats per token over the first 3 iterations,
    # 3.1 over the last 5)
    assert len(kls) == ITERS and sum(kls[-5:]) / 5 < 0.75 * sum(kls[:3]) / 3, kls

    teacher = load_causal_lm(teacher_dir).eval()
    before = agreement_and_kl(load_causal_lm(mini_world / "model").eval(), teacher, held_prompts,
                              tokenizer.eos_token_id)
    after = agreement_and_kl(load_causal_lm(resolve_model_dir(tmp_path / "ckpt")).eval(), teacher, held_prompts,
                             tokenizer.eos_token_id)
    # measured (seeds 1-4, lr 1e-2): agreement 0.125 -> 0.59-0.625, reverse KL 6.5 -> 2.5-3.2 nats per token. At lr
    # 2e-2 seed 1 once stalled at 0.34 / 5.8 after a 1-ulp change of the rollout's attention (seeds 2-5: 0.625)
    assert after[0] >= before[0] + 0.25, (before, after)  # the held-out agreement rises
    assert after[1] < 0.6 * before[1], (before, after)  # and the reverse KL there falls by 40% or more
