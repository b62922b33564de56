"""The trainer's waits on the rollout thread (loops/pipeline.py) end: an error in the thread is raised
in the trainer, and a thread that has ended never leaves the trainer waiting for what it will not bring."""

from __future__ import annotations

import types

import pytest

from posttrain.errors import PosttrainError
from posttrain.loops.pipeline import RolloutPipeline


class Replica:  # the weights the thread samples with: nothing to copy here (k = 0 loads none)
    shares_trainer_engine = False
    engine = None

    def snapshot(self, model):
        return {}

    def load(self, snapshot) -> None:
        pass

    def close(self) -> None:
        pass


def produce(iteration, engine, version):
    return types.SimpleNamespace(iteration=iteration, timers=None)


@pytest.mark.timeout(30)
def test_a_wait_past_the_last_iteration_names_what_it_waited_for_instead_of_hanging():
    pipeline = RolloutPipeline(produce, Replica(), staleness=0, start=0, last=1)
    try:
        out, _, _ = pipeline.experience(1)
        assert out.iteration == 1
        with pytest.raises(PosttrainError, match=r"ended \(after iteration 1 of 1\) while the trainer waited for "
                                                 r"the experience of iteration 2"):
            pipeline.experience(2)
    finally:
        pipeline.close()


@pytest.mark.timeout(30)
def test_an_error_in_the_thread_reaches_the_trainer():
    def failing(iteration, engine, version):
        raise ValueError("the reward step failed")

    pipeline = RolloutPipeline(failing, Replica(), staleness=0, start=0, last=2)
    try:
        with pytest.raises(ValueError, match="the reward step failed"):
            pipeline.experience(1)
    finally:
        pipeline.close()
