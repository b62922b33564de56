"""GRPO-LoRA on 2 Ray workers equals the run in one process, with DDP over the adapter and with
FSDP2 shards of the whole PEFT model (the frozen base sharded too): the same responses (the
rollout samples from the merged adapter on each worker; FSDP2: merged into the gathered base) and
every logged metric; the reference shares the backbone (the adapter off) everywhere.

Checkpoints are PEFT's format on every layout: the adapter alone (``lora_ckpt_filter``) or with the
frozen base in ``base/``, which FSDP2 gathers from its shards; PEFT's own loader reads the FSDP2
adapter, and a checkpoint resumes on the other layout (DDP -> FSDP2, FSDP2 -> DDP) into the same
iteration as the uninterrupted run."""

from __future__ import annotations

import pytest

from tests.cluster.cluster_helpers import grpo_config, record_run
from tests.cluster.test_ray_grpo import is_wall_clock, same

pytestmark = [pytest.mark.ray, pytest.mark.slow]
LORA = {"lora_target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], "lora_r": 8,
        "lora_alpha": 16, "lr": 2e-2}
# padded rows: packed micro-batches hold other rows on one worker than on two, and their sums
# differ in rounding, which AdamW's first steps on the fresh adapter amplify past 1e-5
RL = {"epochs": 2, "shuffle_mini_batch": True, "init_kl_coef": 0.05, "share_backbone": True,
      "use_remove_padding": False}


def lora_run(work, name: str, *, workers: int, sharding: str = "ddp", adapter_only: bool = True,
             load: str | None = None):
    """Iterations 1-2 (from ``load``: a checkpoint of iteration 1, so iteration 2 alone), saving each."""
    train = {**LORA, "save": str(work / f"lora_{name}_ckpt"), "save_interval": 1, "lora_ckpt_filter": adapter_only,
             **({"load": load} if load else {})}
    return record_run(grpo_config(work, f"lora_{name}", workers=workers, iters=2,
                                  rl={**RL, "ray_sharding": sharding}, train=train))


def trained(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "actor/pg_loss" in r]


def assert_same_run(got, want, rel: float | None = None) -> float:
    """The same response tokens and every logged metric but the wall-clock ones (``got`` may start
    later): as :func:`same` does, or within ``rel`` (relative, 1e-6 absolute). Returns the largest
    relative difference."""
    (want_batches, want_rows, _), (got_batches, got_rows, _) = want, got
    want_rows, got_rows = trained(want_rows), trained(got_rows)
    assert got_batches == want_batches[-len(got_batches):]
    want_rows = want_rows[-len(got_rows):]
    assert [r["iteration"] for r in got_rows] == [r["iteration"] for r in want_rows]
    largest = 0.0
    for w, g in zip(want_rows, got_rows):
        assert sorted(g) == sorted(w)
        for key in (k for k in w if not is_wall_clock(k)):
            close = same(g[key], w[key], key) if rel is None else g[key] == pytest.approx(w[key], rel=rel, abs=1e-6)
            assert close, (w["iteration"], key, g[key], w[key])
            if abs(w[key]) > 1e-3:  # the relative difference of a value near 0 says nothing
                largest = max(largest, abs(g[key] - w[key]) / abs(w[key]))
    return largest


@pytest.fixture(scope="module")
def runs(ray_cluster, work):
    """The same 2 iterations in one process, on 2 DDP workers (adapter-only checkpoints) and on 2
    FSDP2 workers (checkpoints with the base gathered into ``base/``)."""
    return {"local": lora_run(work, "local", workers=1), "ddp": lora_run(work, "ddp", workers=2),
            "fsdp2": lora_run(work, "fsdp2", workers=2, sharding="fsdp2", adapter_only=False)}


def test_fsdp2_shards_the_frozen_base_too(ray_cluster, work):
    """Each FSDP2 worker holds half of the base and half of the adapter (a DDP replica: all of both)."""
    from transformers import AutoModelForCausalLM

    from posttrain.models.lora import LoraOptions, add_adapter
    from tests.cluster.cluster_helpers import session_and_trainer

    model = add_adapter(AutoModelForCausalLM.from_pretrained(work / "model"),
                        LoraOptions(LORA["lora_r"], LORA["lora_alpha"], tuple(LORA["lora_target_modules"])))
    whole = {kind: sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad == trains)
             for kind, trains in (("trainable", True), ("frozen", False))}
    session, _ = session_and_trainer(grpo_config(work, "lora_bytes", workers=2, iters=1,
                                                 rl={**RL, "ray_sharding": "fsdp2"}, train=LORA))
    try:
        held = session.cluster.parameter_bytes()
    finally:
        session.close()
    assert whole["frozen"] > whole["trainable"] > 0
    for kind in ("trainable", "frozen"):
        shards = [worker[kind] for worker in held]
        assert sum(shards) >= whole[kind] and max(shards) <= 0.55 * whole[kind], (kind, shards, whole)


