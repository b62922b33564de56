"""The pure parts of posttrain.cluster (no Ray started): when a run goes to Ray, how update rows are
shared out, the runtime env, and how reward shares are merged."""

from __future__ import annotations

import pytest
import torch

from tests.cluster.cluster_helpers import grpo_config


def test_uses_ray_for_more_than_one_device_or_an_address(tmp_path, monkeypatch):
    from posttrain.config.check import uses_ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert not uses_ray(grpo_config(tmp_path, "a", workers=1, iters=1))
    assert uses_ray(grpo_config(tmp_path, "b", workers=2, iters=1))
    assert uses_ray(grpo_config(tmp_path, "c", workers=1, iters=1, rl={"ray_address": "10.0.0.1:6766"}))
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    assert uses_ray(grpo_config(tmp_path, "d", workers=1, iters=1))


def test_the_plan_reads_w_times_the_per_worker_dispatch_sizes(tmp_path, monkeypatch):
    """The seed's dispatch sizes are per data-parallel worker; the driver reads them for all W at
    once, derived once in the plan (the config is never rewritten)."""
    from posttrain.config.plan import resolve_plan

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = grpo_config(tmp_path, "w", workers=2, iters=1)
    plan = resolve_plan(cfg, device="cpu")
    assert plan.workers == 2 and plan.dispatch_sizes["actor_update_dispatch_size"] == 16  # 4 x 8 / DP 2
    assert plan.reads["actor_update_dispatch_size"] == 32 and plan.reads["adv_dispatch_size"] == 32
    assert cfg.rl.actor_update_dispatch_size is None


@pytest.mark.parametrize(("shuffle", "epochs"), [(False, 1), (True, 2)])
def test_update_shards_give_every_rank_a_slice_of_every_engine_mini_batch(shuffle, epochs):
    from posttrain.cluster.shares import update_shards

    rows, mini, world = 32, 8, 2
    shards = update_shards(rows, mini, world, epochs, shuffle, seed=7)
    local = mini // world
    steps = []  # the engine's mini-batches (TrainEngine.update's order)
    for epoch in range(epochs):
        order = torch.randperm(rows, generator=torch.Generator().manual_seed(7 + epoch)) if shuffle \
            else torch.arange(rows)
        steps += [order[i:i + mini] for i in range(0, rows, mini)]
    for k, step in enumerate(steps):
        got = torch.cat([shards[r][k * local:(k + 1) * local] for r in range(world)])
        assert torch.equal(got, step)


def test_update_shards_reject_a_mini_batch_the_workers_cannot_share():
    from posttrain.cluster.shares import update_shards
    from posttrain.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot be shared equally by 3 data-parallel replicas"):
        update_shards(16, 8, 3, 1, False, 0)


def test_spans_are_contiguous_and_balanced():
    from posttrain.cluster.shares import spans

    assert spans(5, 2) == [(0, 2), (2, 5)]
    assert spans(1, 3) == [(0, 1)]  # idle workers are not called


def test_runtime_env_has_the_seed_vars_and_rejects_a_bad_file(tmp_path):
    from posttrain.config.runtime_env import runtime_env_vars
    from posttrain.errors import ConfigError

    env = runtime_env_vars(grpo_config(tmp_path, "e", workers=2, iters=1))
    assert env["HCCL_CONNECT_TIMEOUT"] == "1800" and env["HCCL_BUFFSIZE"] == "256"
    bad = tmp_path / "env.yaml"
    bad.write_text("env_vars: [A, B]\n")
    with pytest.raises(ConfigError, match="env.yaml"):
        runtime_env_vars(grpo_config(tmp_path, "f", workers=2, iters=1, rl={"runtime_env_path": str(bad)}))


def test_reward_shares_merge_with_count_weighted_means():
    from posttrain.cluster.reward import merge
    from posttrain.reward.rule_reward import RewardBatch

    a = RewardBatch([1.0], {"v": [1.0]}, {"v": [0]}, {"v_rewards/mean": 1.0, "reward/errors": 0.0})
    b = RewardBatch([0.0, 0.0, 1.0], {"v": [0.0, 0.0, 1.0]}, {"v": [0, 2, 0]},
                    {"v_rewards/mean": 1 / 3, "reward/errors": 1.0}, ["boom"])
    out = merge([a, b], [1, 3])
    assert out.scores == [1.0, 0.0, 0.0, 1.0] and out.status["v"] == [0, 0, 2, 0]
    assert out.metrics["v_rewards/mean"] == pytest.approx(0.5) and out.metrics["reward/errors"] == 1.0
    assert out.errors == ["boom"]


@pytest.mark.parametrize("stage", ["ray_grpo", "ray_ppo"])
def test_a_mini_batch_the_workers_cannot_share_is_refused_by_the_plan(stage):
    """PPO's critic is updated on the same slices of each mini-batch as the actor: the seed's rule
    names the rows and the worker count (actor_dp) for both."""
    from posttrain.config.plan import resolve_plan
    from posttrain.config.run import run_config_from_dict
    from posttrain.errors import ConfigError

    cfg = run_config_from_dict({
        "megatron_training": {"stage": stage, "global_batch_size": 6, "micro_batch_size": 2, "seq_length": 64},
        "rl_config": {"n_samples_per_prompt": 2, "mini_batch_size": 2, "actor_resource": {"num_npus": 3},
                      "use_kl_in_reward": stage == "ray_ppo", "device": "cpu",
                      "adv_estimator": "gae" if stage == "ray_ppo" else "group_norm"},
        "generate_config": {"max_model_len": 64, "infer_tensor_parallel_size": 1}})
    with pytest.raises(ConfigError, match=r"mini_batch_size \* n_samples_per_prompt / actor_dp = 4/3 must be "
                                          r"divisible by micro_batch_size 2"):
        resolve_plan(cfg, device="cpu")


