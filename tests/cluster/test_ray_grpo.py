"""GRPO on 2 Ray CPU workers against 1 in-process worker.

* Same experience in, same update out: the reference and old log-probs, the per-step loss,
  KL and gradient norm, the gradients of the last step and the weights after the iteration
  (2 epochs x 2 shuffled mini-batches) match the in-process engine within float tolerance.
* With ``rl_config.use_dp_batch_balance`` (rows shared by tokens) the log-probs and the update still
  equal the one-process ones within 1e-5, on-policy distillation's teacher's log-probs and the
  update with its term (``teacher_model``, a frozen copy in every worker) too.
* The whole loop learns on 2 workers: the lowercase reward goes up over 12 iterations, as it does
  in process, and the 2-worker checkpoint resumes on 1 in-process worker.
* A whole run does not depend on the worker count: GRPO (with KL and shuffled epochs), DAPO
  (dynamic sampling) and PPO (its colocated critic) on 2 workers draw the same responses and log the
  same metrics as in process.
"""

from __future__ import annotations

import copy

import pytest
import torch

from posttrain.models import packed_linear
from tests.cluster.cluster_helpers import column, grpo_config, record_run, sample, session_and_trainer
from tests.helpers.runs import read_metrics

pytestmark = pytest.mark.ray


@pytest.mark.parametrize("sharding", ["ddp", "fsdp2"])
def test_two_workers_update_equals_one_process_on_the_same_batch(ray_cluster, work, sharding, monkeypatch):
    """DDP replicas or FSDP2 shards: the same step as one process; the saved state (gathered from the
    shards for FSDP2) resumes in one process with the same weights and AdamW moments. The workers
    compute their linear layers with the driver's plan's fp32 kernel (oneDNN here; the process
    itself keeps PyTorch's BLAS), and the step still equals the one-process step."""
    from posttrain.metrics.reduce import MetricAccumulator
    from posttrain.models import cpu_linear
    from posttrain.loops.experience import new_dock

    over = {"epochs": 2, "shuffle_mini_batch": True, "init_kl_coef": 0.05, "guarantee_order": True}
    local, local_trainer = session_and_trainer(grpo_config(work, f"eq_local_{sharding}", workers=1, iters=1, rl=over))
    monkeypatch.setenv(cpu_linear.ENV, "onednn")  # resolved into the plan by the driver
    remote, remote_trainer = session_and_trainer(grpo_config(work, f"eq_ray_{sharding}", workers=2, iters=1,
                                                             rl={**over, "ray_sharding": sharding}))
    monkeypatch.setenv(cpu_linear.ENV, "blas")
    try:
        assert remote.policy.model is None and remote.cluster.world == 2  # the driver holds no weights
        assert {i["pid"] for i in remote.cluster.info} and all(i["threads"] == 1 for i in remote.cluster.info)
        want = "onednn" if cpu_linear.available() else "blas"
        assert remote.cpu_linear == want and cpu_linear.installed() == "blas"
        assert all(i["cpu_linear"] == want for i in remote.cluster.info)
        # one experience batch, made in process: rollout, reward, advantages
        td = new_dock(local_trainer.plan.rows_per_update, 8, guarantee_order=True, seed=0)
        sample(local_trainer, td)
        local_trainer.producer.reward(td, MetricAccumulator())
        local_trainer.advantages(td)
        assert column(td, "advantages").abs().sum() > 0
        docks = {"local": td, "ray": copy.deepcopy(td)}
        metrics = {}
        for key, trainer, s in (("local", local_trainer, local), ("ray", remote_trainer, remote)):
            reads = trainer.plan.reads
            assert not trainer.plan.skip_old_logprobs
            trainer.logprobs(docks[key], "ref_logprobs", s.policy.reference, reads["ref_dispatch_size"], None)
            trainer.logprobs(docks[key], "old_logprobs", s.policy.actor, reads["actor_logprob_dispatch_size"], None)
            acc = MetricAccumulator()
            trainer.update(docks[key], acc, 1)
            metrics[key] = acc.reduce()
        for name in ("ref_logprobs", "old_logprobs"):
            torch.testing.assert_close(column(docks["ray"], name), column(docks["local"], name), rtol=1e-5, atol=1e-5)
        for name in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy"):
            assert metrics["ray"][name] == pytest.approx(metrics["local"][name], rel=1e-4, abs=1e-6), name
        assert metrics["local"]["actor/grad_norm"] > 0
        grads = remote.cluster.grads()
        for name, grad in local.policy.model.named_parameters():
            torch.testing.assert_close(grads[0][name], grad.grad, rtol=1e-3, atol=1e-6)
            torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=0)  # DDP: identical on ranks
        weights = remote.cluster.state_dicts()
        for name, value in local.policy.model.state_dict().items():
            torch.testing.assert_close(weights[0][name], value, rtol=1e-4, atol=1e-5)
            assert torch.equal(weights[1][name], weights[0][name]), name
        # rank 0 saves the full state; one process resumes it
        ckpt = work / f"ckpt_eq_{sharding}"
        remote.cluster.save(ckpt, 1, sampler_state=remote.sampler.state_dict(), trainer_state={
            "consumed_samples": 4, "initial_model": str(work / "model")}, save_optim=True, save_rng=True)
        resumed, _ = session_and_trainer(grpo_config(work, f"eq_resumed_{sharding}", workers=1, iters=2, rl=over,
                                                     train={"load": str(ckpt)}))
        try:
            assert resumed.iteration == 1
            for name, value in local.policy.model.state_dict().items():
                torch.testing.assert_close(resumed.policy.model.state_dict()[name], value, rtol=1e-4, atol=1e-5)
            want, got = local.policy.actor.optimizer.state_dict(), resumed.policy.actor.optimizer.state_dict()
            assert sorted(got["state"]) == sorted(want["state"])
            for index, moments in want["state"].items():
                for key in ("exp_avg", "exp_avg_sq", "step"):
                    torch.testing.assert_close(got["state"][index][key], moments[key], rtol=1e-3, atol=1e-8)
            assert resumed.policy.actor.scheduler.state_dict() == local.policy.actor.scheduler.state_dict() == {
                "num_steps": 4}
        finally:
            resumed.close()
    finally:
        local.close()
        remote.close()


