"""Remove padding: the packed row gives the padded path's log-probs, entropies and gradients."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from posttrain.training.options import EngineOptions, TokenBudget
from posttrain.training import remove_padding as rp
from posttrain.training.engine import TrainEngine
from posttrain.training.forward import response_logprobs
from posttrain.training.batch import build_batch
from posttrain.training.loss_fns import make_actor_loss_fn

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, attn_implementation="sdpa")


def _model(kind="qwen2", seed=0):
    torch.manual_seed(seed)
    cls, cfg = {"qwen2": (Qwen2ForCausalLM, Qwen2Config), "llama": (LlamaForCausalLM, LlamaConfig)}[kind]
    return cls(cfg(**SMALL)).eval()


def _batch(prompt_lens=(3, 5, 2, 4), resp_lens=(4, 1, 6, 3), seed=1):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 64, (n,), generator=g).tolist() for n in prompt_lens]
    resps = [torch.randint(1, 64, (n,), generator=g).tolist() for n in resp_lens]
    return build_batch(prompts, resps, pad_token_id=0)


def _grouped_batch(seed=4):
    """Two prompts with 3 samples each (a GRPO group layout), plus two prompts with one sample each."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (5, 2, 3, 4)]
    rows = [prompts[0]] * 3 + [prompts[1]] * 3 + [prompts[2], prompts[3]]
    resps = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (4, 1, 6, 3, 2, 5, 2, 3)]
    return build_batch(rows, resps, pad_token_id=0)


def test_pack_layout_by_hand():
    batch = _batch(prompt_lens=(2, 1), resp_lens=(1, 3))
    # row 0: [p, p, r, pad, pad]; row 1: [pad, p, r, r, r]  (P = 2, R = 3)
    packed = rp.pack(batch)
    assert packed["input_ids"].shape == (1, 7)
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3]]  # restarts per sequence
    assert packed["valid"].tolist() == [[True, True, True, False], [True, True, True, True]]
    assert packed["pad_index"][1].tolist() == [3, 4, 5, 6]
    # logits that predict response tokens: row 0 from its 2nd prompt token (packed 1);
    # row 1 from packed 3 (its prompt token), 4 and 5 (its first two response tokens)
    assert packed["keep"].tolist() == [1, 3, 4, 5]
    assert torch.equal(packed["labels"], torch.cat([batch["input_ids"][0, 2:3], batch["input_ids"][1, 2:5]]))


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_logprobs_and_entropy_equal_padded(kind):
    model, batch = _model(kind), _batch()
    ref_lp, ref_ent = response_logprobs(model, batch, temperature=0.7, with_entropy=True)
    lp, ent = rp.packed_response_logprobs(model, batch, temperature=0.7, with_entropy=True)
    assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)
    assert (lp[batch["response_mask"] == 0] == 0).all()
    # a cross-sequence leak would change the first sequence's values when another row changes
    other = _batch()
    other["input_ids"][1:, :] = torch.where(other["attention_mask"][1:] == 1, 7, 0)
    lp2, _ = rp.packed_response_logprobs(model, other, temperature=0.7)
    assert torch.allclose(lp2[0], lp[0], atol=1e-6)
    # the padded path still works on the model after the packed attention was installed
    again, _ = response_logprobs(model, batch, temperature=0.7)
    assert torch.allclose(again, ref_lp, atol=1e-6)


def test_gradients_equal_padded():
    batch = _batch()
    grads = []
    for packed in (False, True):
        model = _model().train()
        lp, _ = response_logprobs(model, batch, packing=rp.Packing() if packed else None)
        (lp * torch.linspace(-1, 1, lp.numel()).reshape(lp.shape)).sum().backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert grads[0].abs().sum() > 0
    assert torch.allclose(grads[0], grads[1], atol=1e-5)


@pytest.mark.parametrize("make_batch", [_batch, _grouped_batch], ids=["distinct", "grouped"])
def test_engine_remove_padding_matches(make_batch):
    batch = make_batch()
    batch["advantages"] = torch.randn(batch["response_mask"].shape, generator=torch.Generator().manual_seed(3))
    results = []
    for packed in (False, True):
        model = _model()
        engine = TrainEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=2,
                             options=EngineOptions(use_remove_padding=packed))
        before = engine.compute_logprobs(batch)
        engine.update(batch, make_actor_loss_fn(), mini_batch_size=4)
        results.append((before, engine.compute_logprobs(batch)))
    assert torch.allclose(results[0][0], results[1][0], atol=1e-5)
    assert not torch.allclose(results[0][0], results[0][1])  # the step changed the model
    assert torch.allclose(results[0][1], results[1][1], atol=1e-5)


