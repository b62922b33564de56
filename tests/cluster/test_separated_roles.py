"""The seed's separated roles (``use_integrated_worker: false`` with ``reference_resource`` and
``reward_resource``): the frozen reference and the reward model in Ray worker groups of their own,
beside one actor worker. The run equals the integrated one in this process (the reference and the
reward model colocated with the actor): the same responses, every metric but the wall-clock ones
within 1e-5. ``blocking: false`` (the reference's and the actor's log-prob passes started together)
gives the same iteration again, here after resuming the integrated run's checkpoint, so the
reference group is built from the run's initial model, not from the resumed weights.
"""

from __future__ import annotations

import pytest

from tests.cluster.cluster_helpers import grpo_config, record_run
from tests.cluster.test_ray_grpo import is_wall_clock, same

pytestmark = [pytest.mark.ray, pytest.mark.slow]
RAY_CPUS = 3  # one actor worker, one reference worker, one reward-model worker

SEPARATED = {"use_integrated_worker": False, "reference_resource": {"num_npus": 1},
             "reward_resource": {"num_npus": 1}}


def config(work, rm_dir, name: str, rl: dict | None = None, train: dict | None = None):
    """2 GRPO iterations with a KL term (the reference in the loss) and rule + reward-model scores."""
    return grpo_config(work, name, workers=1, iters=2,
                       rl={"init_kl_coef": 0.05, "reward_model_weight": 0.5, **(rl or {})}, train=train,
                       sections={"reward_config": {"load": str(rm_dir), "micro_batch_size": 4}})


def assert_same_rows(got: list[dict], want: list[dict]) -> None:
    assert [r["iteration"] for r in got] == [r["iteration"] for r in want]
    for g, w in zip(got, want):
        assert sorted(g) == sorted(w)
        compared = [k for k in w if not is_wall_clock(k)]
        for key in compared:
            assert same(g[key], w[key], key), (w["iteration"], key, g[key], w[key])
        assert len(compared) > 15


def trained_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "actor/pg_loss" in r]


def test_separated_roles_equal_the_integrated_run_blocking_or_not(ray_cluster, work, lowercase_rm_dir):
    sessions: list = []
    ckpt = work / "ckpt_separated_base"
    base = record_run(config(work, lowercase_rm_dir, "sep_integrated",
                             train={"save": str(ckpt), "save_interval": 1}))
    separated = record_run(config(work, lowercase_rm_dir, "sep_blocking", rl=SEPARATED), sessions)
    cluster = sessions[0].cluster
    assert set(cluster.groups) == {"reference", "reward"}  # the roles' own groups, beside the actor worker
    pgs = [cluster.pg.id, cluster.groups["reference"].pg.id, cluster.groups["reward"].pg.id]
    assert len(set(pgs)) == 3 and [len(g.names) for g in cluster.groups.values()] == [1, 1]
    (base_batches, base_rows, _), (sep_batches, sep_rows, _) = base, separated
    assert sep_batches == base_batches and base_batches[0] != base_batches[1]
    base_rows, sep_rows = trained_rows(base_rows), trained_rows(sep_rows)
    assert all(r["actor/kl_loss"] > 0 for r in base_rows)  # the reference's log-probs are in the loss
    assert base_rows[0]["reward_model/score/max"] > base_rows[0]["reward_model/score/min"]
    assert_same_rows(sep_rows, base_rows)
    # blocking: false, resumed from the integrated run's first iteration: its second iteration again
    overlapped = record_run(config(work, lowercase_rm_dir, "sep_overlap", rl={**SEPARATED, "blocking": False},
                                   train={"load": str(ckpt / "iter_0000001")}))
    over_batches, over_rows, _ = overlapped
    assert over_batches == base_batches[1:]
    over_rows = trained_rows(over_rows)
    assert_same_rows(over_rows, base_rows[1:])
    # the two log-prob passes were awaited together (one span), where the blocking run timed each on its own
    assert over_rows[0]["timing/reference_model"] == over_rows[0]["timing/old_log_p"]
    assert sep_rows[1]["timing/reference_model"] != sep_rows[1]["timing/old_log_p"]
