"""GRPO-LoRA on the Megatron-Core backend at TP 2 (Ray worker groups, gloo) equals the hf backend's
LoRA run in one process: PEFT's adapter of the same seed converted into the fused Megatron layout,
only the adapter trained, the reference the base (``share_backbone``: the adapter off), the rollout
sampling from the merged weights. Its checkpoint holds the adapter in PEFT's format, which PEFT's
own loader puts on the tiny base to give the log-probs of the Megatron model resumed from that
checkpoint; the resumed run's next iteration is the straight run's (adapter, optimizer, schedule,
sampler and RNG states restored)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.cluster.cluster_helpers import grpo_config, record_run, session_and_trainer
from tests.cluster.test_ray_grpo import is_wall_clock
from tests.cluster.test_ray_offline import offline_config, offline_data  # noqa: F401 (a fixture)
from tests.helpers.runs import read_metrics

pytestmark = [pytest.mark.ray, pytest.mark.slow]
LORA = {"lora_target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], "lora_r": 8,
        "lora_alpha": 16, "lr": 2e-2}
RL = {"init_kl_coef": 0.05, "share_backbone": True, "use_remove_padding": False}


def lora_run(work, name: str, workers: int, extra: dict):
    return record_run(grpo_config(work, f"mlora_{name}", workers=workers, iters=3, rl=RL, train={
        **LORA, **extra, "save": str(work / f"mlora_{name}_ckpt"), "save_interval": 2}))


def probe_batch(vocab: int):
    """4 rows of the training layout (random tokens)."""
    from posttrain.training.batch import build_batch

    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, vocab, (n,), generator=g) for n in (5, 3, 6, 4)]
    responses = [torch.randint(3, vocab, (n,), generator=g) for n in (4, 6, 2, 5)]
    return build_batch(prompts, responses, pad_token_id=0)


@pytest.fixture(scope="module")
def hf_lora(ray_cluster, work):
    """The LoRA run on the hf backend in one process (3 iterations)."""
    return lora_run(work, "hf", 1, {})


def assert_same_run(got_run, want_run) -> list[dict]:
    """The same responses, and every optimizer step's and logged metric (but the wall-clock ones)
    within 1e-3; returns the got run's logged rows."""
    (want_batches, want_rows, want_steps), (got_batches, got_rows, got_steps) = want_run, got_run
    assert got_batches == want_batches and want_batches[0] != want_batches[-1]
    assert len(got_steps) == len(want_steps) == 6
    for step, (got, want) in enumerate(zip(got_steps, want_steps)):
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-3, abs=1e-6), (step, key)
    want_rows = [r for r in want_rows if "actor/pg_loss" in r]
    got_rows = [r for r in got_rows if "actor/pg_loss" in r]
    assert [r["iteration"] for r in got_rows] == [1, 2, 3]
    for want, got in zip(want_rows, got_rows):
        for key in (k for k in want if not is_wall_clock(k)):
            assert got[key] == pytest.approx(want[key], rel=1e-3, abs=1e-6), (want["iteration"], key)
    assert want_rows[-1]["actor/kl_loss"] > 0  # the adapter moved the actor away from the shared base
    return got_rows


def test_lora_on_the_megatron_backend_equals_the_hf_backend(hf_lora, work):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from posttrain.training.engine import TrainEngine

    got_rows = assert_same_run(lora_run(work, "tp2", 2, {"tensor_model_parallel_size": 2, "backend": "megatron"}),
                               hf_lora)

    # the saved adapter, loaded by PEFT on the base, is the trained Megatron model (resumed from it)
    ckpt = work / "mlora_tp2_ckpt"
    saved = ckpt / "iter_0000002"
    assert (saved / "adapter_model.safetensors").is_file() and (saved / "adapter_config.json").is_file()
    base = AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(saved))
    batch = probe_batch(base.config.vocab_size)
    want = TrainEngine(peft, micro_batch_size=4).compute_logprobs(batch)
    with peft.disable_adapter():
        base_logprobs = TrainEngine(peft, micro_batch_size=4).compute_logprobs(batch)
    assert (want - base_logprobs).abs().max() > 1e-3  # the adapter trained
    cfg = grpo_config(work, "mlora_resumed", workers=2, iters=3, rl=RL, train={
        **LORA, "tensor_model_parallel_size": 2, "backend": "megatron", "load": str(saved)})
    session, trainer = session_and_trainer(cfg)
    try:
        assert session.policy.state["iteration"] == 2
        got = session.policy.actor.compute_logprobs(batch, temperature=1.0)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        ref = session.policy.reference.compute_logprobs(batch, temperature=1.0)
        torch.testing.assert_close(ref, base_logprobs, rtol=0, atol=1e-5)
    except BaseException:
        session.close()
        raise
    # iteration 3 after the resume is the straight run's: the adapter, its optimizer state, the LR
    # schedule, the sampler and the RNG states restored
    trainer.fit()
    [resumed] = [r for r in read_metrics(Path(cfg.rl.output_dir)) if "actor/pg_loss" in r]
    assert resumed["iteration"] == 3
    for key in (k for k in got_rows[-1] if not is_wall_clock(k)):
        assert resumed[key] == pytest.approx(got_rows[-1][key], rel=1e-6, abs=1e-8), key


