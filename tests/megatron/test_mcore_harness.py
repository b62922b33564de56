"""Self-tests of the Megatron-Core harness (tests/megatron/mcore_harness.py).

Independent of ``posttrain convert``: a tiny random HF model per architecture is mapped to
Megatron-Core's TP1/PP1 names by hand here, split for TP2 / PP2 / PP2+VPP2 / uneven PP with
the small helpers below (Megatron's layouts), written in Megatron's legacy checkpoint layout and
run through Megatron's own GPTModel and schedules. Checks: every layout gives the TP1 logits,
loss and gradients; TP1 matches the HF model; strict loading fails loudly on a wrong key.

All layouts of all architectures run in ONE spawned 2-rank world (spawning costs seconds).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import pytest
import torch

from tests.megatron.mcore_harness import (
    HarnessError,
    hf_reference_logits,
    load_shard,
    mcore_run_many,
    read_latest_dir,
    shard_path,
)

pytestmark = pytest.mark.slow

VOCAB, PADDED_VOCAB = 100, 128
HIDDEN, FFN, HEADS, HEAD_DIM, LAYERS = 64, 128, 4, 16, 4
BATCH, SEQ = 2, 12
ATOL = 5e-5  # fp32, a 2-rank all-reduce sums in another order than one matmul (seen: 1.1e-5)

# name -> (HF config class, kwargs, qk_layernorm, qkv bias)
ARCHS = {
    # Qwen2-like: qkv bias, GQA 4 heads / 2 query groups, untied embeddings
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=False, rms_norm_eps=1e-6,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}), False, True),
    # Llama-like: no bias, plain multi-head attention, tied embeddings
    "llama": ("LlamaConfig", dict(num_key_value_heads=4, tie_word_embeddings=True, rms_norm_eps=1e-5,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}), False, False),
    # Qwen3-like: q/k RMSNorm per head, GQA, no bias, tied embeddings
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=HEAD_DIM, tie_word_embeddings=True,
                                  rms_norm_eps=1e-6, attention_bias=False,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}), True, False),
}

# layout name -> (tp, pp, vpp, num_layer_list)
LAYOUTS = {
    "tp1": (1, 1, None, None),
    "tp2": (2, 1, None, None),
    "pp2": (1, 2, None, None),
}
EXTRA_LAYOUTS = {  # only for the Qwen2-like model (keeps the file fast)
    "pp2vpp2": (1, 2, 2, None),
    "pp2_1_3": (1, 2, None, "1,3"),
}


# ------------------------------------------------------------------------------------------------
# A tiny HF model and its hand-made TP1/PP1 Megatron-Core state dict
# ------------------------------------------------------------------------------------------------


def make_hf_model(arch: str, out_dir: Path, seed: int):
    import transformers

    cls_name, extra, _, _ = ARCHS[arch]
    config = getattr(transformers, cls_name)(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, max_position_embeddings=256, **extra,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # O(1) activations, so a 1e-5 tolerance means something
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[1]))
    model.save_pretrained(out_dir)
    return model


def megatron_args(arch: str, hf_config, tp: int, pp: int, vpp, layers) -> argparse.Namespace:
    _, _, qk_ln, qkv_bias = ARCHS[arch]
    groups = hf_config.num_key_value_heads
    gqa = groups != hf_config.num_attention_heads
    return argparse.Namespace(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size, num_attention_heads=hf_config.num_attention_heads,
        group_query_attention=gqa, num_query_groups=groups if gqa else 1, kv_channels=HEAD_DIM,
        max_position_embeddings=hf_config.max_position_embeddings, padded_vocab_size=PADDED_VOCAB,
        add_qkv_bias=qkv_bias, add_bias_linear=False, qk_layernorm=qk_ln, swiglu=True,
        normalization="RMSNorm", norm_epsilon=hf_config.rms_norm_eps, position_embedding_type="rope",
        rotary_base=hf_config.rope_parameters["rope_theta"], rotary_percent=1.0, rotary_interleaved=False,
        untie_embeddings_and_output_weights=not hf_config.tie_word_embeddings,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        num_layers_per_virtual_pipeline_stage=(LAYERS // pp // vpp) if vpp else None,
        num_layer_list=layers, params_dtype=torch.float32,
    )


def hf_to_mcore_tp1(model) -> dict[str, torch.Tensor]:
    """HF Llama/Qwen2/Qwen3 weights under Megatron-Core local-spec names (TP1, PP1)."""
    cfg = model.config
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    groups, heads = cfg.num_key_value_heads, cfg.num_attention_heads
    hpg = heads // groups

    def pad_vocab(w):
        return torch.cat([w, w.new_zeros(PADDED_VOCAB - w.shape[0], *w.shape[1:])])

    def qkv(q, k, v):  # per query group: [q heads of the group; k; v]
        q = q.reshape(groups, hpg * HEAD_DIM, *q.shape[1:])
        k = k.reshape(groups, HEAD_DIM, *k.shape[1:])
        v = v.reshape(groups, HEAD_DIM, *v.shape[1:])
        return torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[2:])

    out = {"embedding.word_embeddings.weight": pad_vocab(sd["model.embed_tokens.weight"])}
    for i in range(cfg.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = sd[h + "input_layernorm.weight"]
        a = h + "self_attn."
        out[m + "self_attention.linear_qkv.weight"] = qkv(
            sd[a + "q_proj.weight"], sd[a + "k_proj.weight"], sd[a + "v_proj.weight"])
        if a + "q_proj.bias" in sd:
            out[m + "self_attention.linear_qkv.bias"] = qkv(
                sd[a + "q_proj.bias"], sd[a + "k_proj.bias"], sd[a + "v_proj.bias"])
        if a + "q_norm.weight" in sd:
            out[m + "self_attention.q_layernorm.weight"] = sd[a + "q_norm.weight"]
            out[m + "self_attention.k_layernorm.weight"] = sd[a + "k_norm.weight"]
        out[m + "self_attention.linear_proj.weight"] = sd[a + "o_proj.weight"]
        out[m + "pre_mlp_layernorm.weight"] = sd[h + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([sd[h + "mlp.gate_proj.weight"], sd[h + "mlp.up_proj.weight"]])
        out[m + "mlp.linear_fc2.weight"] = sd[h + "mlp.down_proj.weight"]
    out["decoder.final_layernorm.weight"] = sd["model.norm.weight"]
    if not cfg.tie_word_embeddings:
        out["output_layer.weight"] = pad_vocab(sd["lm_head.weight"])
    return out


# ------------------------------------------------------------------------------------------------
# Megatron TP / PP splitting (the test's own, from Megatron's layouts) and the legacy writer
# ------------------------------------------------------------------------------------------------


def tp_shard(name: str, w: torch.Tensor, tp: int, rank: int, groups: int) -> torch.Tensor:
    if tp == 1 or name.endswith("layernorm.weight"):  # norms (incl. q/k_layernorm) replicated
        return w.clone()
    if "linear_qkv" in name:  # split by query groups; each group's [q; k; v] block stays whole
        return w.reshape(groups, -1, *w.shape[1:]).chunk(tp, dim=0)[rank].reshape(-1, *w.shape[1:]).clone()
    if "linear_fc1" in name:  # [gate; up] -> [gate_shard; up_shard] per rank
        gate, up = w.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]]).clone()
    if "linear_proj" in name or "linear_fc2" in name:  # row parallel: split the input dim
        return w.chunk(tp, dim=1)[rank].clone()
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):  # vocab parallel rows
        return w.chunk(tp, dim=0)[rank].clone()
    raise KeyError(f"no TP rule for {name}")


def stage_layers(pp: int, vpp, layers) -> dict[tuple[int, int], list[int]]:
    """(pp_rank, vp_stage) -> global layer ids; virtual stages in model order vp * pp + pp_rank."""
    n_stages = pp * (vpp or 1)
    counts = [int(x) for x in layers.split(",")] if layers else [LAYERS // n_stages] * n_stages
    out, start = {}, 0
    for s, n in enumerate(counts):
        out[(s % pp, s // pp)] = list(range(start, start + n))
        start += n
    return out


def split_checkpoint(full: dict, tp: int, pp: int, vpp, layers, groups: int, tied: bool):
    """{(tp_rank, pp_rank): {"model" | "model{i}": state_dict}} in Megatron's layout."""
    n_vp = vpp or 1
    assign = stage_layers(pp, vpp, layers)
    shards = {}
    for t in range(tp):
        for p in range(pp):
            chunks = {}
            for v in range(n_vp):
                first, last = (p, v) == (0, 0), (p, v) == (pp - 1, n_vp - 1)
                sd = {}
                if first:
                    sd["embedding.word_embeddings.weight"] = full["embedding.word_embeddings.weight"]
                for local, glob in enumerate(assign[(p, v)]):
                    prefix = f"decoder.layers.{glob}."
                    for k, w in full.items():
                        if k.startswith(prefix):
                            sd[f"decoder.layers.{local}." + k[len(prefix):]] = w
                if last:
                    sd["decoder.final_layernorm.weight"] = full["decoder.final_layernorm.weight"]
                    if not tied:
                        sd["output_layer.weight"] = full["output_layer.weight"]
                    elif not first:  # tied + pp > 1: the last stage holds its own copy
                        sd["output_layer.weight"] = full["embedding.word_embeddings.weight"]
                sd = {k: tp_shard(k, w, tp, t, groups) for k, w in sd.items()}
                chunks[f"model{v}" if vpp else "model"] = sd
            shards[(t, p)] = chunks
    return shards