def small_teacher(work) -> str:
    """On-policy distillation's teacher: another model than the actor (1 layer, hidden 32, seed 3)
    with the actor's tokenizer."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    teacher = work / "teacher_1x32"
    if not teacher.exists():
        tokenizer = AutoTokenizer.from_pretrained(str(work / "model"))
        torch.manual_seed(3)
        Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                     tie_word_embeddings=True)).save_pretrained(teacher)
        tokenizer.save_pretrained(teacher)
    return str(teacher)


def test_balanced_shares_give_the_one_process_logprobs_and_update(ray_cluster, work, monkeypatch):
    """``rl_config.use_dp_batch_balance``: each worker's rows chosen by tokens instead of contiguous
    shares; the log-probs come back in row order and the update is the one-process step (where the
    key has no effect). The run distills from a teacher too (``teacher_model``, ``distill_mode:
    mixed``: a frozen copy in every worker): its log-probs and the update with the distillation term
    are the one-process ones."""
    from posttrain.cluster import group
    from posttrain.loops.experience import new_dock
    from posttrain.metrics.reduce import MetricAccumulator

    over = {"init_kl_coef": 0.05, "guarantee_order": True, "shuffle_mini_batch": True, "use_dp_batch_balance": True,
            "teacher_model": small_teacher(work), "distill_mode": "mixed"}
    local, local_trainer = session_and_trainer(grpo_config(work, "balance_local", workers=1, iters=1, rl=over))
    remote, remote_trainer = session_and_trainer(grpo_config(work, "balance_ray", workers=2, iters=1, rl=over))
    passes, steps = [], []  # what the balance chose: each pass's shares, each update's rank rows
    row_shares, update_shards = remote.cluster.row_shares, group.update_shards

    def recording_shares(count, batch=None, collective=True):
        passes.append((count, row_shares(count, batch, collective)))
        return passes[-1][1]

    def recording_update_shards(*args):
        steps.append((args, update_shards(*args)))
        return steps[-1][1]

    monkeypatch.setattr(remote.cluster, "row_shares", recording_shares)
    monkeypatch.setattr(group, "update_shards", recording_update_shards)
    try:
        assert remote.cluster.balance and local.cluster is None
        td = new_dock(local_trainer.plan.rows_per_update, 8, guarantee_order=True, seed=0)
        sample(local_trainer, td)
        local_trainer.producer.reward(td, MetricAccumulator())
        local_trainer.advantages(td)
        docks, metrics = {"local": td, "ray": copy.deepcopy(td)}, {}
        for key, trainer, s in (("local", local_trainer, local), ("ray", remote_trainer, remote)):
            reads = trainer.plan.reads
            trainer.logprobs(docks[key], "ref_logprobs", s.policy.reference, reads["ref_dispatch_size"], None)
            trainer.logprobs(docks[key], "teacher_logprobs", s.policy.teacher, reads["ref_dispatch_size"], None)
            trainer.logprobs(docks[key], "old_logprobs", s.policy.actor, reads["actor_logprob_dispatch_size"], None)
            acc = MetricAccumulator()
            trainer.update(docks[key], acc, 1)
            metrics[key] = acc.reduce()
        # the balance moved rows: some pass share and some update slice is not the contiguous one
        assert passes and any([r.tolist() for r in rows] != [r.tolist() for r in group.shares(count, 2)]
                              for count, rows in passes)
        (args, balanced), = steps
        contiguous = update_shards(*args[:-1])  # the same call without the lengths
        assert args[-1] is not None and [r.tolist() for r in balanced] != [r.tolist() for r in contiguous]
        for name in ("ref_logprobs", "teacher_logprobs", "old_logprobs"):
            torch.testing.assert_close(column(docks["ray"], name), column(docks["local"], name), rtol=1e-5, atol=1e-5)
        assert abs(metrics["local"]["distill/reverse_kl"]) > 1e-3  # the teacher is not the actor
        for name in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy", "distill/reverse_kl",
                     "distill/teacher_logprob"):
            assert metrics["ray"][name] == pytest.approx(metrics["local"][name], rel=1e-5, abs=1e-7), name
        assert metrics["local"]["actor/grad_norm"] > 0
        grads = remote.cluster.grads()
        for name, grad in local.policy.model.named_parameters():
            torch.testing.assert_close(grads[0][name], grad.grad, rtol=1e-4, atol=1e-6)
    finally:
        local.close()
        remote.close()


def mean(values):
    return sum(values) / len(values)


@pytest.fixture(scope="module")
def trained(ray_cluster, work):
    """12 GRPO iterations on 2 Ray workers and in process (packed rollout weights pinned on), each
    saving its last iteration; the Ray run records the packs its workers free before each update and
    their gradients before and after they free them after it, and what a second drop finds."""
    from posttrain.cluster.group import ActorRole, RolloutRole
    from posttrain.commands.train import train_config as train
    from posttrain.models import packed_linear

    freed = {"packs": [], "left": [], "gradients": []}
    drop, release = RolloutRole.drop_sampling_weights, ActorRole.release_gradients

    def drop_spy(self):
        freed["packs"].append(drop(self))
        freed["left"].append(drop(self))  # what a second drop finds: nothing, if the first freed all
        return freed["packs"][-1]

    def release_spy(self):
        before = sum(len(grads) for grads in self.c.grads())
        release(self)
        freed["gradients"].append((before, sum(len(grads) for grads in self.c.grads())))

    runs = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(packed_linear.ENV, "on")
        patch.setattr(RolloutRole, "drop_sampling_weights", drop_spy)
        patch.setattr(ActorRole, "release_gradients", release_spy)
        for name, workers in (("ray", 2), ("local", 1)):
            cfg = grpo_config(work, f"learn_{name}", workers=workers, iters=12,
                              rl={"eval_data_path": str(work / "prompts/data"), "eval_limit": 4},
                              train={"save": str(work / f"ckpt_{name}"), "save_interval": 12})
            last = train(cfg)
            runs[name] = {"last": last, "metrics": read_metrics(work / f"run_learn_{name}"),
                          "ckpt": work / f"ckpt_{name}"}
    runs["ray"]["freed"] = freed
    return runs


def test_reward_goes_up_on_two_workers_as_in_process(trained):
    for name, run in trained.items():
        scores = [r["grpo/score/mean"] for r in run["metrics"] if "grpo/score/mean" in r]
        assert len(scores) == 12, name
        assert mean(scores[-3:]) > mean(scores[:3]) + 0.15, (name, scores)
        assert (run["ckpt"] / "iter_0000012" / "model.safetensors").is_file()
        evals = (run["ckpt"].parent / f"run_learn_{name}" / "eval.jsonl").read_text().splitlines()
        assert len(evals) == 2 and all('"eval/num_prompts": 4.0' in line for line in evals)  # before, after
    assert "timing/update" in trained["ray"]["last"] and trained["ray"]["last"]["actor/grad_norm"] > 0


@pytest.mark.skipif(not packed_linear.available(), reason="this torch build cannot pack weights for oneDNN")
def test_the_workers_free_their_packs_before_the_update_and_their_gradients_after_it(trained):
    """As a run in one process does (tests/unit/loops/test_sync_memory.py): each iteration the workers'
    native engines free the packed weights their rollout made, and the workers the gradients their
    update made."""
    freed = trained["ray"]["freed"]
    assert len(freed["packs"]) == len(freed["gradients"]) == 12
    assert all(count > 0 for count in freed["packs"]), freed["packs"]
    assert freed["left"] == [0] * 12  # the workers' engines hold no packs through the update
    assert all(before > 0 and after == 0 for before, after in freed["gradients"]), freed["gradients"]


def checkpoint_weights(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize(("saved_by", "resumed_on", "sharding"), [("ray", 1, "ddp"), ("local", 2, "ddp"),
                                                                  ("local", 2, "fsdp2")])
def test_checkpoint_resumes_on_another_number_of_workers(trained, work, saved_by, resumed_on, sharding):
    """A 2-worker checkpoint resumes in one process, and a 1-process one on 2 workers (replicas or
    FSDP2 shards): same iteration, sampler position and weights, and training continues."""
    ckpt = trained[saved_by]["ckpt"]
    name = f"resume_{saved_by}_on_{resumed_on}_{sharding}"
    cfg = grpo_config(work, name, workers=resumed_on, iters=13, rl={"ray_sharding": sharding},
                      train={"load": str(ckpt), "save": str(work / f"ckpt_{name}"), "save_interval": 13})
    session, trainer = session_and_trainer(cfg)
    try:
        assert session.iteration == 12 and session.consumed_samples == 48
        assert session.sampler.state_dict() == torch.load(ckpt / "iter_0000012" / "sampler.pt", weights_only=True)
        saved = checkpoint_weights(ckpt / "iter_0000012")
        loaded = session.policy.model.state_dict() if resumed_on == 1 else session.cluster.state_dicts()[1]
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), key
        trainer.fit()
    finally:
        session.close()
    rows = read_metrics(work / f"run_{name}")
    assert [r["iteration"] for r in rows if "actor/pg_loss" in r] == [13]
    after = checkpoint_weights(work / f"ckpt_{name}" / "iter_0000013")
    assert any(not torch.equal(after[k], saved[k]) for k in saved)  # it trained from the resumed state


DAPO = {"verifier_function": ["e2e_has_lowercase"], "verifier_weight": [1.0], "filter_groups_enable": True,
        "filter_groups_metric": "e2e_has_lowercase", "filter_groups_train_batch_size": 2,
        "filter_groups_max_batches": 0, "clip_higher_enable": True, "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.28, "token_level_loss": True}
WALL_CLOCK = ("timing/", "e2e_tps", "update_tps", "vllm_tps")


def is_wall_clock(key: str) -> bool:
    """Timings, throughputs and the log line's timestamp: the only values the runs may differ in."""
    return key == "time" or key.startswith(WALL_CLOCK)


