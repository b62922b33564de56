"""`posttrain convert`: layouts checked by hand, bit-identical round trips, the seed's TP4 x PP2
layout, direct loads of Megatron checkpoints, and every bad input refused with nothing left behind.

The numeric check against Megatron-Core's own GPTModel is tests/megatron/test_against_megatron_core.py.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.cli import main
from posttrain.models.mcore import mcore_files, splits

MG_TO_HF = ["convert", "--load-model-type", "mg", "--save-model-type", "hf"]
HF_TO_MG = ["convert", "--load-model-type", "hf", "--save-model-type", "mg"]


def to_mg(hf: Path, out: Path, tp: int = 1, pp: int = 1, *extra: str) -> int:
    return main([*HF_TO_MG, "--load-dir", str(hf), "--save-dir", str(out), "--target-tensor-parallel-size", str(tp),
                 "--target-pipeline-parallel-size", str(pp), *extra])


def rank_state(root: Path, tp_rank: int, pp_rank: int, pp: int, key: str = "model") -> dict:
    path = root / "release" / mcore_files.rank_dir_name(tp_rank, pp_rank, pp) / mcore_files.RANK_FILE
    return mcore_files.load_rank_file(path)[key]


def leftovers(path: Path) -> list[str]:
    return [p.name for p in path.rglob("*") if ".tmp" in p.name or p.name.startswith(".posttrain-convert-")]


# ---- layouts, by hand ----------------------------------------------------------------------------

def test_qkv_rows_are_grouped_per_query_group_and_split_by_groups():
    heads, groups, hd = 4, 2, 1  # two q heads per group, one row per head
    q = torch.tensor([[10.], [11.], [12.], [13.]])  # heads 0,1 in group 0; 2,3 in group 1
    k = torch.tensor([[20.], [21.]])
    v = torch.tensor([[30.], [31.]])
    whole = splits.split_qkv(q, k, v, groups, tp=1)[0]
    assert whole.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    r0, r1 = splits.split_qkv(q, k, v, groups, tp=2)
    assert r0.flatten().tolist() == [10, 11, 20, 30] and r1.flatten().tolist() == [12, 13, 21, 31]
    assert all(torch.equal(a, b) for a, b in zip(splits.merge_qkv([r0, r1], heads, groups, hd), (q, k, v)))


def test_gated_fc1_holds_gate_then_up_per_rank_and_vocab_is_padded_with_zeros():
    gate, up = torch.arange(4.).view(4, 1), torch.arange(10., 14.).view(4, 1)
    r0, r1 = splits.split_gated_fc1(gate, up, tp=2)
    assert r0.flatten().tolist() == [0, 1, 10, 11] and r1.flatten().tolist() == [2, 3, 12, 13]
    assert splits.padded_vocab_size(100, 128, 2) == 256 and splits.padded_vocab_size(256, 128, 2) == 256
    emb = torch.ones(100, 3)
    shards = splits.split_vocab(emb, 256, 2)
    assert [s.shape[0] for s in shards] == [128, 128] and shards[1][100 - 128:].abs().sum() == 0
    assert torch.equal(splits.merge_vocab(shards, 100), emb)


def test_pipeline_stages_even_uneven_and_virtual():
    assert mcore_files.pipeline_stages(4, 2) == (((0, 1),), ((2, 3),))
    assert mcore_files.pipeline_stages(4, 2, "1,3") == (((0,),), ((1, 2, 3),))
    # virtual stages of 1 layer: chunk c of stage r holds layer c * pp + r
    assert mcore_files.pipeline_stages(4, 2, layers_per_virtual_stage=1) == (((0,), (2,)), ((1,), (3,)))


# ---- round trips -------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3", "qwen2_rm"])
def test_hf_to_tp2_pp2_and_back_is_bit_identical(tiny_hf, tmp_path, kind):
    hf = tiny_hf(kind)
    orm = ["--orm"] if kind.endswith("_rm") else []
    assert to_mg(hf, tmp_path / "mg", 2, 2, *orm) == 0
    assert (tmp_path / "mg" / mcore_files.TRACKER).read_text().strip() == "release"
    # each rank file holds only its share (a saved slice view would drag its whole tensor along)
    sharded = sum(p.stat().st_size for p in (tmp_path / "mg").rglob(mcore_files.RANK_FILE))
    assert sharded < 1.3 * (hf / "model.safetensors").stat().st_size
    template = tmp_path / "orig"
    shutil.copytree(hf, template)
    assert main([*MG_TO_HF, "--load-dir", str(tmp_path / "mg"), "--save-dir", str(template)]) == 0
    before, after = load_file(hf / "model.safetensors"), load_file(template / "mg2hf" / "model.safetensors")
    assert before.keys() == after.keys()
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
    assert leftovers(tmp_path) == []


def test_converted_back_model_loads_and_gives_the_same_logits(tiny_hf, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = tiny_hf("llama")
    assert to_mg(hf, tmp_path / "mg", 2, 2, "--params-dtype", "fp32") == 0
    out = tmp_path / "back"  # not an HF dir: config.json is built from the checkpoint's args
    assert main([*MG_TO_HF, "--load-dir", str(tmp_path / "mg"), "--save-dir", str(out)]) == 0
    ids = torch.randint(0, 100, (2, 9))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)(ids).logits
        got = AutoModelForCausalLM.from_pretrained(out / "mg2hf", dtype=torch.float32)(ids).logits
    assert torch.equal(ref, got)
    config = json.loads((out / "mg2hf" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == 100
    card = (out / "mg2hf" / "README.md").read_text()  # the model card names where it came from
    assert card.startswith("---\nbase_model:") and str(tmp_path / "mg") in card and "converted" in card


def test_virtual_and_uneven_pipeline_stages_round_trip(tiny_hf, tmp_path):
    hf = tiny_hf("qwen2")
    for name, extra in (("vpp", ["--num-layers-per-virtual-pipeline-stage", "1"]), ("uneven", ["--num-layer-list", "1,3"])):
        out = tmp_path / name
        assert to_mg(hf, out, 1, 2, *extra) == 0
        if name == "vpp":
            file = mcore_files.load_rank_file(out / "release" / "mp_rank_00_001" / mcore_files.RANK_FILE)
            assert {"model0", "model1"} <= set(file) and "model" not in file
            assert "output_layer.weight" in file["model1"] and "embedding.word_embeddings.weight" not in file["model0"]
        else:
            assert sum(k.endswith("linear_fc2.weight") for k in rank_state(out, 0, 1, 2)) == 3
        assert main([*MG_TO_HF, "--load-dir", str(out), "--save-dir", str(out)]) == 0
        a, b = load_file(hf / "model.safetensors"), load_file(out / "mg2hf" / "model.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in a) and a.keys() == b.keys()


def test_bf16_params_dtype_casts_every_tensor(tiny_hf, tmp_path):
    assert to_mg(tiny_hf("qwen3"), tmp_path / "mg", 1, 1, "--params-dtype", "bf16") == 0
    file = mcore_files.load_rank_file(tmp_path / "mg" / "release" / "mp_rank_00" / mcore_files.RANK_FILE)
    assert {t.dtype for t in file["model"].values()} == {torch.bfloat16}
    assert file["args"].params_dtype == torch.bfloat16 and file["args"].bf16 is True


def test_the_seeds_qwen25_7b_layout_tp4_pp2_on_a_shrunk_model(tmp_path):
    """configs/r1_zero_qwen25_7b.yaml: TP 4 x PP 2 on Qwen2.5-7B (28 heads in 4 query groups, q/k/v
    biases, untied). Shrunk: head_dim 4, FFN 224, 4 layers, vocab 1000."""
    import yaml
    from transformers import Qwen2Config, Qwen2ForCausalLM

    seed = yaml.safe_load(Path("configs/r1_zero_qwen25_7b.yaml").read_text())["actor_config"]
    tp, pp = seed["tensor_model_parallel_size"], seed["pipeline_model_parallel_size"]
    model = yaml.safe_load(Path("configs/model/qwen25_7b.yaml").read_text())["qwen25_7b"]
    assert (tp, pp) == (4, 2)
    config = Qwen2Config(vocab_size=1000, hidden_size=model["num_attention_heads"] * 4, intermediate_size=224,
                         num_hidden_layers=4, num_attention_heads=model["num_attention_heads"],
                         num_key_value_heads=model["num_query_groups"], tie_word_embeddings=False,
                         rope_theta=model["rotary_base"])
    torch.manual_seed(0)
    hf = tmp_path / "qwen25_shrunk"
    Qwen2ForCausalLM(config).save_pretrained(hf)
    assert to_mg(hf, tmp_path / "mg", tp, pp, "--add-qkv-bias", "--params-dtype", "bf16") == 0
    h, hd, groups = config.hidden_size, 4, model["num_query_groups"]
    qkv_rows = groups // tp * (config.num_attention_heads // groups + 2) * hd  # one query group per rank
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            state = rank_state(tmp_path / "mg", tp_rank, pp_rank, pp)
            assert state["decoder.layers.1.self_attention.linear_qkv.weight"].shape == (qkv_rows, h)
            assert state["decoder.layers.1.self_attention.linear_qkv.bias"].shape == (qkv_rows,)
            assert state["decoder.layers.1.self_attention.linear_proj.weight"].shape == (h, h // tp)
            assert state["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * 224 // tp, h)
            assert state["decoder.layers.0.mlp.linear_fc2.weight"].shape == (h, 224 // tp)
            assert ("embedding.word_embeddings.weight" in state) == (pp_rank == 0)
            assert ("output_layer.weight" in state) == (pp_rank == 1)
            if pp_rank == 1:
                assert state["output_layer.weight"].shape == (1024 // tp, h)  # 1000 padded to 128 x 4
            assert not any(k.startswith("decoder.layers.2") for k in state)
    assert main([*MG_TO_HF, "--load-dir", str(tmp_path / "mg"), "--save-dir", str(hf), "--params-dtype", "bf16"]) == 0
    a, b = load_file(hf / "model.safetensors"), load_file(hf / "mg2hf" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k].bfloat16(), b[k]) for k in a)


def test_args_namespace_describes_the_model_and_split(tiny_hf, tmp_path):
    from posttrain.models.arch import arch_from_hf_config

    hf = tiny_hf("qwen2")
    assert to_mg(hf, tmp_path / "mg", 2, 2) == 0
    it_dir = mcore_files.iteration_dir(tmp_path / "mg")
    args = mcore_files.read_args(it_dir)
    assert tuple(vars(args)) == mcore_files.ARGS_KEYS
    assert mcore_files.arch_from_args(args, it_dir) == arch_from_hf_config(hf)
    par = mcore_files.parallel_from_args(args, it_dir)
    assert (par.tp, par.pp, args.padded_vocab_size, args.checkpoint_version if hasattr(args, "checkpoint_version")
            else 3.0) == (2, 2, 256, 3.0)


# ---- loading a Megatron checkpoint where posttrain loads a model --------------------------------

def test_a_megatron_checkpoint_loads_directly_through_a_cache(tiny_hf, tmp_path, monkeypatch, capsys):
    from posttrain.models.loading import load_causal_lm, resolve_model

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    assert to_mg(tiny_hf("qwen2"), tmp_path / "mg", 2, 1) == 0
    capsys.readouterr()
    path, full = resolve_model(tmp_path / "mg")
    assert not full and path.parent == tmp_path / "cache" / "mcore2hf"
    assert "converting it once" in capsys.readouterr().err
    assert resolve_model(tmp_path / "mg")[0] == path
    assert "cached in" in capsys.readouterr().err
    model = load_causal_lm(tmp_path / "mg")
    ref = load_causal_lm(tiny_hf("qwen2"))
    ids = torch.randint(0, 100, (1, 7))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_a_directory_that_is_neither_hf_nor_megatron_says_what_it_holds(tmp_path):
    from posttrain.checkpoint import resolve_checkpoint
    from posttrain.errors import CheckpointError

    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match=r"holds: notes.txt.*Megatron checkpoint.*posttrain convert"):
        resolve_checkpoint(tmp_path)


# ---- bad input ---------------------------------------------------------------------------------

def refused(capsys, argv, pattern):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert pytest.importorskip("re").search(pattern, err), err


@pytest.mark.parametrize("tp,pattern", [(3, "does not divide the model's 4 attention heads"),
                                         (4, "does not divide the model's 2 query groups")])
def test_a_tp_size_that_does_not_divide_heads_or_groups_is_refused(tiny_hf, tmp_path, capsys, tp, pattern):
    refused(capsys, [*HF_TO_MG, "--load-dir", str(tiny_hf("qwen2")), "--save-dir", str(tmp_path / "mg"),
                     "--target-tensor-parallel-size", str(tp)], pattern)
    assert not (tmp_path / "mg").exists() or leftovers(tmp_path) == []


def test_a_layer_list_that_does_not_sum_to_the_layers_is_refused(tiny_hf, tmp_path, capsys):
    refused(capsys, [*HF_TO_MG, "--load-dir", str(tiny_hf("qwen2")), "--save-dir", str(tmp_path / "mg"),
                     "--target-pipeline-parallel-size", "2", "--num-layer-list", "1,2"],
            "sums to 3 layers but the model has 4")
    refused(capsys, [*HF_TO_MG, "--load-dir", str(tiny_hf("qwen2")), "--save-dir", str(tmp_path / "mg"),
                     "--target-pipeline-parallel-size", "3"], "does not divide the model's 4 layers")


def test_a_vocabulary_divisor_below_one_is_refused(tiny_hf, tmp_path, capsys):
    refused(capsys, [*HF_TO_MG, "--load-dir", str(tiny_hf("llama")), "--save-dir", str(tmp_path / "mg"),
                     "--make-vocab-size-divisible-by", "0"], "make-vocab-size-divisible-by must be a positive")


def test_a_missing_shard_and_shards_from_two_saves_are_named(tiny_hf, tmp_path, capsys):
    mg = tmp_path / "mg"
    assert to_mg(tiny_hf("qwen2"), mg, 2, 1) == 0
    rank1 = mg / "release" / "mp_rank_01" / mcore_files.RANK_FILE
    saved = rank1.read_bytes()
    rank1.unlink()
    refused(capsys, [*MG_TO_HF, "--load-dir", str(mg), "--save-dir", str(tmp_path / "out")],
            r"mp_rank_01/model_optim_rng.pt is missing")
    obj = torch.load(__import__("io").BytesIO(saved), weights_only=False)
    obj["iteration"] = 7
    torch.save(obj, rank1)
    refused(capsys, [*MG_TO_HF, "--load-dir", str(mg), "--save-dir", str(tmp_path / "out")],
            r"mp_rank_01/model_optim_rng.pt is from iteration 7 but .*mp_rank_00.* iteration 0")
    assert not (tmp_path / "out" / "mg2hf").exists() and leftovers(tmp_path) == []


def test_a_checkpoint_whose_padded_vocabulary_does_not_fit_tp_is_refused(tiny_hf, tmp_path, capsys):
    mg = tmp_path / "mg"
    assert to_mg(tiny_hf("qwen2"), mg, 2, 1) == 0
    for rank in (0, 1):
        path = mg / "release" / f"mp_rank_0{rank}" / mcore_files.RANK_FILE
        obj = torch.load(path, weights_only=False)
        obj["args"].make_vocab_size_divisible_by = 100  # 256 is not a multiple of 100 x 2
        torch.save(obj, path)
    refused(capsys, [*MG_TO_HF, "--load-dir", str(mg), "--save-dir", str(tmp_path / "out")],
            "padded vocabulary 256 is not a multiple of make_vocab_size_divisible_by x TP = 100 x 2")


def test_unsupported_architectures_are_refused(tiny_hf, tmp_path, capsys):
    moe = tmp_path / "moe"
    shutil.copytree(tiny_hf("qwen2"), moe)
    config = json.loads((moe / "config.json").read_text())
    (moe / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_moe", "num_experts": 8}))
    refused(capsys, [*HF_TO_MG, "--load-dir", str(moe), "--save-dir", str(tmp_path / "a")], "mixture-of-experts")
    (moe / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    refused(capsys, [*HF_TO_MG, "--load-dir", str(moe), "--save-dir", str(tmp_path / "b")],
            "model_type 'gpt2' is not supported")
    refused(capsys, [*HF_TO_MG, "--load-dir", str(tiny_hf("qwen2_rm")), "--save-dir", str(tmp_path / "c")],
            "add --orm")


def test_a_target_that_holds_a_checkpoint_is_refused_unless_force(tiny_hf, tmp_path, capsys):
    mg = tmp_path / "mg"
    (mg / "keep.txt").parent.mkdir()
    (mg / "keep.txt").write_text("mine")
    assert to_mg(tiny_hf("qwen2"), mg) == 0
    refused(capsys, [*HF_TO_MG, "--load-dir", str(tiny_hf("qwen2")), "--save-dir", str(mg)],
            "already holds a Megatron checkpoint.*--force")
    assert to_mg(tiny_hf("llama"), mg, 1, 1, "--force") == 0
    assert mcore_files.read_args(mg / "release").hf_model_type == "llama" and (mg / "keep.txt").read_text() == "mine"
    out = tmp_path / "hf"
    assert main([*MG_TO_HF, "--load-dir", str(mg), "--save-dir", str(out)]) == 0
    refused(capsys, [*MG_TO_HF, "--load-dir", str(mg), "--save-dir", str(out)], "not empty.*--force")
    assert main([*MG_TO_HF, "--load-dir", str(mg), "--save-dir", str(out), "--force"]) == 0
    assert leftovers(tmp_path) == []


def test_the_seeds_unimplemented_flags_are_refused_by_name_and_its_no_ops_accepted(tiny_hf, tmp_path, capsys):
    base = [*HF_TO_MG, "--load-dir", str(tiny_hf("qwen2")), "--save-dir", str(tmp_path / "mg")]
    refused(capsys, [*base, "--moe-tp-extend-ep"], "--moe-tp-extend-ep: mixture-of-experts")
    refused(capsys, [*base, "--lora-r", "8"], "--lora-r: LoRA weights are not converted")
    refused(capsys, [*base, "--target-expert-model-parallel-size", "2"], "expert-model-parallel-size")
    refused(capsys, [*MG_TO_HF, "--load-dir", "x", "--save-dir", "y", "--target-tensor-parallel-size", "2"],
            "must be 1")
    # the seed's tutorial command, as written (Qwen2.5 passes --model-type-hf llama2)
    assert main([*base, "--use-mcore-models", "--model-type", "GPT", "--model-type-hf", "llama2",
                 "--add-qkv-bias", "--max-queue-size", "50", "--no-checking", "--tokenizer-model",
                 str(tiny_hf("qwen2") / "config.json")]) == 0
    assert "--use-mcore-models, --model-type-hf, --max-queue-size, --no-checking, --tokenizer-model accepted" in \
        capsys.readouterr().err


class _CallsPrint:
    """Unpickling this would call a builtin: code, not data (some libraries allow-list pathlib globally)."""

    def __reduce__(self):
        return print, ("unpickled code ran",)


def test_pickled_code_in_a_rank_file_is_refused_with_the_file_named(tmp_path, capsys):
    evil = tmp_path / "mg" / "release" / "mp_rank_00"
    evil.mkdir(parents=True)
    (tmp_path / "mg" / mcore_files.TRACKER).write_text("release")
    torch.save({"model": {}, "args": argparse.Namespace(num_layers=1), "hook": _CallsPrint()},
               evil / mcore_files.RANK_FILE)
    refused(capsys, [*MG_TO_HF, "--load-dir", str(tmp_path / "mg"), "--save-dir", str(tmp_path / "out")],
            r"mp_rank_00/model_optim_rng.pt: refused to unpickle it")


def test_the_ppo_critic_starts_from_a_megatron_reward_checkpoint(tiny_hf, tmp_path, monkeypatch):
    """`--orm` output (backbone + rm_head) loads as posttrain's value model with the same values."""
    from posttrain.roles.critic import build_value_model

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    assert to_mg(tiny_hf("qwen2_rm"), tmp_path / "rm", 2, 2, "--orm") == 0
    ids = torch.randint(1, 100, (2, 6))
    with torch.no_grad():
        got = build_value_model(str(tmp_path / "rm"), "cpu")(ids)
        ref = build_value_model(str(tiny_hf("qwen2_rm")), "cpu")(ids)
    assert got.abs().sum() > 0 and torch.equal(got, ref)
