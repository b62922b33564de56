"""``blocking: false``'s one wait (posttrain.cluster.remote.wait_all): the calls of every started
pass go to one ``gather`` (so one ray_timeout_s deadline and the first failure of any of them, by
worker name and node), and each pass gets its own answer back, in order. ``gather`` itself (its
timeout and error reports on real Ray workers) is tested in tests/cluster/test_ray_failures.py."""

from __future__ import annotations

import pytest

from posttrain.cluster import remote
from posttrain.cluster.remote import ClusterError, Pending, wait_all


def test_one_gather_for_all_passes_and_one_answer_each(monkeypatch):
    calls = []

    def fake_gather(refs, names, what, timeout_s, nodes=None):
        calls.append((refs, names, what, timeout_s, nodes))
        return [r * 10 for r in refs]

    monkeypatch.setattr(remote, "gather", fake_gather)
    actor = Pending("actor log-probs", [1, 2], ["actor rank 0", "actor rank 1"], ["n0", "n1"], sum)
    reference = Pending("reference log-probs", [3], ["reference rank 0"], ["n2"], list)
    critic = Pending("actor log-probs", [4], ["actor rank 0"], ["n0"], list)
    assert wait_all([actor, reference, critic], timeout_s=42.0) == [30, [30], [40]]
    assert calls == [([1, 2, 3, 4], ["actor rank 0", "actor rank 1", "reference rank 0", "actor rank 0"],
                      "actor log-probs and reference log-probs", 42.0, ["n0", "n1", "n2", "n0"])]


def test_the_first_failure_of_any_pass_is_raised(monkeypatch):
    def failing_gather(refs, names, what, timeout_s, nodes=None):
        raise ClusterError(f"{what} failed on {names[-1]}: out of memory")

    monkeypatch.setattr(remote, "gather", failing_gather)
    with pytest.raises(ClusterError, match="actor log-probs and critic values failed on critic rank 0"):
        wait_all([Pending("actor log-probs", [1], ["actor rank 0"], [None], list),
                  Pending("critic values", [2], ["critic rank 0"], [None], list)], timeout_s=1.0)