def same(got: float, want: float, key: str) -> bool:
    """Equal metrics: to float noise, which is all that ``rollout/logprob_diff_*`` and
    ``rollout/ratio_*`` measure on the fp32 native engine (batched decoding vs a forward pass), and
    all that is left of the mean of GAE's whitened advantages (0 by construction). ``actor/ppo_kl``
    is a mean of differences of log-probs of magnitude 1-10 (fp32 spacing there: 1e-7 to 1e-6), so
    its rounding is absolute too: the two runs pack other rows into each micro-batch, and the packed
    attention's blocks and sums follow the rows."""
    noise = key.startswith(("rollout/logprob_diff", "rollout/ratio")) or key in ("critic/advantages/mean",
                                                                                 "actor/ppo_kl")
    return got == pytest.approx(want, rel=1e-5, abs=1e-6 if noise else 1e-8)


def same_grpo(got: float, want: float, key: str) -> bool:
    """:func:`same`, and GRPO's pg_loss to float noise: a mean of ratio x advantage with advantages of
    mean 0 and ratios ~1 (1e-4 here), where the workers' sums (and a run resumed from their weights)
    leave noise of ~1e-7 absolute."""
    if key == "actor/pg_loss" and abs(want) < 1e-2:
        return got == pytest.approx(want, rel=1e-5, abs=1e-6)
    return same(got, want, key)


