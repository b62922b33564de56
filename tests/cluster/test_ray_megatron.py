"""GRPO on the Megatron-Core backend (Ray worker groups, gloo) against the HF backend in one process.

A whole run of 2 iterations (a reference in the loss, 2 mini-batches per iteration) at TP 2, at
PP 2 and at TP 2 x PP 2 draws the same responses and gives every optimizer step the same pg_loss,
KL, entropy, clip fraction and grad norm within 1e-4 relative, and every logged metric but the
wall-clock ones likewise: the layouts, the vocab-parallel log-probs, the data-parallel token counts,
the LR schedule and the weight sync to the rollout (``timing/resharding_to_infer``) all agree with
the HF engine.
"""

from __future__ import annotations

import pytest
import torch

from tests.cluster.cluster_helpers import grpo_config, record_run
from tests.cluster.test_ray_grpo import DAPO, PARTIAL, PPO, assert_same_state, is_wall_clock
from tests.cluster.test_ray_offline import assert_same_rows, offline_config, offline_data  # noqa: F401 (a fixture)
from tests.helpers.runs import read_metrics

pytestmark = [pytest.mark.ray, pytest.mark.slow]
RAY_CPUS = 4  # TP 2 x PP 2: 4 workers (logical CPUs; one torch thread each)
RL = {"init_kl_coef": 0.05, "guarantee_order": True}
TRAIN = {"lr_decay_style": "cosine", "lr_warmup_fraction": 0.25, "min_lr": 3e-4}


