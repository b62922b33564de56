"""Producing one on-policy iteration's experience: prompts, their samples and their scores.

    put prompts (x n) -> rollout -> reward

:class:`Producer` fills a fresh TransferDock (:mod:`posttrain.loops.experience`) for an
iteration, sampling with a given engine whose weights are a given version (the trainer's now, or
a rollout replica's, :mod:`posttrain.loops.sources`). How the samples are generated is a
:class:`Generation`: plain (:class:`PlainGeneration`: the next batch of prompts, each sampled ``n``
times) or partial rollout (:class:`PartialGeneration`: rounds over two batches of prompts,
:mod:`posttrain.loops.partial_rollout`). DAPO's dynamic sampling
(:mod:`posttrain.loops.dynamic_sampling`) repeats generate-and-score until enough groups vary.

The reward is the rule verifiers' score and/or a reward model's (``reward_config``) and/or an LLM
judge's (``rl_config.judge_path``, :mod:`posttrain.reward.judge`), by weight; with
``rl_config.env_config`` the environment's (a verifiers taskset's reward functions, in place of
the verifiers; an OpenEnv-style environment's episode rewards, :mod:`posttrain.loops.env_turns`).

A multimodal run (``rl_config.is_multimodal``) puts each prompt's images beside it (its image pads
expanded, ``pixel_values`` and ``image_grid_thw`` per row: :mod:`posttrain.loops.multimodal`) and
passes them to the engine's ``generate(images=)`` (partial rollout: the pool keeps them and
continues each sample with them); DAPO's kept groups bring them along.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from posttrain.config.plan import Plan
from posttrain.metrics.reduce import MetricAccumulator
from posttrain.metrics.timers import Timers
from posttrain.reward.decoding import decode_labels, decode_responses
from posttrain.loops.dynamic_sampling import DynamicSampler, score_columns
from posttrain.loops.env_turns import EnvTurns
from posttrain.loops.experience import MULTI_TURN_COLUMNS, new_dock
from posttrain.loops.multimodal import EMBEDS_COLUMN, dock_columns, encode_prompts, rollout_images
from posttrain.models.vlm import MM_KEYS
from posttrain.loops.partial_rollout import STATE_FILE, PartialRollout
from posttrain.loops.resume_files import load_partial
from posttrain.loops.session import Session
from posttrain.transfer_dock import TransferDock


@dataclass
class Experience:
    """One iteration's prompts, samples and scores in their TransferDock, and what producing them
    measured: phase timers, reward metrics, and the engine's and dynamic sampling's metrics."""

    td: TransferDock
    timers: Timers = field(default_factory=Timers)
    acc: MetricAccumulator = field(default_factory=MetricAccumulator)
    metrics: dict[str, float] = field(default_factory=dict)
    num_gen_batches: int = 1


class Generation(Protocol):
    """Fills a dock with prompts and their samples (``rollout``, ``response_length``,
    ``rollout_logprobs``, ``policy_version``)."""

    def fill(self, td: TransferDock, iteration: int, engine, version: int, timers: Timers,
             acc: MetricAccumulator) -> None: ...

    def state_files(self) -> dict[str, Any]:
        """What a checkpoint saves of it, by file name."""
        ...


class PlainGeneration:
    """The sampler's next batch of prompts, each sampled ``n`` times. A prompt's random stream is
    keyed by its group in the dock (row // n: its index in the iteration's batch), so the samples
    do not depend on the dispatch size, the dock's read order or the number of workers."""

    def __init__(self, plan: Plan, session: Session, extra: tuple[str, ...]):
        self.plan, self.s, self.extra = plan, session, extra
        self.images = plan.multimodal is not None  # each prompt's images (loops/multimodal.py)

    def fill(self, td, iteration, engine, version, timers, acc) -> None:
        items = next_items(self.s)
        prompts, labels = prompt_ids(items), prompt_labels(items)
        columns = {}
        if self.images:  # the image pads expanded, and each prompt's pixel_values / image_grid_thw
            policy = self.s.policy
            prompts, columns = encode_prompts(policy.processor, policy.image_token_id, items)
        td.put_prompts({"prompts": prompts, "prompt_length": [len(p) for p in prompts], "labels": labels, **columns})
        with timers("rollout"):
            self.rollout(td, iteration, engine, version)

    def rollout(self, td: TransferDock, iteration: int, engine, version: int) -> None:
        n, policy = self.plan.n, self.s.policy
        stops, sampling = policy.stop_token_ids, self.s.sampling_for(iteration)
        while not td.all_consumed("rollout"):
            batch, idx = td.get("rollout", ["prompts", *(MM_KEYS if self.images else ())],
                                self.plan.reads["actor_rollout_dispatch_size"], get_n_samples=True)
            unique = [batch["prompts"][k].tolist() for k in range(0, len(idx), n)]
            keys = [idx[k] // n for k in range(0, len(idx), n)]
            images = {"images": rollout_images(batch, n)} if self.images else {}
            outs = [o for group in engine.generate(unique, n, sampling, stops, prompt_keys=keys, **images)
                    for o in group]
            responses = [torch.tensor(o.token_ids, dtype=torch.long) for o in outs]
            td.put(["responses", "response_length", "rollout_logprobs", "policy_version"], idx,
                   [responses, [len(r) for r in responses],
                    [torch.tensor(o.logprobs, dtype=torch.float32) for o in outs], [version] * len(idx)])
            if self.extra:  # the sampled tokens' mask (0 on tool tokens) and the calls of each sample
                td.put(list(MULTI_TURN_COLUMNS), idx, [[torch.tensor(o.response_mask, dtype=torch.long) for o in outs],
                                                      [o.tool_call_num for o in outs]])

    def state_files(self) -> dict[str, Any]:
        return {}


class PartialGeneration:
    """Partial rollout (``partial_rollout_max_split`` N > 1): rounds over two batches of prompts
    until an update's groups are complete; the dock is resumed from the checkpoint's. A multimodal
    run's pool keeps each prompt's images and continues its samples with them."""

    def __init__(self, plan: Plan, session: Session):
        off, r = plan.off_policy, plan.rollout
        self.s, self.gbs = session, plan.prompts_per_iteration
        self.pool = PartialRollout(n=plan.n, global_batch_size=self.gbs, max_split=off.partial_max_split,
                                   max_tokens=r.sampling.max_tokens, max_model_len=r.max_model_len,
                                   require_max_age_all_finished=off.require_max_age_all_finished,
                                   images=plan.multimodal is not None)
        path = session.trainer_state.get("checkpoint_dir") if session.iteration else None
        if path and (Path(path) / STATE_FILE).is_file():
            load_partial(Path(path) / STATE_FILE, self.pool.dock)

    def fill(self, td, iteration, engine, version, timers, acc) -> None:
        """Fill the pool's free groups with prompts, run rounds until an update is ready, and put the
        update's groups (oldest first) into ``td``."""
        pool, policy = self.pool, self.s.policy
        with timers("rollout"):
            while len(pool.free_groups()) >= self.gbs:
                items = next_items(self.s)
                prompts, images = prompt_ids(items), None
                if pool.images:  # the image pads expanded, and each prompt's pixel_values / image_grid_thw
                    prompts, images = encode_prompts(policy.processor, policy.image_token_id, items)
                pool.add_prompts([p.tolist() for p in prompts], prompt_labels(items), images)
            pool.fill(engine, self.s.sampling_for(iteration), policy.stop_token_ids, version)
            batch, metrics = pool.take()
            columns = ["prompts", "prompt_length", "labels", "responses", "rollout_logprobs", "policy_version",
                       *(MM_KEYS if pool.images else ())]
            td.put([*columns, "response_length"], list(range(td.max_len)),
                   [batch[c] for c in columns] + [[r.numel() for r in batch["responses"]]])
        acc.update(metrics)

    def state_files(self) -> dict[str, Any]:
        return {STATE_FILE: self.pool.state_dict()}


def next_prompts(session: Session) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The next batch of prompts from the session's sampler, and their labels."""
    items = next_items(session)
    return prompt_ids(items), prompt_labels(items)


def next_items(session: Session) -> list[dict[str, Any]]:
    """The dataset items of the next batch of prompts from the session's sampler."""
    return [session.dataset[i] for i in session.sampler.next_batch()]


def prompt_ids(items: list[dict[str, Any]]) -> list[torch.Tensor]:
    return [torch.as_tensor(it["prompts"], dtype=torch.long) for it in items]


def prompt_labels(items: list[dict[str, Any]]) -> list[torch.Tensor]:
    return [torch.as_tensor(it.get("labels", []), dtype=torch.long) for it in items]


class Producer:
    """``producer(iteration, engine, version) -> Experience``: generate (plain or partial) and score,
    repeated by DAPO's dynamic sampling until the update's batch is full."""

    def __init__(self, plan: Plan, session: Session):
        self.plan, self.s = plan, session
        env_turns = plan.data.env is not None and plan.data.env.multi_turn  # an environment answers each turn
        self.extra = MULTI_TURN_COLUMNS if plan.rollout.tools is not None or env_turns else ()  # tool-token mask, calls
        mm = plan.multimodal
        self.image_columns = dock_columns(mm.reuse_image_embeds) if mm is not None else ()  # loops/multimodal.py
        self.generation: Generation = (EnvTurns(plan, session, next_prompts) if env_turns
                                       else PartialGeneration(plan, session) if plan.off_policy.partial
                                       else PlainGeneration(plan, session, self.extra))
        carry = (*self.extra, *(MM_KEYS if mm is not None else ()))  # what a kept DAPO group brings along
        self.dynamic = (DynamicSampler(plan.dynamic_sampling, n=plan.n, global_batch_size=plan.prompts_per_iteration,
                                       train_prompts=plan.prompts_per_update, seed=plan.policy.seed,
                                       guarantee_order=plan.guarantee_order, carry=carry, queue=session.queue)
                        if plan.dynamic_sampling is not None else None)

    def __call__(self, iteration: int, engine, version: int) -> Experience:
        """Prompts, their samples (by ``engine``, whose weights are ``version``) and their scores."""
        exp = Experience(self.new_dock(iteration))

        def generate_and_score(td, it, timers, acc):
            self.generation.fill(td, it, engine, version, timers, acc)
            self.reward(td, acc, timers)

        if self.dynamic is not None:  # DAPO: generate and filter until the batch is full
            self.dynamic.fill(generate_and_score, exp.td, exp.timers, exp.acc, iteration)
            exp.metrics.update(self.dynamic.metrics())
            exp.num_gen_batches = self.dynamic.num_gen_batches
        else:
            generate_and_score(exp.td, iteration, exp.timers, exp.acc)
        exp.metrics.update(engine.pop_metrics())  # multi-turn: timing/tool, tool/*
        return exp

    def new_dock(self, iteration: int) -> TransferDock:
        """The empty dock of iteration ``iteration``'s experience."""
        embeds = (EMBEDS_COLUMN,) if EMBEDS_COLUMN in self.image_columns else ()  # its phase reads the dock
        return new_dock(self.plan.rows_per_update, self.plan.n, guarantee_order=self.plan.guarantee_order,
                        seed=self.plan.policy.seed + iteration, extra_columns=(*self.extra, *self.image_columns),
                        extra_consumers=embeds, queue=self.s.queue)

    def state_files(self) -> dict[str, Any]:
        return self.generation.state_files()

    # ---- the reward ------------------------------------------------------------------------------
    def reward(self, td: TransferDock, acc: MetricAccumulator, timers: Timers | None = None) -> None:
        """Each response's score: the rule reward (``rl_config.rule_reward``, timed as ``rule_reward``)
        plus ``rl_config.reward_model_weight`` x the reward model's score (``reward_config``, timed as
        ``reward_model``, logged as ``reward_model/score/{mean,max,min}``) plus ``rl_config.judge_weight`` x
        the judge's score (``rl_config.judge_path``, timed as ``judge``, logged as ``judge/*``)."""
        timers = timers if timers is not None else Timers()
        model = self.s.reward_model
        while not td.all_consumed("reward"):
            batch, idx = td.get("reward", ["prompts", "responses", "labels", "response_length",
                                           *(["tool_call_num"] if self.extra else [])],
                                self.plan.reads["reward_dispatch_size"])
            scores = [0.0] * len(idx)
            if isinstance(self.generation, EnvTurns):  # the episodes' rewards, summed while they ran
                scores = self.generation.scores(idx)
            elif self.plan.scores_by_rules:
                with timers("rule_reward"):
                    scores = self.rule_scores(td, batch, idx, acc)
            if model is not None:
                with timers("reward_model"):
                    model_scores = model.score_sequences([p.tolist() for p in batch["prompts"]],
                                                         [r.tolist() for r in batch["responses"]])
                weight = self.plan.reward_model.weight
                scores = [score + weight * m for score, m in zip(scores, model_scores)]
                acc.update({f"reward_model/score/{k}": model_scores for k in ("mean", "max", "min")})
            if self.plan.judge is not None:
                with timers("judge"):
                    scores = self.judge_scores(batch, scores, acc)
            td.put(["scores"], idx, [torch.tensor(scores, dtype=torch.float32)])

    def judge_scores(self, batch: dict, scores: list[float], acc: MetricAccumulator) -> list[float]:
        """``scores`` plus ``rl_config.judge_weight`` x the judge's score of each response (one read)."""
        tokenizer = self.s.policy.tokenizer
        prompts = decode_responses(tokenizer, [p.tolist() for p in batch["prompts"]])
        texts = decode_responses(tokenizer, [r.tolist() for r in batch["responses"]])
        references = decode_labels(tokenizer, [r.tolist() for r in batch["labels"]])
        result = self.s.judge.score(prompts, texts, references)
        acc.update(result.metrics)
        weight = self.plan.judge.weight
        return [score + weight * j for score, j in zip(scores, result.scores)]

    def rule_scores(self, td: TransferDock, batch: dict, idx: list[int], acc: MetricAccumulator) -> list[float]:
        """The rule verifiers' weighted scores of one read (and DAPO's per-verifier filter column)."""
        tokenizer = self.s.policy.tokenizer
        texts = decode_responses(tokenizer, [r.tolist() for r in batch["responses"]])
        labels = decode_labels(tokenizer, [r.tolist() for r in batch["labels"]])
        lengths = [int(x) for x in batch["response_length"]]
        columns = {"tool_call_num": [int(x) for x in batch["tool_call_num"]]} if "tool_call_num" in batch else {}
        result = self.s.rule_reward.score_detailed(texts, labels, response_lengths=lengths, **columns)
        names, per_verifier = score_columns(td, result.per_verifier)  # DAPO's filter metric, when the dock has it
        if names:
            td.put(names, idx, per_verifier)
        acc.update(result.metrics)
        return list(result.scores)