def test_lora_under_sequence_parallelism_equals_the_hf_backend(hf_lora, work):
    """TP 2 with sequence parallelism: the column-parallel adapters see every token (gathered), the
    row-parallel ones' partial products are reduce-scattered to each rank's tokens, and the
    replicated matrices' partial gradients are summed over TP (``finalize_model_grads``)."""
    assert_same_run(lora_run(work, "tp2_sp", 2, {"tensor_model_parallel_size": 2, "backend": "megatron",
                                                 "sequence_parallel": True}), hf_lora)


def test_an_adapter_only_checkpoint_resumes_on_its_hf_base(ray_cluster, work):
    """``lora_ckpt_filter`` (legacy per-rank format here): the Megatron files hold the adapter and its
    optimizer state alone; a resume builds the base from the adapter's HF base model and loads them:
    the saved adapter's log-probs (PEFT on the base), and the resumed iteration 3 is the straight
    run's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from posttrain.models.mcore import mcore_files
    from posttrain.training.engine import TrainEngine

    extra = {"tensor_model_parallel_size": 2, "backend": "megatron", "lora_ckpt_filter": True, "ckpt_format": "torch"}
    _, rows, _ = lora_run(work, "filtered", 2, extra)
    saved = work / "mlora_filtered_ckpt" / "iter_0000002"
    shard = mcore_files.load_rank_file(saved / "mp_rank_01" / mcore_files.RANK_FILE)
    assert shard["model"] and all(".lora." in key for key in shard["model"]) and shard["optimizer"]
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.float32),
                                     str(saved))
    batch = probe_batch(peft.config.vocab_size)
    want = TrainEngine(peft, micro_batch_size=4).compute_logprobs(batch)
    cfg = grpo_config(work, "mlora_filtered_resumed", workers=2, iters=3, rl=RL, train={
        **LORA, **extra, "load": str(saved)})
    session, trainer = session_and_trainer(cfg)
    try:
        assert session.policy.state["iteration"] == 2
        torch.testing.assert_close(session.policy.actor.compute_logprobs(batch, temperature=1.0), want, rtol=0,
                                   atol=1e-5)
    except BaseException:
        session.close()
        raise
    trainer.fit()
    [resumed] = [r for r in read_metrics(Path(cfg.rl.output_dir)) if "actor/pg_loss" in r]
    straight = [r for r in rows if "actor/pg_loss" in r][-1]
    assert resumed["iteration"] == straight["iteration"] == 3
    for key in (k for k in straight if not is_wall_clock(k)):
        assert resumed[key] == pytest.approx(straight[key], rel=1e-6, abs=1e-8), key


def test_dpo_lora_with_a_shared_backbone_equals_the_hf_backend(ray_cluster, work, offline_data):
    """DPO-LoRA at TP 2 with ``share_backbone``: the reference's pair log-probs are the actor's with
    its adapters off (the base); 2 iterations log what one HF process logs."""
    from posttrain.commands.train import train_config as train

    lora = {key: LORA[key] for key in ("lora_target_modules", "lora_r", "lora_alpha")}
    rl = {"use_remove_padding": False, "share_backbone": True}  # padded rows: see test_ray_megatron.py
    for name, workers, extra in (("hf", 1, {}), ("tp2", 2, {"tensor_model_parallel_size": 2, "backend": "megatron"})):
        train(offline_config(work, offline_data, "dpo", f"mlora_dpo_{name}", workers=workers, iters=2, rl_extra=rl,
                             train_extra={**lora, **extra}))
    want, got = read_metrics(work / "run_mlora_dpo_hf"), read_metrics(work / "run_mlora_dpo_tp2")
    # the first step's policy is the reference (B = 0): its rewards are 0 up to rounding, and the share
    # of pairs whose rounding favours the chosen side is noise
    assert abs(want[0]["rewards/chosen"]) < 1e-5 and got[0]["rewards/chosen"] == pytest.approx(0, abs=1e-5)
    want[0]["rewards/accuracies"] = got[0]["rewards/accuracies"]
    assert [r["iteration"] for r in got] == [r["iteration"] for r in want] == [1, 2]
    for g, w in zip(got, want):
        assert sorted(g) == sorted(w)
        for key in (k for k in w if k != "time" and not is_wall_clock(k)):
            assert g[key] == pytest.approx(w[key], rel=1e-3, abs=1e-6), (w["iteration"], key)
    assert abs(want[-1]["rewards/chosen"]) > 1e-3  # the adapter moved the policy off the reference