def test_shared_prompt_layout_by_hand():
    # rows 0 and 1 share the prompt [5, 6]; row 2 has its own [7]
    batch = build_batch([[5, 6], [5, 6], [7]], [[1], [2, 3], [4]], pad_token_id=0)
    packed = rp.pack(batch, share_prompts=True)
    # packed row: [5, 6 | 1 | 2, 3] [7 | 4]: the shared prompt once
    assert packed["input_ids"].tolist() == [[5, 6, 1, 2, 3, 7, 4]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 2, 3, 0, 1]]  # responses continue the prompt
    real = torch.where(packed["valid"], packed["pad_index"], -1)  # padding slots point anywhere
    assert real.tolist() == [[0, 1, 2, -1], [0, 1, 3, 4], [5, 6, -1, -1]]
    assert packed["valid"].tolist() == [[True, True, True, False], [True, True, True, True],
                                        [True, True, False, False]]
    # each packed position's output comes from one block slot (b * 4 + l): the prompt from row 0
    assert packed["owner"].tolist() == [0, 1, 2, 6, 7, 8, 9]
    # row 0 computes the shared prompt: row 1's queries start at its response (slot 2)
    assert packed["query_start"].tolist() == [0, 2, 0]
    # both first response tokens are predicted by the shared prompt's last token (packed 1)
    assert packed["keep"].tolist() == [1, 1, 3, 5]
    assert packed["labels"].tolist() == [1, 2, 3, 4]
    unshared = rp.pack(batch, share_prompts=False)
    assert unshared["input_ids"].tolist() == [[5, 6, 1, 5, 6, 2, 3, 7, 4]]


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_shared_prompts_equal_padded(kind):
    model, batch = _model(kind), _grouped_batch()
    ref_lp, ref_ent = response_logprobs(model, batch, temperature=0.7, with_entropy=True)
    lp, ent = response_logprobs(model, batch, temperature=0.7, with_entropy=True, packing=rp.Packing(share_prompts=True))
    assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)
    packed = rp.pack(batch, share_prompts=True)
    assert packed["input_ids"].shape[1] == 5 + 2 + 3 + 4 + sum((4, 1, 6, 3, 2, 5, 2, 3))  # each prompt once


def test_shared_prompt_gradients_equal_padded():
    batch = _grouped_batch()
    weights = torch.linspace(-1, 1, batch["response_mask"].numel()).reshape(batch["response_mask"].shape)
    grads = []
    for packed, share in ((False, False), (True, True)):
        model = _model().train()
        lp, _ = response_logprobs(model, batch, packing=rp.Packing(share_prompts=share) if packed else None)
        (lp * weights).sum().backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert grads[0].abs().sum() > 0
    assert torch.allclose(grads[0], grads[1], atol=1e-5)


def test_engine_micro_batches_keep_a_group_together():
    # rows of two groups interleaved (as a shuffled dock returns them): micro-batches of 3 rows each
    # hold one group after the engine's reordering, so each packs a single prompt copy
    batch = build_batch([[5, 6], [7], [5, 6], [7], [5, 6], [7]], [[1], [2], [3], [4], [5], [6]], pad_token_id=0)
    assert rp.group_rows_by_prompt(batch).tolist() == [0, 2, 4, 1, 3, 5]
    model = _model()
    engine = TrainEngine(model, micro_batch_size=3, options=EngineOptions(use_remove_padding=True))
    chunks = engine._chunks(batch, None, None)
    assert [c.tolist() for c in chunks] == [[0, 2, 4], [1, 3, 5]]
    engine = TrainEngine(model, micro_batch_size=3,
                         options=EngineOptions(use_remove_padding=True, share_prompt_prefix=False))
    assert [c.tolist() for c in engine._chunks(batch, None, None)] == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed", "token_budget"])
def test_dpo_update_with_remove_padding_matches(dynamic):
    # a pairwise batch (chosen_* / rejected_* sides): packing and token-budget micro-batches count both sides
    from posttrain.training.loss_fns import make_dpo_loss_fn

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (3, 5, 2, 4)]
    batch = {}
    for side, lens in (("chosen", (2, 4, 3, 1)), ("rejected", (5, 1, 2, 3))):
        resps = [torch.randint(1, 64, (n,), generator=g).tolist() for n in lens]
        batch.update({f"{side}_{k}": v for k, v in build_batch(prompts, resps, pad_token_id=0).items()})
    batch["ref_chosen_logps"] = torch.tensor([-9.0, -14.0, -11.0, -4.0])
    batch["ref_rejected_logps"] = torch.tensor([-17.0, -4.0, -8.0, -12.0])
    results = []
    for packed in (False, True):
        model = _model()
        budget = TokenBudget(24, None) if packed and dynamic else None
        engine = TrainEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=2,
                             options=EngineOptions(use_remove_padding=packed, loss_mask_key="chosen_response_mask",
                                                   update_budget=budget))
        step = engine.update(batch, make_dpo_loss_fn(beta=0.5), mini_batch_size=4)[0]
        results.append((step, torch.cat([p.detach().reshape(-1) for p in model.parameters()])))
    assert results[0][0]["actor/grad_norm"] == pytest.approx(results[1][0]["actor/grad_norm"], rel=1e-4)
    assert torch.allclose(results[0][1], results[1][1], atol=1e-5)


