"""``rl_config.blocking: false``: the independent passes of an iteration, started together.

With roles in worker groups of their own (``use_integrated_worker: false``, docs/cluster.md), the
reference's log-probs, the actor's old log-probs and PPO's critic values need only the rollout's
rows, and run on different workers. :func:`overlapped_passes` reads every batch of each pass from
the TransferDock in the order the blocking loop reads them (so the dock's row choices, and with
them every later read, are those of ``blocking: true``), starts each call without waiting
(``start_logprobs`` / ``start_values`` of the Ray proxies, :mod:`posttrain.cluster.role_groups`),
then waits for all of them at once (:meth:`posttrain.cluster.group.Cluster.wait_all`: one
``ray_timeout_s`` deadline, the first failure reported as it happens) and writes the results back.
The metrics are those of ``blocking: true``; each pass's timer (``timing/reference_model``,
``timing/old_log_p``, ``timing/critic_model``) spans the overlapped wait.
"""

from __future__ import annotations

import time

from posttrain.loops.experience import read_batch, write_rows
from posttrain.metrics.timers import Timers
from posttrain.transfer_dock import TransferDock


def independent_passes(trainer) -> list[tuple]:
    """(timer, dock consumer, column written, read size, start(batch) -> Pending) of each pass."""
    s, plan = trainer.s, trainer.plan
    temperature = plan.logprob_temperature
    passes = []
    if s.policy.reference is not None:
        micro = plan.update.ref_micro_batch_size
        passes.append(("reference_model", "ref_logprobs", "ref_logprobs", plan.reads["ref_dispatch_size"],
                       lambda b: s.policy.reference.start_logprobs(b, temperature=temperature,
                                                                   micro_batch_size=micro)))
    if not plan.skip_old_logprobs:
        micro_old = plan.update.old_micro_batch_size
        passes.append(("old_log_p", "old_logprobs", "old_logprobs", plan.reads["actor_logprob_dispatch_size"],
                       lambda b: s.policy.actor.start_logprobs(b, temperature=temperature,
                                                               micro_batch_size=micro_old)))
    if trainer.critic is not None:
        passes.append(("critic_model", "critic_values", "values", plan.reads["critic_value_dispatch_size"],
                       lambda b: s.critic.start_values(b)))
    return passes


def overlapped_passes(trainer, td: TransferDock, timers: Timers) -> None:
    """Every independent pass's calls started, then awaited together; their columns written."""
    s = trainer.s
    begin, started = time.time(), []
    for timer, consumer, column, count, start in independent_passes(trainer):
        while not td.all_consumed(consumer):
            batch, idx, lengths = read_batch(td, consumer, [], count, pad_token_id=s.policy.pad_token_id,
                                             device=s.device)
            started.append((timer, column, idx, lengths, start(batch)))
    results = s.cluster.wait_all([pending for *_, pending in started])
    end = time.time()
    for (_, column, idx, lengths, _), values in zip(started, results):
        write_rows(td, [column], idx, [values], lengths)
    for timer in dict.fromkeys(timer for timer, *_ in started):
        timers.record(timer, begin, end)
