"""``rl_config.data_strategy: tq``: the experience table's cells in TransferQueue (transferqueue on a
local Ray), against the in-process TransferDock.

* The dock: the same puts, reads (seeded random rows, whole groups, by index), row clears and
  saved state give the same rows and tensors (dtype and length) as a TransferDock, on 2 storage units.
* A GRPO run (one process, 2 iterations; its cells in TransferQueue) draws the same responses and
  logs the same metrics as the run with the TransferDock; on 2 Ray actor workers too (to float noise).

Skipped where transferqueue is not installed (pip install 'posttrain[tq]' torch==<your torch>).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transfer_queue", reason="transferqueue is not installed: pip install 'posttrain[tq]' "
                                             "torch==<this torch> (rl_config.data_strategy: tq)")

from tests.cluster.cluster_helpers import grpo_config, record_run  # noqa: E402
from tests.cluster.test_ray_grpo import is_wall_clock, same  # noqa: E402

pytestmark = pytest.mark.ray
RAY_CPUS = 4  # 2 actor workers, TransferQueue's controller and storage unit; or the controller and 2 units


def _plan(shards: int):
    from posttrain.config.options import ClusterOptions

    return SimpleNamespace(cluster=ClusterOptions(), queue_shards=shards, data_strategy="tq")


def _fill(dock) -> None:
    """Variable-length int rows, float rows and scalars, written by prompt and by index."""
    g = torch.Generator().manual_seed(0)
    dock.put_prompts({"prompts": [torch.arange(k + 2) for k in range(4)]})
    lengths = torch.randint(0, 6, (8,), generator=g).tolist()
    dock.put(["responses", "scores"], list(range(8)),
             [[torch.randint(0, 50, (n,), generator=g) for n in lengths], torch.randn(8, generator=g)])


def test_queue_dock_reads_what_the_transfer_dock_reads(ray_cluster):
    from posttrain.cluster.transfer_queue import TransferQueueStore
    from posttrain.transfer_dock import TransferDock

    store = TransferQueueStore.start(_plan(2))
    try:
        kw = dict(n_samples_per_prompt=2, guarantee_order=False, seed=3)
        docks = [TransferDock(8, ["prompts", "responses", "scores"], ["a", "b"], **kw),
                 store.new_dock(8, ["prompts", "responses", "scores"], ["a", "b"], **kw)]
        import transfer_queue as tq

        assert len(tq.interface._TQ_STORAGE["SimpleStorage"]) == 2  # transfer_queue_data_shard_num
        reads = []
        for dock in docks:
            _fill(dock)
            if dock is docks[1]:  # the cells are in TransferQueue, one key per row
                assert set(tq.kv_list(dock.partition)[dock.partition]) == {str(i) for i in range(8)}
            got = [dock.get("a", ["prompts", "responses"], 4), dock.get("b", ["scores"], 4, get_n_samples=True),
                   dock.get("b", ["responses", "scores"], indexes=[7, 0, 3])]
            dock.clear_rows([0, 1])
            got.append(dock.get("a", ["prompts"], 2))
            got.append((dock.cell("responses", 0), dock.cell("responses", 5)))
            reads.append((got, dock.state_dict()))
        (want, want_state), (seen, seen_state) = reads
        for (w_rows, w_idx), (s_rows, s_idx) in zip(want[:4], seen[:4]):
            assert s_idx == w_idx and w_idx is not None
            for column, rows in w_rows.items():
                assert [r.dtype for r in s_rows[column]] == [r.dtype for r in rows]
                assert all(torch.equal(a, b) for a, b in zip(s_rows[column], rows)), column
        assert seen[4][0] is None and torch.equal(seen[4][1], want[4][1])
        for column, cells in want_state["data"].items():
            assert [c is None for c in seen_state["data"][column]] == [c is None for c in cells]
            assert all(a is None or torch.equal(a, b) for a, b in zip(seen_state["data"][column], cells))
        restored = store.new_dock(8, ["prompts", "responses", "scores"], ["a", "b"], **kw)
        restored.load_state_dict(seen_state)
        rows, idx = restored.get("a", ["responses"], indexes=[2, 6])
        assert all(torch.equal(a, b) for a, b in zip(rows["responses"], want_state["data"]["responses"][2::4]))
    finally:
        store.close()


@pytest.fixture(scope="module")
def dock_run(ray_cluster, work):
    """The 2-iteration GRPO run in one process with the TransferDock: batches, metrics, update steps."""
    return record_run(grpo_config(work, "tq_td", workers=1, iters=2, rl={"data_strategy": "td"}))


def test_grpo_with_transfer_queue_equals_transfer_dock(dock_run, work):
    from posttrain.cluster.transfer_queue import TransferQueueStore

    sessions = []
    batches, metrics, steps = record_run(grpo_config(work, "tq_tq", workers=1, iters=2,
                                                     rl={"data_strategy": "tq"}), sessions)
    assert isinstance(sessions[0].queue, TransferQueueStore)  # the cells went through TransferQueue
    want_batches, want_metrics, want_steps = dock_run
    assert batches == want_batches
    assert len(metrics) == len(want_metrics) == 2
    for want, seen in zip(want_metrics, metrics):
        values = {k: v for k, v in want.items() if not is_wall_clock(k)}
        assert len(values) > 20 and {k: seen[k] for k in values} == values  # scores, losses, lengths, KL, ...
    assert steps == want_steps


def test_grpo_on_two_ray_workers_with_transfer_queue(dock_run, work):
    """The run on 2 Ray actor workers, its cells in TransferQueue on the same Ray: the responses and metrics
    of the one-process TransferDock run (to float noise, as tests/cluster/test_ray_grpo.py allows 2 workers)."""
    sessions = []
    batches, metrics, _ = record_run(grpo_config(work, "tq_ray", workers=2, iters=2, rl={"data_strategy": "tq"}),
                                     sessions)
    assert sessions[0].cluster.world == 2 and sessions[0].queue is not None
    want_batches, want_metrics, _ = dock_run
    assert batches == want_batches
    for want, seen in zip(want_metrics, metrics):
        compared = [k for k in want if not is_wall_clock(k)]
        assert len(compared) > 20 and all(same(seen[k], want[k], k) for k in compared)
    import ray

    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < RAY_CPUS and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU", 0) == RAY_CPUS  # the workers and TransferQueue's actors are gone


def test_a_cluster_without_the_cpus_for_the_storage_units_is_refused(ray_cluster, monkeypatch):
    """TransferQueue's actors would wait forever for CPUs the cluster lacks: refused at the start instead."""
    from posttrain.cluster import transfer_queue
    from posttrain.cluster.remote import ClusterError
    from posttrain.cluster.transfer_queue import TransferQueueStore

    monkeypatch.setattr(transfer_queue, "CPU_WAIT_S", 1.0)
    with pytest.raises(ClusterError, match=r"data_strategy: tq needs 11 free CPUs .* it has \d+ free\. Lower "
                                           r"transfer_queue_data_shard_num"):
        TransferQueueStore.start(_plan(10))
