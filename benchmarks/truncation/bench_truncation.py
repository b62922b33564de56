"""The cost of rl_config.truncated_sampling_logprobs in the trainer's forward (docs/algorithms.md).

A SmolLM2-135M-shaped Llama (vocabulary 49,152, 30 layers, random init, fp32): the LM head alone
(posttrain.training.lm_head.head_logprobs) and the whole response_logprobs, without and with a
gradient, for no truncation, top-k 50, top-p 0.9 and both. Interleaved: each of 5 repetitions runs
every case once; the minimum is reported. Run:
PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/truncation/bench_truncation.py
"""
import time, torch
from transformers import LlamaConfig, LlamaForCausalLM
from posttrain.algo.truncation import Truncation
from posttrain.training.forward import response_logprobs
from posttrain.training.lm_head import head_logprobs
torch.manual_seed(0)
V = 49152
model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                     num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)).float()
ids = torch.randint(1, V, (4, 128))
batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "response_mask": torch.ones(4, 96, dtype=torch.long)}
cases = [("full", None), ("top_k 50", Truncation(top_k=50)), ("top_p 0.9", Truncation(top_p=0.9)),
         ("top_k 50 + top_p 0.9", Truncation(top_k=50, top_p=0.9))]
head = model.lm_head
h = torch.randn(384, 576)
y = torch.randint(0, V, (384,))
def step(t, grad):
    with torch.set_grad_enabled(grad):
        lp, _ = response_logprobs(model, batch, temperature=0.7, truncation=t)
        if grad: lp.sum().backward()
    model.zero_grad(set_to_none=True)
def head_only(t, grad):
    hh = h.clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        lp, _ = head_logprobs(head, hh, y, 0.7, truncation=t)
        if grad: lp.sum().backward()
    model.zero_grad(set_to_none=True)
for label, fn in [("LM head only (384 tokens x 576 -> 49152)", head_only), ("whole model, 4 x (32 prompt + 96 response) tokens", step)]:
    for grad in (False, True):
        best = {c: 1e9 for c, _ in cases}
        for _ in range(5):
            for c, t in cases:
                t0 = time.perf_counter(); fn(t, grad); best[c] = min(best[c], time.perf_counter() - t0)
        base = best["full"]
        print(f"{label}, {'forward+backward' if grad else 'no-grad'}: " + "; ".join(f"{c} {x:.3f} s ({(x/base-1)*100:+.0f}%)" for c, x in best.items()), flush=True)