PPO = {"adv_estimator": "gae", "gamma": 1.0, "lam": 0.95, "use_kl_in_reward": True, "cliprange_value": 0.5}


@pytest.mark.parametrize("algorithm", ["grpo", "dapo", "ppo"])
def test_a_whole_run_on_two_workers_equals_the_run_in_one_process(ray_cluster, work, algorithm):
    """2 iterations with KL (a reference; offloaded on the GRPO workers) and 2 epochs of shuffled
    mini-batches: the same response tokens and every logged metric but the wall-clock ones within
    1e-5 relative. DAPO regenerates until enough groups vary: the same generation batches, kept
    groups and metrics. PPO: its colocated critic's values, value loss and grad norms too, and the
    workers free both models' gradients after each update."""
    from posttrain.cluster.group import ActorRole

    extra = {"dapo": DAPO, "ppo": PPO}.get(algorithm, {})
    rl = {"epochs": 2, "shuffle_mini_batch": True, "init_kl_coef": 0.05, **extra}
    train = {"stage": f"ray_{algorithm}"}
    # the 2-worker GRPO run also drops its reference between uses (rl_config.offload_reference): no
    # result may change
    offload = {"offload_reference": True} if algorithm == "grpo" else {}
    released = []  # per update on the workers: gradient tensors of the actor and the critic, before and after
    release = ActorRole.release_gradients

    def counts(actor_role) -> list[int] | None:  # PPO: gradient tensors over the workers, of each model
        if algorithm != "ppo":
            return None
        return [sum(map(len, actor_role.c.grads(model))) for model in ("actor", "critic")]

    def release_spy(self):
        before = counts(self)
        release(self)
        released.append((before, counts(self)))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ActorRole, "release_gradients", release_spy)
        runs = {name: record_run(grpo_config(work, f"same_{algorithm}_{name}", workers=workers, iters=2,
                                                          rl={**rl, **extra}, train=train))
                for name, workers, extra in (("local", 1, {}), ("ray", 2, offload))}
    assert len(released) == 2  # once an iteration, on the workers only
    (local_batches, local_rows, _), (ray_batches, ray_rows, _) = runs["local"], runs["ray"]
    assert ray_batches == local_batches
    assert len(local_batches) >= 2 and local_batches[0] != local_batches[1]  # fresh samples each batch
    local_rows, ray_rows = [r for r in local_rows if "actor/pg_loss" in r], [r for r in ray_rows if "actor/pg_loss" in r]
    assert [r["iteration"] for r in ray_rows] == [r["iteration"] for r in local_rows] == [1, 2]
    for want, got in zip(local_rows, ray_rows):
        assert sorted(got) == sorted(want)
        compared = [k for k in want if not is_wall_clock(k)]
        for key in compared:
            assert same(got[key], want[key], key), (want["iteration"], key)
        assert want["actor/grad_norm"] > 0 and len(compared) > 15
    if algorithm == "grpo":
        assert all(r["actor/kl_loss"] > 0 for r in local_rows)  # the reference is in the loss
    elif algorithm == "ppo":  # the critic trained, and the KL is in the reward
        assert all(r["critic/vf_loss"] > 0 and r["critic/grad_norm"] > 0 for r in local_rows)
        assert local_rows[-1]["actor/reward_kl_penalty"] != 0
        # the workers free both models' gradients after each update, as the loop does in one process
        assert all(min(before) > 0 and after == [0, 0] for before, after in released), released
    else:  # some iteration needed a second generation batch (its own seed)
        assert max(r["train/num_gen_batches"] for r in local_rows) >= 2 and "dapo/score/mean" in local_rows[-1]