def write_legacy(root: Path, shards: dict, args: argparse.Namespace, pp: int, iteration="release") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    ckpt_dir = read_latest_dir(root)
    for (t, p), chunks in shards.items():
        path = shard_path(ckpt_dir, t, p, pp)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({**chunks, "checkpoint_version": 3.0, "iteration": 0, "args": args}, path)
    return root


# ------------------------------------------------------------------------------------------------
# One spawn for everything
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("mcore_harness")
    torch.manual_seed(0)
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    jobs, index, hf = [], {}, {}
    for seed, arch in enumerate(ARCHS):
        model = make_hf_model(arch, base / f"hf_{arch}", seed)
        hf[arch] = model
        full = hf_to_mcore_tp1(model)
        cfg = model.config
        layouts = dict(LAYOUTS, **(EXTRA_LAYOUTS if arch == "qwen2" else {}))
        for lname, (tp, pp, vpp, layers) in layouts.items():
            shards = split_checkpoint(full, tp, pp, vpp, layers, cfg.num_key_value_heads, cfg.tie_word_embeddings)
            args = megatron_args(arch, cfg, tp, pp, vpp, layers)
            root = write_legacy(base / f"{arch}_{lname}", shards, args, pp,
                                iteration=7 if lname == "tp2" else "release")
            index[(arch, lname)] = len(jobs)
            jobs.append(dict(ckpt_root=root, input_ids=input_ids, tp=tp, pp=pp, backward=True))
    # mcore's own key list for the Qwen2-like model, to compare with the split helper
    qcfg = hf["qwen2"].config
    for lname in ("tp1", "tp2", "pp2", "pp2vpp2"):
        tp, pp, vpp, layers = dict(LAYOUTS, **EXTRA_LAYOUTS)[lname]
        index[("keys", lname)] = len(jobs)
        jobs.append(dict(kind="keys", args=megatron_args("qwen2", qcfg, tp, pp, vpp, layers), tp=tp, pp=pp))
    t0 = time.monotonic()
    results = mcore_run_many(jobs, world_size=2, timeout_s=600)
    print(f"\n{len(jobs)} harness jobs in one 2-rank spawn: {time.monotonic() - t0:.1f}s")
    return {"results": {k: results[i] for k, i in index.items()}, "input_ids": input_ids, "base": base, "hf": hf}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_tp1_matches_hf(runs, arch):
    """The harness's TP1 Megatron model is the HF model (rope, norms, qkv layout, SwiGLU)."""
    ref = hf_reference_logits(runs["base"] / f"hf_{arch}", runs["input_ids"])
    got = runs["results"][(arch, "tp1")]["logits"]
    assert got.shape == (BATCH, SEQ, PADDED_VOCAB) and got.dtype == torch.float32
    assert ref.abs().max() > 1.0  # not a degenerate model
    torch.testing.assert_close(got[..., :VOCAB], ref, atol=1e-4, rtol=1e-4)
    assert torch.all(got[..., VOCAB:] == 0)  # zero padded vocab rows


