"""SFT and DPO on Ray actor workers (issue 16): the same loop, its global batch shared out.

* 2 workers (SFT with DDP, DPO with FSDP2) log the same metrics as one process, 2 iterations.
* The 2-worker checkpoint resumes in one process, and its third iteration is the third iteration
  of the run that never left one process.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.helpers.configs import OMIT, run_config
from tests.helpers.data import letter_pair, write_jsonl
from tests.helpers.runs import read_metrics

pytestmark = pytest.mark.ray

WALL_CLOCK = ("timing/",)


@pytest.fixture(scope="module")
def offline_data(work):
    """An SFT set and a preference-pair set, made with the tiny tokenizer of ``work``."""
    from posttrain.data.preprocess import preprocess

    root = work / "offline"
    if root.exists():
        return root
    root.mkdir()
    rng = random.Random(3)
    write_jsonl(root / "rows.jsonl", [letter_pair(rng) for _ in range(64)])
    common = {"input": str(root / "rows.jsonl"), "tokenizer_name_or_path": str(work / "model"), "prompt_type": "trl",
              "workers": 1}
    preprocess({**common, "handler_name": "AlpacaStyleInstructionHandler", "output_prefix": str(root / "sft/data"),
                "map_keys": {"prompt": "problem", "response": "chosen"}}, progress=False)
    preprocess({**common, "handler_name": "AlpacaStylePairwiseHandler", "output_prefix": str(root / "pairs/data"),
                "map_keys": {"prompt": "problem", "chosen": "chosen", "rejected": "rejected"}}, progress=False)
    return root


def offline_config(work: Path, data: Path, stage: str, name: str, *, workers: int, iters: int, sharding: str = "ddp",
                   save: Path | None = None, load: Path | None = None, train_extra: dict | None = None,
                   rl_extra: dict | None = None):
    train = {"global_batch_size": 8, "micro_batch_size": 2, "lr": 1e-2, "dataset_additional_keys": OMIT,
             **(train_extra or {})}
    if stage == "dpo":
        train.update(data_path=str(data / "pairs/data"), is_pairwise_dataset=True, dpo_beta=0.5)
    else:
        train.update(data_path=str(data / "sft/data"))
    if save:
        train.update(save=str(save), save_interval=iters)
    if load:
        train.update(load=str(load))
    rl = {"actor_resource": {"num_devices": workers}, "ray_sharding": sharding, "ray_timeout_s": 120,
          **(rl_extra or {})}
    return run_config(work / "model", train["data_path"], work / f"run_{name}", name=name, stage=stage, iters=iters,
                      megatron_training=train, rl_config=rl)


def assert_same_rows(got: list[dict], want: list[dict]) -> None:
    assert [r["iteration"] for r in got] == [r["iteration"] for r in want]
    for g, w in zip(got, want):
        assert sorted(g) == sorted(w)
        for key in w:
            if key != "time" and not key.startswith(WALL_CLOCK):
                assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-6), (w["iteration"], key)


@pytest.mark.parametrize("stage,sharding", [("sft", "ddp"), ("dpo", "fsdp2")])
def test_two_workers_equal_one_process_and_their_checkpoint_resumes_in_one(ray_cluster, work, offline_data,
                                                                             stage, sharding):
    from posttrain.commands.train import train_config as train

    train(offline_config(work, offline_data, stage, f"{stage}_local", workers=1, iters=3))
    local = read_metrics(work / f"run_{stage}_local")
    save = work / f"ckpt_{stage}_ray"
    train(offline_config(work, offline_data, stage, f"{stage}_ray", workers=2, iters=2, sharding=sharding,
                         save=save, rl_extra={"use_dp_batch_balance": stage == "dpo"}))  # DPO: pairs by tokens
    assert_same_rows(read_metrics(work / f"run_{stage}_ray"), local[:2])
    prefix = "sft" if stage == "sft" else "dpo"
    assert all(r[f"{prefix}/grad_norm"] > 0 for r in local)  # each iteration trained (learning: tests/e2e)
    # the 2-worker checkpoint continues in one process: iteration 3 is the one-process run's (DPO:
    # with the reference loaded from the initial model again, not the resumed policy)
    train(offline_config(work, offline_data, stage, f"{stage}_ray", workers=1, iters=3, save=save, load=save))
    assert_same_rows(read_metrics(work / f"run_{stage}_ray"), local)


def test_a_global_batch_the_workers_cannot_share_is_refused(work, offline_data):
    from posttrain.config.plan import resolve_plan
    from posttrain.errors import ConfigError

    cfg = offline_config(work, offline_data, "dpo", "dpo_odd", workers=3, iters=1)
    with pytest.raises(ConfigError, match=r"global_batch_size 8 must be divisible by micro_batch_size 2 \* "
                                          r"data_parallel_size 3"):  # the seed's rule, with the worker count
        resolve_plan(cfg, device="cpu")