PARTIAL = {"partial_rollout_max_split": 3}  # 12 new tokens: rounds of 4, a sample waits up to 2 iterations


def test_partial_and_async_rollout_on_two_workers_equal_the_run_in_one_process(ray_cluster, work):
    """Partial rollout with ``async_staleness: 1`` on 2 workers, 3 iterations: the rollout thread
    samples from the workers' rollout copies (loaded with the version the pipeline asks for, while
    the update runs in the workers' other thread), and each partial rollout's rounds are one decode
    over both workers' rows, checked on the driver. The same responses, ages, staleness and metrics
    as the same run in one process; the checkpoint of iteration 2 holds the same partial rollout dock
    and, resumed in one process, trains iteration 3 on the saved in-flight samples as the run did."""
    from posttrain.loops.partial_rollout import STATE_FILE

    rl = {**PARTIAL, "async_staleness": 1}
    runs = {name: record_run(grpo_config(work, f"partial_async_{name}", workers=workers, iters=3, rl=rl,
                                         train={"save": str(work / f"ckpt_partial_async_{name}"), "save_interval": 2}))
            for name, workers in (("local", 1), ("ray", 2))}
    (local_batches, local_rows, _), (ray_batches, ray_rows, _) = runs["local"], runs["ray"]
    assert ray_batches == local_batches and local_batches[1] != local_batches[2]
    local_rows, ray_rows = [r for r in local_rows if "actor/pg_loss" in r], [r for r in ray_rows if "actor/pg_loss" in r]
    assert [r["iteration"] for r in ray_rows] == [r["iteration"] for r in local_rows] == [1, 2, 3]
    for want, got in zip(local_rows, ray_rows):
        assert sorted(got) == sorted(want)
        for key in (k for k in want if not is_wall_clock(k)):
            assert same_grpo(got[key], want[key], key), (want["iteration"], key)
    assert max(r["rollout/age_max"] for r in local_rows) >= 1  # groups waited in the dock: rounds were cut
    assert local_rows[-1]["rollout/staleness_max"] >= 1  # iteration 3 sampled version 1 (or older segments)
    local, ray = (torch.load(work / f"ckpt_partial_async_{name}" / "iter_0000002" / STATE_FILE, weights_only=True)
                  for name in ("local", "ray"))
    assert_same_state(ray, local)
    _, resumed, _ = record_run(grpo_config(work, "partial_async_resumed", workers=1, iters=3, rl=rl,
                                           train={"load": str(work / "ckpt_partial_async_ray" / "iter_0000002")}))
    resumed = [r for r in resumed if "actor/pg_loss" in r]
    assert [r["iteration"] for r in resumed] == [3]
    for key in (k for k in local_rows[-1] if not is_wall_clock(k)):  # resumed from the workers' weights
        assert same_grpo(resumed[0][key], local_rows[-1][key], key), key


def assert_same_state(got, want, where="state"):
    """Nested dicts / lists of tensors and plain values: integers equal, floats to float noise."""
    assert type(got) is type(want), where
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), where
        for key in want:
            assert_same_state(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_state(g, w, f"{where}[{i}]")
    elif isinstance(want, torch.Tensor) and want.is_floating_point():
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=where)
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want), where
    else:
        assert got == want, where