def _cost(lengths, blocks, queries=None):
    queries = lengths if queries is None else queries
    return sum(len(b) * max(lengths[r] for r in b) * max(queries[r] for r in b) for b in blocks)


@pytest.mark.parametrize("seed", range(6))
def test_block_rows_cost_is_within_ten_percent_of_the_least(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
    blocks = rp.block_rows(lengths)
    assert sorted(r for b in blocks for r in b) == list(range(len(lengths))) and len(blocks) <= rp.MAX_BLOCKS
    ordered = sorted(lengths)
    least = min(  # every split of the sorted rows into at most 4 contiguous blocks
        sum((b - a) * ordered[b - 1] ** 2 for a, b in zip((0, *cuts), (*cuts, len(ordered))))
        for k in range(rp.MAX_BLOCKS) for cuts in __import__("itertools").combinations(range(1, len(ordered)), k))
    assert least <= _cost(lengths, blocks) <= 1.1 * least


@pytest.mark.parametrize("seed", range(4))
def test_block_rows_with_fewer_queries_than_keys_costs_rows_times_width_times_queries(seed):
    # suffix rows (a shared prompt's later samples): the cost counts their queries, not their width
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(20, 60, (7,), generator=g).tolist()
    queries = [n - int(torch.randint(1, n, (1,), generator=g)) for n in lengths]
    blocks = rp.block_rows(lengths, queries=queries)
    assert sorted(r for b in blocks for r in b) == list(range(len(lengths))) and len(blocks) <= rp.MAX_BLOCKS
    order = sorted(range(len(lengths)), key=lambda r: (lengths[r], queries[r]))
    least = min(  # every split of the rows in that order into at most 4 contiguous blocks
        _cost(lengths, [order[a:b] for a, b in zip((0, *cuts), (*cuts, len(order)))], queries)
        for k in range(rp.MAX_BLOCKS) for cuts in __import__("itertools").combinations(range(1, len(order)), k))
    assert least <= _cost(lengths, blocks, queries) <= 1.1 * least


def test_shared_prompt_queries_run_once():
    # rows 0 and 1 share the prompt [5, 6]; row 2 has its own [7]: row 1 runs only its response's queries
    batch = build_batch([[5, 6], [5, 6], [7]], [[1], [2, 3], [4]], pad_token_id=0)
    blocks, owner = rp.split_blocks(rp.pack(batch, share_prompts=True))
    full = [b for b in blocks if len(b) == 2]
    (suffix,) = [b for b in blocks if len(b) == 4]
    index, valid, query_index, mask = suffix
    assert index.tolist() == [[0, 1, 3, 4]] and query_index.tolist() == [[3, 4]]
    assert mask.tolist() == [[[[True, True, True, False], [True, True, True, True]]]]  # causal by slot
    assert sum(b[0].numel() for b in full) + query_index.numel() == 7  # 7 packed positions, 7 queries (9 before)
    slots = torch.cat([b[0].reshape(-1) for b in full] + [query_index.reshape(-1)])
    assert slots[owner].tolist() == list(range(7))  # each packed position computed by a query of its own


def test_block_rows_splits_a_long_tail_off():
    lengths = [60] * 60 + [120] * 4  # an RL batch: many short answers, a few long ones
    blocks = rp.block_rows(lengths)
    assert sorted(map(len, blocks)) == [4, 60]


@pytest.mark.parametrize("cpu_path", ["on", "off"])  # off: the general masked form other devices run
@pytest.mark.parametrize("share", [False, True])
def test_blocks_of_mixed_lengths_equal_padded(share, cpu_path, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_CPU_ATTENTION", cpu_path)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (5, 3)]
    rows = [prompts[0]] * 6 + [prompts[1]] * 6
    resps = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (2, 1, 2, 3, 2, 24, 1, 2, 2, 1, 3, 20)]
    batch = build_batch(rows, resps, pad_token_id=0)
    blocks, _ = rp.split_blocks(rp.pack(batch, share_prompts=share))
    assert len(blocks) > 1, "the test needs several attention blocks"
    model = _model()
    ref_lp, ref_ent = response_logprobs(model, batch, temperature=0.7, with_entropy=True)
    lp, ent = rp.packed_response_logprobs(model, batch, temperature=0.7, with_entropy=True, share_prompts=share)
    assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)
    grads = []
    for fn in (lambda: response_logprobs(model, batch)[0],
               lambda: rp.packed_response_logprobs(model, batch, share_prompts=share)[0]):
        model.zero_grad()
        (fn() * batch["response_mask"]).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-5)


