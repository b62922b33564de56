"""A synchronous on-policy run holds the rollout's packed weights and the actor's gradients only while
they are used: the update runs without the packs (``NativeEngine.drop_sampling_weights``, called by
``loops.sources.SyncSource``) and the rollout without the gradients (``TrainEngine.release_gradients``,
called by ``OnPolicyTrainer`` after its update)."""

from __future__ import annotations

import pytest

from posttrain.models import packed_linear
from posttrain.rollout.native import NativeEngine
from posttrain.training.engine import TrainEngine
from tests.helpers.runs import world_run_config


@pytest.mark.skipif(not packed_linear.available(), reason="this torch build cannot pack weights for oneDNN")
def test_update_runs_without_packs_and_rollout_without_gradients(mini_world, tmp_path, monkeypatch):
    from posttrain.commands.train import train_config

    monkeypatch.setenv(packed_linear.ENV, "on")
    engines, seen = [], []
    generate, update = NativeEngine.generate, TrainEngine.update

    def generate_spy(self, *args, **kwargs):
        engines.append(self)
        seen.append(("generate", sum(p.grad is not None for p in self.model.parameters())))
        out = generate(self, *args, **kwargs)
        seen.append(("generated", len(self._packs.packs) + len(self._packs.fused)))
        return out

    def update_spy(self, *args, **kwargs):
        seen.append(("update", sum(len(e._packs.packs) + len(e._packs.fused) for e in engines)))
        out = update(self, *args, **kwargs)
        seen.append(("updated", sum(p.grad is not None for p in self.model.parameters())))
        return out

    monkeypatch.setattr(NativeEngine, "generate", generate_spy)
    monkeypatch.setattr(TrainEngine, "update", update_spy)
    train_config(world_run_config(mini_world, tmp_path / "run", iters=2))
    kinds = [kind for kind, _ in seen]
    assert kinds.count("generate") >= 2 and kinds.count("update") == 2 and kinds.index("update") > 0
    assert all(count > 0 for kind, count in seen if kind in ("generated", "updated"))  # each made them
    assert all(count == 0 for kind, count in seen if kind in ("generate", "update"))  # the other let them go