class _Workers:
    """The answers of a worker group's ``_all`` calls, by method (no Ray)."""

    def __init__(self, holds_weights: bool, answers: dict):
        self.rollout_holds_weights, self.answers, self.calls = holds_weights, answers, []
        self.info = [{"leader": True, "rollout_supports_rounds": not holds_weights}]

    def _check(self) -> None:
        pass

    def _all(self, what: str, method: str):
        self.calls.append(method)
        return self.answers[method]


def test_the_rollout_role_syncs_every_worker_and_keeps_the_largest_probe_difference():
    """vLLM engines in the workers: one sync call to every worker, its count returned (the loop
    times it); the probe metric is the largest over the workers, other engine counters stay there.
    Native engines: no call at all."""
    from posttrain.cluster.group import RolloutRole

    vllm = _Workers(True, {"sync_rollout": [26, 26], "rollout_metrics": [
        {"rollout/sync_probe_diff": 2e-7}, {"rollout/sync_probe_diff": 5e-7, "rollout/draft_tokens": 3.0}]})
    role = RolloutRole(vllm, 256)
    assert role.sync_weights(None) == 26
    assert role.pop_metrics() == {"rollout/sync_probe_diff": 5e-7}
    assert vllm.calls == ["sync_rollout", "rollout_metrics"]
    native = _Workers(False, {})
    assert RolloutRole(native, 256).sync_weights(None) is None and RolloutRole(native, 256).pop_metrics() == {}
    assert native.calls == []


def test_a_driver_joining_a_cluster_sends_the_token_when_it_has_one(tmp_path, monkeypatch):
    """``ray start --head`` (Ray >= 2.5x) requires the token when one exists; ``ray.init(address)``
    does not send it unless RAY_AUTH_MODE=token: the driver sets it when a token is at hand and the
    mode is unset, and keeps an explicit mode."""
    import os

    from posttrain.cluster.launch import token_auth_if_available

    monkeypatch.setenv("HOME", str(tmp_path))
    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(key, raising=False)
    token_auth_if_available()
    assert "RAY_AUTH_MODE" not in os.environ  # no token: nothing to send
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("x" * 32)
    token_auth_if_available()
    assert os.environ["RAY_AUTH_MODE"] == "token"
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    token_auth_if_available()
    assert os.environ["RAY_AUTH_MODE"] == "disabled"


def test_balanced_update_shards_give_equal_counts_of_each_step_and_restore_nothing_lost():
    """rl_config.use_dp_batch_balance: every global mini-batch is still shared by all ranks, the same
    number of rows each, but by tokens: on a skewed batch the ranks' token sums of a step are equal."""
    from posttrain.cluster.shares import update_shards
    from posttrain.training.engine import minibatch_order

    lengths = [80] * 8 + [10] * 8
    plain = update_shards(16, 8, 2, 1, False, 0)
    balanced = update_shards(16, 8, 2, 1, False, 0, lengths)
    steps = minibatch_order(16, 8)
    for rank_rows in (plain, balanced):
        assert [len(r) for r in rank_rows] == [8, 8]
    for s, step in enumerate(steps):  # each step's rows, split between the ranks
        got = [r[s * 4:(s + 1) * 4] for r in balanced]
        assert sorted(torch.cat(got).tolist()) == sorted(step.tolist())
    sums = [[sum(lengths[i] for i in r[s * 4:(s + 1) * 4].tolist()) for r in balanced] for s in range(2)]
    assert sums == [[320, 320], [40, 40]]  # contiguous: the first step 320 | 320 too, but the
    assert [sum(lengths[i] for i in r.tolist()) for r in update_shards(16, 8, 2, 1, True, 3, lengths)] == [360, 360]


def test_balanced_pass_shares_come_back_in_row_order():
    from posttrain.cluster.shares import in_order, shares, token_lengths

    batch = {"attention_mask": torch.tensor([[1] * 8] * 3 + [[1, 0, 0, 0, 0, 0, 0, 0]] * 3),
             "rows": torch.arange(6)}
    lengths = token_lengths(batch)
    assert lengths == [8, 8, 8, 1, 1, 1]
    rows = shares(6, 2, lengths)
    assert [len(r) for r in rows] == [3, 3] and rows[0].tolist() != [0, 1, 2]
    parts = [batch["rows"][r] * 10 for r in rows]  # a worker's answer for its rows
    assert in_order(parts, rows).tolist() == [0, 10, 20, 30, 40, 50]
    assert [r.tolist() for r in shares(6, 2)] == [[0, 1, 2], [3, 4, 5]]
    assert [r.tolist() for r in shares(1, 3, [5], keep_empty=True)] == [[], [], [0]]