def _pairs():
    for arch in ARCHS:
        for lname in dict(LAYOUTS, **(EXTRA_LAYOUTS if arch == "qwen2" else {})):
            if lname != "tp1":
                yield arch, lname


@pytest.mark.parametrize("arch,layout", list(_pairs()))
def test_layout_matches_tp1(runs, arch, layout):
    """Logits, loss and every parameter's gradient norm agree with TP1/PP1."""
    ref, got = runs["results"][(arch, "tp1")], runs["results"][(arch, layout)]
    torch.testing.assert_close(got["logits"], ref["logits"], atol=ATOL, rtol=ATOL)
    assert got["loss"] == pytest.approx(ref["loss"], abs=ATOL)
    assert ref["loss"] > 0.5
    torch.testing.assert_close(got["embedding_grad"], ref["embedding_grad"], atol=1e-6, rtol=1e-4)
    assert got["grad_sq_norms"].keys() == ref["grad_sq_norms"].keys()
    for name, value in ref["grad_sq_norms"].items():
        assert got["grad_sq_norms"][name] == pytest.approx(value, rel=1e-4, abs=1e-12), name
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert all(v > 0 for v in ref["grad_sq_norms"].values())  # every parameter got a gradient


def test_gradient_is_the_true_gradient(runs):
    """TP1 embedding gradient equals autograd through the HF model for the same mean next-token CE."""
    model = runs["hf"]["qwen2"]
    ids = runs["input_ids"]
    model.zero_grad()
    logits = model(input_ids=ids, use_cache=False).logits
    # Megatron takes the softmax over the padded vocab (zero logits for the zero padded rows)
    logits = torch.cat([logits, logits.new_zeros(*logits.shape[:-1], PADDED_VOCAB - VOCAB)], dim=-1)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, PADDED_VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    got = runs["results"][("qwen2", "tp1")]
    assert got["loss"] == pytest.approx(loss.item(), abs=1e-5)
    emb = model.model.embed_tokens.weight.grad
    torch.testing.assert_close(got["embedding_grad"][:VOCAB], emb, atol=1e-6, rtol=1e-4)
    q = model.model.layers[1].self_attn.o_proj.weight.grad
    assert got["grad_sq_norms"]["decoder.layers.1.self_attention.linear_proj.weight"] == pytest.approx(
        float(q.double().pow(2).sum()), rel=1e-4)