@pytest.fixture(scope="module")
def model(work):
    """The cluster tests' model without ``pad_token_id`` in its config.json: HF gives the pad token's
    embedding row ``padding_idx`` (its lookup gets no gradient) and Megatron's embedding has no such
    row, so a sampled response holding the pad token (this random model samples it) would train
    differently on the two backends (docs/parallelism.md). Real checkpoints such as Qwen2.5 set none."""
    import json
    import shutil

    out = work / "model_no_pad_row"
    if not out.exists():
        shutil.copytree(work / "model", out)
        config = json.loads((out / "config.json").read_text())
        config.pop("pad_token_id", None)
        (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def hf_run(ray_cluster, work, model):
    """The same run on the HF backend in one process."""
    return record_run(grpo_config(work, "mg_hf", workers=1, iters=2, rl=RL,
                                  train={**TRAIN, "tokenizer_name_or_path": str(model)}))


PACKED = {"use_remove_padding": True, "use_dynamic_bsz": True, "max_packing_token_size": 64,
          "update_max_packing_token_size": 48}


@pytest.mark.parametrize("tp,pp,dp,extra,rl", [
    (2, 1, 1, {}, {}), (1, 2, 1, {}, {}), (2, 2, 1, {}, {}), (1, 1, 2, {}, {}),
    (2, 1, 2, {}, {"use_dp_batch_balance": True}),
    (2, 1, 1, {"recompute_granularity": "full"}, {"offload_reference": True}),
    (2, 2, 1, {"no_pad_to_seq_lengths": True, "reset_attention_mask": True}, PACKED),
    (2, 1, 1, {"sequence_parallel": True}, {})],
    ids=["tp2", "pp2", "tp2xpp2", "dp2", "tp2xdp2-balanced", "tp2-recompute-offloaded-reference", "tp2xpp2-packed-token-budgets",
         "tp2-sequence-parallel"])
def test_grpo_on_the_megatron_backend_equals_the_hf_backend(hf_run, work, model, tp, pp, dp, extra, rl):
    """``dp``: data-parallel replicas (each a TP x PP worker group; the rows shared out, the token
    counts and metrics summed over them, Megatron's DDP averaging the gradients; with
    ``use_dp_batch_balance`` the replicas' rows chosen by tokens); ``rl``: packed micro-batches under
    token budgets on the Megatron backend (block-diagonal masks, several rows per packed sequence),
    against the HF backend's padded run."""
    name = f"mg_tp{tp}_pp{pp}_dp{dp}_{len(extra)}_{len(rl)}"
    cfg = grpo_config(work, name, workers=tp * pp * dp, iters=2, rl={**RL, **rl},
                      train={**TRAIN, **extra, "tokenizer_name_or_path": str(model), "tensor_model_parallel_size": tp,
                             "pipeline_model_parallel_size": pp, "backend": "megatron"})
    want_batches, want_rows, want_steps = hf_run
    got_batches, got_rows, got_steps = record_run(cfg)
    assert got_batches == want_batches
    assert len(got_steps) == len(want_steps) == 4  # 2 iterations x 2 mini-batches
    for step, (got, want) in enumerate(zip(got_steps, want_steps)):
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac", "actor/grad_norm",
                    "actor/lr"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (step, key)
    assert want_steps[-1]["actor/kl_loss"] > 0 and want_steps[0]["actor/lr"] != want_steps[-1]["actor/lr"]
    want_rows = [r for r in want_rows if "actor/pg_loss" in r]
    got_rows = [r for r in got_rows if "actor/pg_loss" in r]
    assert [r["iteration"] for r in got_rows] == [1, 2]
    for want, got in zip(want_rows, got_rows):
        assert sorted(k for k in got if k != "timing/resharding_to_infer") == sorted(want)
        assert got["timing/resharding_to_infer"] > 0
        for key in (k for k in want if not is_wall_clock(k)):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (want["iteration"], key)


@pytest.fixture(scope="module")
def model4(work, tiny_tokenizer):
    """A 4-layer Qwen2 (hidden 64, no pad row; see ``model``): 2 pipeline stages of 2 virtual stages."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = work / "model4"
    torch.manual_seed(1)
    config = Qwen2Config(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, eos_token_id=tiny_tokenizer.eos_token_id)
    Qwen2ForCausalLM(config).save_pretrained(out)
    tiny_tokenizer.save_pretrained(out)
    return out


def test_virtual_pipeline_stages_equal_the_hf_backend(ray_cluster, work, model4):
    """PP 2 with one layer per virtual stage (2 model chunks per rank, the interleaved schedule; its
    micro-batches packed, their count padded to a multiple of PP with empty ones): the same run. Its
    checkpoint (the legacy per-rank format here) holds both chunks per rank (``model0``, ``model1``)
    and converts back to HF."""
    from posttrain.cli import main
    from posttrain.models.mcore import mcore_files

    runs, ckpt = {}, work / "mg_vpp_ckpt"
    for name, workers, extra in (("hf", 1, {}), ("vpp", 2, {"pipeline_model_parallel_size": 2,
                                                          "num_layers_per_virtual_pipeline_stage": 1,
                                                          "save": str(ckpt), "save_interval": 2,
                                                          "ckpt_format": "torch"})):
        runs[name] = record_run(grpo_config(work, f"mg_vpp_{name}", workers=workers, iters=2, rl=RL,
                                            train={**TRAIN, **extra, "tokenizer_name_or_path": str(model4)}))
    (want_batches, _, want_steps), (got_batches, got_rows, got_steps) = runs["hf"], runs["vpp"]
    assert got_batches == want_batches and len(got_steps) == len(want_steps) == 4
    for step, (got, want) in enumerate(zip(got_steps, want_steps)):
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (step, key)
    assert [r["iteration"] for r in got_rows if "actor/pg_loss" in r] == [1, 2]
    shard = mcore_files.load_rank_file(ckpt / "iter_0000002" / "mp_rank_00_001" / mcore_files.RANK_FILE)
    assert {"model0", "model1"} <= set(shard) and "model" not in shard
    assert main(["convert", "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(ckpt),
                 "--save-dir", str(work / "mg_vpp_hf")]) == 0


def test_dapo_on_the_megatron_backend_equals_the_hf_backend(ray_cluster, work, model):
    """DAPO (dynamic sampling, clip-higher, token-level loss) at TP 2: the same generation batches,
    kept groups, steps and logged metrics as the HF backend in one process."""
    runs = {}
    for name, workers, extra in (("hf", 1, {}), ("megatron", 2, {"tensor_model_parallel_size": 2})):
        runs[name] = record_run(grpo_config(work, f"mg_dapo_{name}", workers=workers, iters=2, rl={**RL, **DAPO},
                                            train={**TRAIN, **extra, "stage": "ray_dapo",
                                                   "tokenizer_name_or_path": str(model)}))
    (want_batches, want_rows, want_steps), (got_batches, got_rows, got_steps) = runs["hf"], runs["megatron"]
    assert got_batches == want_batches and len(got_steps) == len(want_steps) > 0
    for step, (got, want) in enumerate(zip(got_steps, want_steps)):
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (step, key)
    want_rows = [r for r in want_rows if "actor/pg_loss" in r]
    got_rows = [r for r in got_rows if "actor/pg_loss" in r]
    assert len(got_rows) == len(want_rows) == 2 and "dapo/score/mean" in want_rows[-1]
    for want, got in zip(want_rows, got_rows):
        for key in (k for k in want if not is_wall_clock(k)):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (want["iteration"], key)


def test_partial_and_async_rollout_on_the_megatron_backend_equal_the_hf_backend_and_resume(ray_cluster, work, model):
    """Partial rollout with ``async_staleness: 1`` at TP 2, 3 iterations: the rollout thread samples
    from the leader's rollout copy (a second HF model, loaded with the version the pipeline asks for:
    iteration 3 samples version 1 while update 2 runs in the workers' other thread), and each partial
    rollout's rounds are one call per round to the leader, checked on the driver. The same responses,
    steps and logged metrics as the HF backend in one process, and the same dock saved in the
    Megatron checkpoint of iteration 2 as in the HF one; that checkpoint holds iteration 3's in-flight
    experience, and the megatron run resumed from it trains iteration 3 exactly as the run did."""
    from posttrain.loops.partial_rollout import STATE_FILE
    from posttrain.loops.resume_files import IN_FLIGHT

    rl, tp2 = {**RL, **PARTIAL, "guarantee_order": False, "async_staleness": 1}, {"tensor_model_parallel_size": 2}
    runs = {}
    for name, workers, extra in (("hf", 1, {}), ("megatron", 2, tp2)):
        save = {"save": str(work / f"ckpt_mg_partial_async_{name}"), "save_interval": 2}
        runs[name] = record_run(grpo_config(work, f"mg_partial_async_{name}", workers=workers, iters=3, rl=rl,
                                            train={**TRAIN, **extra, **save, "tokenizer_name_or_path": str(model)}))
    (want_batches, want_rows, want_steps), (got_batches, got_rows, got_steps) = runs["hf"], runs["megatron"]
    assert got_batches == want_batches and len(got_steps) == len(want_steps) == 6
    for step, (got, want) in enumerate(zip(got_steps, want_steps)):
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (step, key)
    want_rows = [r for r in want_rows if "actor/pg_loss" in r]
    got_rows = [r for r in got_rows if "actor/pg_loss" in r]
    assert [r["iteration"] for r in got_rows] == [r["iteration"] for r in want_rows] == [1, 2, 3]
    assert max(r["rollout/age_max"] for r in want_rows) >= 1  # groups waited in the dock: rounds were cut
    assert want_rows[-1]["rollout/staleness_max"] >= 1  # iteration 3 sampled version 1 (or older segments)
    for want, got in zip(want_rows, got_rows):
        for key in (k for k in want if not is_wall_clock(k)):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (want["iteration"], key)
    saved = {name: work / f"ckpt_mg_partial_async_{name}" / "iter_0000002" for name in ("hf", "megatron")}
    assert_same_state(*(torch.load(saved[name] / STATE_FILE, weights_only=True) for name in ("megatron", "hf")))
    assert (saved["megatron"] / IN_FLIGHT).is_file()
    resumed_batches, resumed, resumed_steps = record_run(grpo_config(
        work, "mg_partial_async_resumed", workers=2, iters=3, rl=rl,
        train={**TRAIN, **tp2, "tokenizer_name_or_path": str(model), "load": str(saved["megatron"])}))
    # iteration 3 trains on the saved in-flight experience: the resumed run samples nothing
    assert_resumed_exactly((resumed_batches, resumed, resumed_steps), runs["megatron"], iteration=3, sampled=False)


def test_ppo_on_the_megatron_backend_equals_the_hf_backend(ray_cluster, work, model):
    """PPO (GAE, KL in the reward) with its colocated critic at TP 2 with sequence parallelism (the
    value head on the gathered sequence): the same responses, the same
    actor steps, and every logged metric (the critic's values, value loss and grad norm included).
    The critic is saved in a directory of its own (``critic_config.save``, Megatron's layout at the
    actor's iterations); a run resumed from the first iteration (the critic through
    ``critic_config.load``) takes the second exactly, and saves the critic in ``critic/`` of its
    Megatron checkpoint, which converts with ``--orm`` into a reward-model HF directory (its head
    trained away from the zeros it started at) and resumes."""
    import torch
    from safetensors.torch import load_file

    from posttrain.cli import main

    runs, first, own, ckpt = {}, work / "mg_ppo_first", work / "mg_ppo_own_critic", work / "mg_ppo_ckpt"
    tp2 = {**TRAIN, "tensor_model_parallel_size": 2, "sequence_parallel": True, "stage": "ray_ppo",
           "tokenizer_name_or_path": str(model)}
    saved = {**tp2, "save": str(first), "save_interval": 1}
    for name, workers, extra, critic in (("hf", 1, {}, None), ("megatron", 2, saved, {"save": str(own)})):
        runs[name] = record_run(grpo_config(work, f"mg_ppo_{name}", workers=workers, iters=2, rl={**RL, **PPO},
                                            train={**TRAIN, **extra, "stage": "ray_ppo",
                                                   "tokenizer_name_or_path": str(model)},
                                            sections={"critic_config": critic} if critic else None))
    (want_batches, want_rows, want_steps), (got_batches, got_rows, got_steps) = runs["hf"], runs["megatron"]
    assert got_batches == want_batches and len(got_steps) == len(want_steps) == 4
    for step, (got, want) in enumerate(zip(got_steps, want_steps)):
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (step, key)
    want_rows = [r for r in want_rows if "actor/pg_loss" in r]
    got_rows = [r for r in got_rows if "actor/pg_loss" in r]
    assert len(got_rows) == len(want_rows) == 2
    for want, got in zip(want_rows, got_rows):
        assert all(want[k] > 0 for k in ("critic/vf_loss", "critic/grad_norm"))
        for key in (k for k in want if not is_wall_clock(k)):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (want["iteration"], key)
    assert (own / "iter_0000001" / ".metadata").is_file() and not (first / "iter_0000001" / "critic").exists()
    again = record_run(grpo_config(work, "mg_ppo_again", workers=2, iters=2, rl={**RL, **PPO}, train={
        **tp2, "load": str(first / "iter_0000001"), "save": str(ckpt), "save_interval": 2},
        sections={"critic_config": {"load": str(own / "iter_0000001")}}))
    assert_resumed_exactly(again, runs["megatron"], iteration=2)
    assert (ckpt / "iter_0000002" / "critic" / ".metadata").is_file()
    assert main(["convert", "--load-model-type", "mg", "--save-model-type", "hf", "--orm", "--load-dir",
                 str(ckpt / "iter_0000002" / "critic"), "--save-dir", str(work / "mg_ppo_critic_hf")]) == 0
    head = load_file(str(work / "mg_ppo_critic_hf" / "mg2hf" / "model.safetensors"))["score.weight"]
    assert head.shape[0] == 1 and float(head.abs().max()) > 0
    _, resumed, _ = record_run(grpo_config(work, "mg_ppo_resumed", workers=2, iters=3, rl={**RL, **PPO}, train={
        **tp2, "load": str(ckpt)}))
    resumed = [r for r in resumed if "actor/pg_loss" in r]
    # the critic resumed trained (a fresh zero head would value every token 0), with its LR schedule
    assert [r["iteration"] for r in resumed] == [3] and resumed[0]["critic/values/min"] > 0
    assert resumed[0]["critic/lr"] == resumed[0]["actor/lr"] < got_rows[-1]["actor/lr"]
    assert not torch.equal(head, torch.zeros_like(head))


def assert_resumed_exactly(resumed, straight, *, iteration: int, sampled: bool = True) -> None:
    """A run resumed before ``iteration`` (its last) took the uninterrupted run's ``iteration``:
    the same responses, optimizer steps and logged metrics, wall clock aside. ``sampled``: False
    when the resumed run trains on the checkpoint's in-flight experience alone (it samples nothing)."""
    (batches, rows, steps), (all_batches, all_rows, all_steps) = resumed, straight
    rows = [r for r in rows if "actor/pg_loss" in r]
    want = [r for r in all_rows if "actor/pg_loss" in r and r["iteration"] == iteration]
    assert [r["iteration"] for r in rows] == [iteration] and len(want) == 1
    assert (batches and batches == all_batches[-len(batches):]) if sampled else batches == []
    assert steps
    for got, expected in zip(steps, all_steps[-len(steps):]):
        assert {k: v for k, v in got.items() if not is_wall_clock(k)} == \
            {k: v for k, v in expected.items() if not is_wall_clock(k)}
    assert {k: v for k, v in rows[0].items() if not is_wall_clock(k)} == \
        {k: v for k, v in want[0].items() if not is_wall_clock(k)}


@pytest.mark.parametrize("stage,tp,pp,dp", [("sft", 2, 1, 1), ("dpo", 2, 1, 1), ("dpo", 1, 2, 1), ("dpo", 1, 1, 2)])
def test_offline_stages_on_the_megatron_backend_equal_the_hf_backend(ray_cluster, work, offline_data, stage, tp, pp,
                                                                      dp):
    """SFT's cross-entropy and DPO's pair loss (the reference's pair log-probs, both sides of a pair
    in one micro-batch; with 2 data-parallel replicas, the pairs shared out) through the Megatron
    engine: 2 iterations log what one HF process logs."""
    from posttrain.commands.train import train_config as train

    # padded rows on both sides: the HF backend packs a DPO pair's shared prompt once, the Megatron
    # backend packs every row's, and those sums differ in rounding, which AdamW's first steps
    # (update ~ lr x sign) amplify past the 1e-4 this test holds both backends to
    padded = {"use_remove_padding": False}
    hf = work / f"run_mg_{stage}_hf"
    if not hf.exists():
        train(offline_config(work, offline_data, stage, f"mg_{stage}_hf", workers=1, iters=2, rl_extra=padded))
    name = f"mg_{stage}_tp{tp}_pp{pp}_dp{dp}"
    train(offline_config(work, offline_data, stage, name, workers=tp * pp * dp, iters=2, rl_extra=padded,
                         train_extra={"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                                      "backend": "megatron"}))
    want, got = read_metrics(hf), read_metrics(work / f"run_{name}")
    if stage == "dpo":  # the first step's policy is the reference: its rewards are 0 up to rounding, and
        # the share of pairs whose rounding favours the chosen side is noise (HF's forwards differ from
        # its reference's by ~1e-7, Megatron's are bitwise the same)
        assert abs(want[0]["rewards/chosen"]) < 1e-5 and got[0]["rewards/chosen"] == pytest.approx(0, abs=1e-5)
        want[0]["rewards/accuracies"] = got[0]["rewards/accuracies"]
    assert_same_rows(got, want)
    assert all(r[f"{stage}/grad_norm"] > 0 for r in want)


# ---- the seed's r1_zero_qwen25_7b, shrunk ----------------------------------------------------------
@pytest.fixture(scope="module")
def qwen25_shaped(work, tiny_tokenizer):
    """A tiny model of Qwen2.5's shape (untied output layer, qkv bias, GQA, RMSNorm, SwiGLU, rope
    theta 1e6), and its Megatron-Core checkpoint at TP 2 x PP 2 (``posttrain convert``, as the seed's
    ``mcore_tp4_pp2`` load directory is made)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from posttrain.cli import main

    hf = work / "qwen25_shaped"
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6,
                         eos_token_id=tiny_tokenizer.eos_token_id)
    Qwen2ForCausalLM(config).save_pretrained(hf)
    tiny_tokenizer.save_pretrained(hf)
    mcore = work / "qwen25_shaped_mcore_tp2_pp2"
    assert main(["convert", "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(hf),
                 "--save-dir", str(mcore), "--target-tensor-parallel-size", "2",
                 "--target-pipeline-parallel-size", "2", "--add-qkv-bias"]) == 0
    return hf, mcore


def r1_zero(work, hf, name: str, load, iters: int, resume: bool = False):
    """The seed's config with only the model, the data, the device count and what a CPU cannot run
    overridden (batch sizes, samples, lengths, train_iters, the distributed optimizer)."""
    from posttrain.config.run import load_run_config

    model = ["num_layers=2", "hidden_size=64", "ffn_hidden_size=128", "num_attention_heads=4", "num_query_groups=2",
             "max_position_embeddings=256", "padded_vocab_size=512", "make_vocab_size_divisible_by=128",
             "rotary_base=1000000"]
    overrides = [f"actor_config.{m}" for m in model] + [
        f"megatron_training.tokenizer_name_or_path={hf}", f"megatron_training.data_path={work / 'prompts/data'}",
        "rl_config.actor_resource.num_npus=4", "actor_config.tensor_model_parallel_size=2",
        "megatron_training.global_batch_size=4", "rl_config.mini_batch_size=2", "rl_config.n_samples_per_prompt=4",
        "actor_config.micro_batch_size=2", "rl_config.actor_forward_micro_batch_size=2",
        "rl_config.max_prompt_length=64", "megatron_training.seq_length=128", "generate_config.max_model_len=128",
        "generate_config.sampling_config.max_tokens=12", "generate_config.infer_tensor_parallel_size=1",
        f"megatron_training.train_iters={iters}", "megatron_training.save_interval=1",
        "actor_config.use_distributed_optimizer=false", "rl_config.device=cpu",
        f"actor_config.load={load}", f"actor_config.save={work / name}",
        f"rl_config.output_dir={work / ('run_' + name)}", f"rl_config.tensorboard_log_dir={work / ('tb_' + name)}",
        "rl_config.ray_timeout_s=300"]
    if resume:
        overrides += ["actor_config.finetune=false", "actor_config.no_load_optim=false",
                      "actor_config.no_load_rng=false"]
    return load_run_config("r1_zero_qwen25_7b", overrides=overrides)


def test_the_seeds_r1_zero_config_trains_saves_resumes_exactly_and_converts(ray_cluster, work, qwen25_shaped):
    """TP 2 x PP 2 on 4 processes from a Megatron checkpoint (finetune): 2 iterations saved after
    each; a run resumed from the first checkpoint takes the same second iteration (every metric
    but the wall-clock ones, and every saved weight, equal); ``posttrain convert`` turns the saved
    run into an HF model that differs from the initial one."""
    import torch
    from safetensors.torch import load_file

    from posttrain.cli import main
    from posttrain.config.plan import resolve_plan

    hf, mcore = qwen25_shaped
    cfg = r1_zero(work, hf, "r1_zero", mcore, iters=2)
    plan = resolve_plan(cfg, device="cpu")
    assert (plan.parallel.backend, plan.parallel.tp, plan.parallel.pp, plan.parallel.dp) == ("megatron", 2, 2, 1)
    _, rows, _ = record_run(cfg)
    rows = [r for r in rows if "actor/pg_loss" in r]
    assert [r["iteration"] for r in rows] == [1, 2] and all(r["timing/resharding_to_infer"] > 0 for r in rows)
    for it in (1, 2):  # torch_dist, the default: shards of every rank under one metadata file
        assert (work / "r1_zero" / f"iter_{it:07d}" / ".metadata").is_file()
    _, resumed, _ = record_run(r1_zero(work, hf, "r1_zero_resumed", work / "r1_zero" / "iter_0000001", iters=2,
                                       resume=True))
    resumed = [r for r in resumed if "actor/pg_loss" in r]
    assert [r["iteration"] for r in resumed] == [2]
    for key in (k for k in rows[1] if not is_wall_clock(k)):
        assert resumed[0][key] == rows[1][key], key
    outs = {}
    for name in ("r1_zero", "r1_zero_resumed"):
        outs[name] = work / f"{name}_hf" / "mg2hf"  # the seed's convention: save-dir/mg2hf
        assert main(["convert", "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir",
                     str(work / name), "--save-dir", str(outs[name].parent)]) == 0
    trained, again = (load_file(str(outs[n] / "model.safetensors")) for n in ("r1_zero", "r1_zero_resumed"))
    initial = load_file(str(hf / "model.safetensors"))
    assert sorted(trained) == sorted(initial)
    assert all(torch.equal(trained[k], again[k]) for k in trained)  # the resume is exact
    assert any(not torch.equal(trained[k], initial[k]) for k in trained)  # and it trained


@pytest.fixture(scope="module")
def moe_model(work, tiny_tokenizer):
    """A 2-layer Qwen3-MoE (hidden 64, 4 experts of width 32, top 2, renormalised; no pad row: see
    ``model``)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    out = work / "moe_model"
    torch.manual_seed(2)
    config = Qwen3MoeConfig(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                            max_position_embeddings=256, tie_word_embeddings=False,
                            eos_token_id=tiny_tokenizer.eos_token_id)
    Qwen3MoeForCausalLM(config).save_pretrained(out)
    tiny_tokenizer.save_pretrained(out)
    return out


def moe_run(work, model, name: str, workers: int, rl: dict | None = None, **train):
    """2 GRPO iterations (or ``train``'s stage) on ``model`` without the router's load-balancing loss
    (the HF backend does not add it)."""
    return record_run(grpo_config(work, name, workers=workers, iters=2, rl={**RL, **(rl or {})}, train={
        **TRAIN, "tokenizer_name_or_path": str(model), "moe_router_load_balancing_type": "none", **train}))


@pytest.fixture(scope="module")
def moe_hf_run(ray_cluster, work, moe_model):
    return moe_run(work, moe_model, "moe_hf", 1)


def assert_same_run(got_run, want_run) -> None:
    """The same responses, optimizer steps and logged metrics (but the wall-clock ones) within 1e-4."""
    (want_batches, want_rows, want_steps), (got_batches, got_rows, got_steps) = want_run, got_run
    assert got_batches == want_batches and len(got_steps) == len(want_steps) == 4
    for step, (got, want) in enumerate(zip(got_steps, want_steps)):
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (step, key)
    want_rows, got_rows = ([r for r in rows if "actor/pg_loss" in r] for rows in (want_rows, got_rows))
    assert [r["iteration"] for r in got_rows] == [1, 2]
    for want, got in zip(want_rows, got_rows):
        for key in (k for k in want if not is_wall_clock(k)):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (want["iteration"], key)


def test_expert_parallelism_equals_the_hf_backend_saves_resumes_exactly_and_converts(moe_hf_run, work, moe_model):
    """A Qwen3-MoE model at EP 2 (2 data-parallel ranks, 2 experts each; tokens all-gathered over
    them every layer, so both run packed micro-batches in lockstep): the HF backend's responses, steps
    and metrics. Its torch_dist checkpoints hold each rank's experts; a run resumed from the first
    takes the same second iteration, and both convert to the same HF model, which Transformers loads."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from posttrain.cli import main

    ckpt = work / "moe_ep2_ckpt"
    got = moe_run(work, moe_model, "moe_ep2", 2, expert_model_parallel_size=2, save=str(ckpt), save_interval=1)
    assert_same_run(got, moe_hf_run)
    _, resumed, _ = moe_run(work, moe_model, "moe_ep2_resumed", 2, expert_model_parallel_size=2,
                            load=str(ckpt / "iter_0000001"), save=str(work / "moe_ep2_resumed_ckpt"))
    resumed = [r for r in resumed if "actor/pg_loss" in r]
    second = [r for r in got[1] if "actor/pg_loss" in r][1]
    assert [r["iteration"] for r in resumed] == [2]
    for key in (k for k in second if not is_wall_clock(k)):
        assert resumed[0][key] == second[key], key
    outs = {}
    for name in ("moe_ep2_ckpt", "moe_ep2_resumed_ckpt"):
        outs[name] = work / f"{name}_hf"
        assert main(["convert", "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir",
                     str(work / name), "--save-dir", str(outs[name])]) == 0
    trained, again = (load_file(str(out / "mg2hf" / "model.safetensors")) for out in outs.values())
    initial = load_file(str(moe_model / "model.safetensors"))
    assert sorted(trained) == sorted(initial) and "model.layers.1.mlp.experts.3.down_proj.weight" in trained
    assert all(torch.equal(trained[k], again[k]) for k in trained)
    assert any(not torch.equal(trained[k], initial[k]) for k in trained if ".experts.3." in k)  # rank 1's experts
    AutoModelForCausalLM.from_pretrained(outs["moe_ep2_ckpt"] / "mg2hf")


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 1)], ids=["pp2xep2", "tp2xep2-sequence-parallel"])
def test_expert_parallelism_with_pipeline_or_tensor_parallelism_equals_the_hf_backend(moe_hf_run, work, moe_model,
                                                                                      tp, pp):
    """PP 2 x EP 2 and TP 2 x EP 2 (each expert's MLP split over the tensor-parallel ranks, which
    Megatron-Core runs under sequence parallelism only) on 4 processes: the same run."""
    assert_same_run(moe_run(work, moe_model, f"moe_tp{tp}_pp{pp}_ep2", 4, expert_model_parallel_size=2,
                            pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp,
                            sequence_parallel=tp > 1), moe_hf_run)


def test_dpo_with_expert_parallelism_equals_the_hf_backend(ray_cluster, work, offline_data, moe_model):
    """The seed's MoE recipe is DPO (dpo_qwen3_30b_a3b): DPO on the Qwen3-MoE model at EP 2 logs what
    one HF process logs (the pairs shared out over the 2 data-parallel ranks)."""
    from posttrain.commands.train import train_config as train

    model = {"tokenizer_name_or_path": str(moe_model), "moe_router_load_balancing_type": "none"}
    train(offline_config(work, offline_data, "dpo", "moe_dpo_hf", workers=1, iters=2, train_extra=model))
    train(offline_config(work, offline_data, "dpo", "moe_dpo_ep2", workers=2, iters=2,
                         train_extra={**model, "expert_model_parallel_size": 2}))
    want, got = read_metrics(work / "run_moe_dpo_hf"), read_metrics(work / "run_moe_dpo_ep2")
    want[0]["rewards/accuracies"] = got[0]["rewards/accuracies"]  # noise at step 1 (see the test above)
    # EP runs packed micro-batches (lockstep), whose rounding differs from the HF batches' by ~1e-7;
    # Adam's first step turns that into moves of up to lr x 0.1 in the elements whose gradient is ~0
    # (tests/megatron/test_megatron_update.py), so the second step's rewards, differences of nearly
    # equal summed log-probs, agree to ~2e-4 (a dense model's packed DPO does the same); its loss and
    # gradient norm within 1e-4 relative
    for row in (got[1], want[1]):
        rewards = {k: row.pop(k) for k in list(row) if k.startswith("rewards/")}
        row["rewards"] = rewards
    assert got[1].pop("rewards") == pytest.approx(want[1].pop("rewards"), abs=1e-3)
    assert_same_rows(got, want)
    assert all(r["dpo/grad_norm"] > 0 for r in want)


def test_ppo_with_expert_parallelism_equals_the_hf_backend(ray_cluster, work, moe_model):
    """PPO at EP 2: the actor and its colocated critic (a value head on the MoE backbone, its experts
    split over the same ranks) log what one HF process logs."""
    runs = {}
    for name, workers, extra in (("hf", 1, {}), ("ep2", 2, {"expert_model_parallel_size": 2})):
        runs[name] = moe_run(work, moe_model, f"moe_ppo_{name}", workers, stage="ray_ppo", rl=PPO, **extra)
    assert_same_run(runs["ep2"], runs["hf"])
    assert all(r["critic/vf_loss"] > 0 for r in runs["hf"][1] if "critic/vf_loss" in r)
