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
from cluster_helpers import grpo_config, record_run
from test_ray_grpo import is_wall_clock

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


@pytest.mark.parametrize("tp,pp,extra", [(2, 1, {}), (1, 2, {}), (2, 2, {}),
                                         (2, 1, {"recompute_granularity": "full"})],
                         ids=["tp2", "pp2", "tp2xpp2", "tp2-recompute"])
def test_grpo_on_the_megatron_backend_equals_the_hf_backend(hf_run, work, model, tp, pp, extra):
    cfg = grpo_config(work, f"mg_tp{tp}_pp{pp}_{len(extra)}", workers=tp * pp, iters=2, rl=RL,
                      train={**TRAIN, **extra, "tokenizer_name_or_path": str(model), "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                             "backend": "megatron"})
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