def test_split_helper_writes_exactly_mcore_keys(runs):
    """The test's split helper produces the keys and shapes mcore builds (minus ``_extra_state``)."""
    for lname in ("tp1", "tp2", "pp2", "pp2vpp2"):
        expected = runs["results"][("keys", lname)]
        ckpt_dir = read_latest_dir(runs["base"] / f"qwen2_{lname}")
        tp, pp = LAYOUTS.get(lname, EXTRA_LAYOUTS.get(lname))[:2]
        assert set(expected) == {(t, p) for t in range(tp) for p in range(pp)}
        for (t, p), chunks in expected.items():
            shard = load_shard(shard_path(ckpt_dir, t, p, pp))
            for key, names in chunks.items():
                want = {k: v for k, v in names.items() if not k.endswith("_extra_state")}
                assert {k: tuple(v.shape) for k, v in shard[key].items()} == want, (lname, t, p, key)
                assert all(v is None for k, v in names.items() if k.endswith("_extra_state"))


def test_expected_key_listing(runs):
    """Print mcore's own key list (run with -s) for the converter to match."""
    for lname in ("tp1", "tp2", "pp2"):
        for (t, p), chunks in runs["results"][("keys", lname)].items():
            for key, names in chunks.items():
                print(f"\n# qwen2-like {lname} tp_rank={t} pp_rank={p} [{key}]")
                for k, v in names.items():
                    print(f"  {k}: {v}")
    first = runs["results"][("keys", "pp2")][(0, 0)]["model"]
    last = runs["results"][("keys", "pp2")][(0, 1)]["model"]
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert "output_layer.weight" in last and "embedding.word_embeddings.weight" not in last


def test_strict_load_failure_surfaces(tmp_path):
    """A wrong key name on one rank fails with that rank's traceback, without hanging the others."""
    model = make_hf_model("llama", tmp_path / "hf", seed=5)
    full = hf_to_mcore_tp1(model)
    shards = split_checkpoint(full, 2, 1, None, None, 4, True)
    sd = shards[(1, 0)]["model"]
    sd["decoder.layers.0.mlp.linear_fc1.weight_typo"] = sd.pop("decoder.layers.0.mlp.linear_fc1.weight")
    root = write_legacy(tmp_path / "bad", shards, megatron_args("llama", model.config, 2, 1, None, None), 1)
    with pytest.raises(HarnessError) as err:
        mcore_run_many([dict(ckpt_root=root, input_ids=torch.zeros(1, 4, dtype=torch.long), tp=2, pp=1)],
                       timeout_s=120)
    text = str(err.value)
    assert "timed out" not in text  # rank 0, stuck in a TP collective, was not waited for
    assert text.index("----- rank1.err") < text.find("----- rank0.err") or "rank0.err" not in text  # cause first
    assert 'Unexpected key(s) in state_dict: "decoder.layers.0.mlp.linear_fc1.weight_typo"' in text
    assert "mp_rank_01/model_optim_rng.pt [model]" in text and "Traceback" in text