@pytest.mark.parametrize("layout", ["ddp", "fsdp2"])
def test_lora_on_two_workers_equals_one_process(runs, work, layout):
    """DDP: to float noise (1e-5). FSDP2 reduce-scatters the gradients (other sums than DDP's
    all-reduce: the gradient norm moved 1e-5 relative here, within 1e-3)."""
    largest = assert_same_run(runs[layout], runs["local"], rel=1e-3 if layout == "fsdp2" else None)
    print(f"LoRA {layout}: largest relative metric difference to one process {largest:.2e}")
    batches, rows, _ = runs["local"]
    assert batches[0] != batches[-1] and [r["iteration"] for r in trained(rows)] == [1, 2]
    assert trained(rows)[-1]["actor/kl_loss"] > 0  # the adapter moved the actor away from the shared base
    saved = work / f"lora_{layout}_ckpt" / "iter_0000002"
    assert (saved / "adapter_model.safetensors").is_file() and not (saved / "model.safetensors").exists()
    assert (saved / "base" / "model.safetensors").is_file() == (layout == "fsdp2")


def test_the_fsdp2_adapter_loads_with_peft_and_merges(runs, work):
    """PEFT's own loader reads the adapter FSDP2 gathered and saved: its tensors are the one-process
    run's, and the base saved beside it is the initial model; ``convert --merge-lora`` turns the
    checkpoint into a plain HF model with the adapted model's logits."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from posttrain.models.lora import merge_to_hf

    saved = work / "lora_fsdp2_ckpt" / "iter_0000002"
    base = AutoModelForCausalLM.from_pretrained(saved / "base")
    initial = AutoModelForCausalLM.from_pretrained(work / "model").state_dict()
    assert sorted(base.state_dict()) == sorted(initial)
    for key, value in base.state_dict().items():  # gathered from the shards, as it was loaded
        assert torch.equal(value, initial[key]), key
    model = PeftModel.from_pretrained(base, str(saved))
    loaded = {k: v for k, v in model.state_dict().items() if ".lora_" in k}
    local = load_file(str(work / "lora_local_ckpt" / "iter_0000002" / "adapter_model.safetensors"))
    assert len(loaded) == len(local) == 2 * 7 * 2  # lora_A, lora_B x 7 linears x 2 layers
    for key, want in local.items():  # FSDP2's other gradient sums, through 4 AdamW steps
        got = loaded[key.replace(".weight", ".default.weight")]
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)
    assert max(v.abs().max() for k, v in local.items() if "lora_B" in k) > 1e-2  # B left its zero start
    # convert --merge-lora takes the FSDP2 checkpoint as any other: the merged model is the adapted one
    merged = merge_to_hf(saved, work / "lora_fsdp2_merged", log=lambda _: None)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(merged)(input_ids=ids).logits, adapted,
                                   rtol=1e-5, atol=1e-5)
        initial_logits = AutoModelForCausalLM.from_pretrained(work / "model")(input_ids=ids).logits
    assert (adapted - initial_logits).abs().max() > 1e-3  # the adapter changes the model


@pytest.mark.parametrize(("saved_by", "resumed_on"), [("ddp", "fsdp2"), ("fsdp2", "ddp")])
def test_a_lora_checkpoint_resumes_on_the_other_layout(runs, work, saved_by, resumed_on):
    """Iteration 2 resumed from the other layout's iteration-1 checkpoint (adapter, AdamW moments,
    schedule, sampler, RNG) is the uninterrupted run's iteration 2, and saves the same adapter."""
    import torch
    from safetensors.torch import load_file

    name = f"{saved_by}_to_{resumed_on}"
    resumed = lora_run(work, name, workers=2, sharding=resumed_on,
                       load=str(work / f"lora_{saved_by}_ckpt" / "iter_0000001"))
    assert len(resumed[0]) == 1 and [r["iteration"] for r in trained(resumed[1])] == [2]
    largest = assert_same_run(resumed, runs["local"], rel=1e-3)
    print(f"LoRA {saved_by} -> {resumed_on}: largest relative metric difference to one process {largest:.2e}")
    want = load_file(str(work / "lora_local_ckpt" / "iter_0000002" / "adapter_model.safetensors"))
    got = load_file(str(work / f"lora_{name}_ckpt" / "iter_0000002" / "adapter_model.safetensors"))
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-3, atol=1e-4)
