"""The GPUs of a Megatron replica leader's vLLM workers (posttrain.roles.megatron_view.pick_rollout_gpus)
and the environment the engine starts them in (posttrain.rollout.vllm_engine._separate_processes):
plain functions, so they are checked here on a CPU; the tensor-parallel engine itself runs on a CPU
in tests/vllm/test_vllm_megatron.py."""

from __future__ import annotations

import os

import pytest

from posttrain.errors import ConfigError
from posttrain.roles.megatron_view import pick_rollout_gpus
from posttrain.rollout.vllm_engine import _separate_processes


def test_the_first_ranks_gpus_on_the_leaders_node_in_group_order():
    ranks = [("node-a", "3"), ("node-a", "5"), ("node-b", "0"), ("node-a", "6"), ("node-a", "7")]
    assert pick_rollout_gpus(ranks, 2) == "3,5"
    assert pick_rollout_gpus(ranks, 4) == "3,5,6,7"  # node-b's rank is skipped
    assert pick_rollout_gpus([("n", "2,3"), ("n", "4")], 2) == "2,4"  # a rank's first GPU
    assert pick_rollout_gpus([("n", "1"), ("n", "1"), ("n", "2")], 2) == "1,2"  # a shared GPU counts once


def test_a_replica_with_too_few_gpus_on_the_leaders_node_is_refused_by_key():
    with pytest.raises(ConfigError, match=r"infer_tensor_parallel_size=4: .* the replica has 2 there; .* set it to "
                                          r"at most 2"):
        pick_rollout_gpus([("node-a", "0"), ("node-a", "1"), ("node-b", "0"), ("node-b", "1")], 4)


def test_vllm_processes_see_the_given_gpus_and_the_environment_is_restored(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # what Ray gave the leader
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    with _separate_processes(True, False, "3,5"):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "3,5"
        assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3" and "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
    with _separate_processes(True, False):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"  # untouched without visible_devices