def test_common_prefixes_layout_by_hand():
    # a system token 9 common to every row; rows 0, 1, 3 share the prompt [9, 5, 6] and the answer's
    # first token 1; row 3 repeats row 0's answer exactly; row 2 shares only the 9
    batch = build_batch([[9, 5, 6], [9, 5, 6], [9, 7], [9, 5, 6]], [[1, 2], [1, 3], [4], [1, 2]], pad_token_id=0)
    packed = rp.pack(batch, share_prompts=True)
    assert packed["input_ids"].tolist() == [[9, 5, 6, 1, 2, 3, 7, 4]]  # each distinct prefix once
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 4, 4, 1, 2]]
    real = torch.where(packed["valid"], packed["pad_index"], -1)
    assert real.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 5], [0, 6, 7, -1, -1], [0, 1, 2, 3, 4]]
    assert packed["query_start"].tolist() == [0, 4, 1, 5]  # row 3 computes nothing of its own
    # (predicting position, label) once per distinct pair; pick: each response token's pair
    assert packed["keep"].tolist() == [2, 3, 3, 6] and packed["labels"].tolist() == [1, 2, 3, 4]
    assert packed["pick"].tolist() == [0, 1, 0, 2, 3, 0, 1]
    blocks, owner = rp.split_blocks(packed)
    queries = torch.cat([b[0].reshape(-1) if len(b) == 2 else b[2].reshape(-1) for b in blocks])
    assert queries.numel() == 8 and queries[owner].tolist() == list(range(8))  # each position computed once


def _prefix_batch(seed=11):
    """Three GRPO groups whose prompts start with one system prompt; in each group of four samples two
    answers begin alike, one repeats another exactly and one is a prefix of another."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(1, 64, (n,), generator=g).tolist()  # noqa: E731
    system, rows, resps = draw(6), [], []
    for own in (2, 4, 3):
        prompt, a, b = system + draw(own), draw(3), draw(5)
        rows += [prompt] * 4
        resps += [a + draw(2), a + draw(4), b, b[:3]]
    return build_batch(rows, resps, pad_token_id=0)


def _distinct_prefixes(batch) -> int:
    """The number of distinct (token, position) prefixes of the batch's rows, by brute force."""
    prefixes = set()
    for ids, mask in zip(batch["input_ids"].tolist(), batch["attention_mask"].tolist()):
        seq = [t for t, m in zip(ids, mask) if m]
        prefixes.update(tuple(seq[:i + 1]) for i in range(len(seq)))
    return len(prefixes)


def test_common_prefixes_are_packed_once():
    batch = _prefix_batch()
    packed = rp.pack(batch, share_prompts=True)
    assert packed["input_ids"].shape[1] == _distinct_prefixes(batch) < rp.pack(batch)["input_ids"].shape[1]
    blocks, owner = rp.split_blocks(packed)
    queries = torch.cat([b[0].reshape(-1) if len(b) == 2 else b[2].reshape(-1) for b in blocks])
    assert queries[owner].tolist() == list(range(packed["input_ids"].shape[1]))


@pytest.mark.parametrize("cpu_path", ["on", "off"])
def test_common_prefixes_equal_padded(cpu_path, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_CPU_ATTENTION", cpu_path)
    model, batch = _model(), _prefix_batch()
    ref_lp, ref_ent = response_logprobs(model, batch, temperature=0.7, with_entropy=True)
    lp, ent = rp.packed_response_logprobs(model, batch, temperature=0.7, with_entropy=True, share_prompts=True)
    assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)
    weights = torch.linspace(-1, 1, batch["response_mask"].numel()).reshape(batch["response_mask"].shape)
    grads = []
    for fn in (lambda: response_logprobs(model, batch)[0],
               lambda: rp.packed_response_logprobs(model, batch, share_prompts=True)[0]):
        model.zero_grad()
        (fn() * weights).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert grads[0].abs().sum() > 0 and torch.allclose(grads[0], grads[1], atol=1e-5)
