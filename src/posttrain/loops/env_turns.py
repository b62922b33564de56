"""Multi-turn rollout against an environment that answers each model turn
(``rl_config.env_config.type: openenv``, :mod:`posttrain.envs.openenv_local`): a
:class:`~posttrain.loops.produce.Generation`.

Each sample row is an episode of its task: the prompt is the reset observation; each model turn
(sampled by posttrain's engine: its tokens and log-probs are posttrain's) is the action of one
``step``; the observation comes back as the environment's turn, wrapped by the template's
``format_observation`` and fed as tokens that are not trained on (``response_mask`` 0, log-prob
0), as tool outputs are in posttrain's tool rollout. A row ends when the environment says ``done``,
after ``max_turns`` model turns, or when its response (every turn and observation) reaches
``generate_config.sampling_config.max_tokens``. Each turn re-prefills the conversation so far
(one ``generate`` call per turn for all live rows), and token ``t`` of a row's response is drawn
with the uniform keyed by (seed, prompt key, sample index, t), as in one call.

The episode's reward (the sum of its step rewards) is the row's score: :meth:`EnvTurns.scores`.
Metrics: ``env/turns/mean`` and ``env/done/mean`` (the share of episodes the environment ended).
"""

from __future__ import annotations

import torch

from posttrain.loops.experience import MULTI_TURN_COLUMNS
from posttrain.reward.decoding import decode_labels
from posttrain.rollout.multi_turn import ObservationFormat


class _Row:
    def __init__(self, episode, prompt: list[int], key: int, sample: int):
        self.episode, self.prompt, self.key, self.sample = episode, prompt, key, sample
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.mask: list[int] = []
        self.live = True

    def add(self, tokens: list[int], logprobs: list[float] | None) -> None:
        self.tokens += tokens
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)
        self.mask += [1 if logprobs is not None else 0] * len(tokens)


class Episodes:
    """Runs rows' episodes: ``env`` (:class:`~posttrain.envs.openenv_local.LocalEnvironment`), the
    ``tokenizer`` decoding turns, ``observation`` (an :class:`ObservationFormat`) encoding the
    environment's turns, at most ``max_turns`` model turns and ``max_tokens`` response tokens a row."""

    def __init__(self, env, tokenizer, observation: ObservationFormat, *, max_turns: int, max_tokens: int,
                 stop_token_ids: list[int]):
        self.env, self.tokenizer, self.observation = env, tokenizer, observation
        self.max_turns, self.max_tokens, self.stops = max_turns, max_tokens, stop_token_ids

    def rows(self, prompts: list[list[int]], tasks: list[int], keys: list[int], samples: list[int]) -> list[_Row]:
        """One new episode per row: prompt ``prompts[k]`` of task ``tasks[k]``, its sample ``samples[k]`` of
        prompt key ``keys[k]``."""
        return [_Row(self.env.start(t), p, k, j) for p, t, k, j in zip(prompts, tasks, keys, samples)]

    def run(self, rows: list[_Row], engine, sampling) -> None:
        """Every row's episode, one turn of all live rows per ``generate`` call."""
        while live := [r for r in rows if r.live]:
            outs = engine.generate([r.prompt + r.tokens for r in live], 1, sampling, self.stops,
                                   prompt_keys=[r.key for r in live], sample_offsets=[r.sample for r in live],
                                   position_offsets=[len(r.tokens) for r in live],
                                   max_new_tokens=[self.max_tokens - len(r.tokens) for r in live])
            for row, (out,) in zip(live, outs):
                self.turn(row, out)

    def turn(self, row: _Row, out) -> None:
        """Add one sampled turn; step the environment with it and add its observation, or end the row."""
        row.add(list(out.token_ids), list(out.logprobs))
        text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        observation = self.env.step(row.episode, text)
        room = self.max_tokens - len(row.tokens)
        if out.finish_reason == "length" or row.episode.done or row.episode.turns >= self.max_turns or room <= 0:
            row.live = False
            return
        tokens = self.observation.encode([observation], closed=True)
        row.add(tokens[:room], None)
        row.live = len(tokens) < room


class EnvTurns:
    """Fills a dock with episodes of the session's environment (see the module docstring)."""

    def __init__(self, plan, session, next_prompts):
        from posttrain.data.templates import get_template
        from posttrain.paths import shipped_file

        p = plan.policy
        path = p.prompt_type_path if p.prompt_type_path and shipped_file(p.prompt_type_path).is_file() else None
        self.plan, self.s, self.tokenizer = plan, session, session.policy.tokenizer
        self.next_prompts = next_prompts  # session -> the sampler's next batch (prompts, labels)
        observation = ObservationFormat(get_template(p.prompt_type or "hf_chat_template", path), self.tokenizer)
        self.episodes = Episodes(session.dataset.env, self.tokenizer, observation, max_turns=plan.data.env.max_turns,
                                 max_tokens=plan.rollout.sampling.max_tokens,
                                 stop_token_ids=session.policy.stop_token_ids)
        self.rewards: dict[int, float] = {}

    def fill(self, td, iteration, engine, version, timers, acc) -> None:
        prompts, labels = self.next_prompts(self.s)
        td.put_prompts({"prompts": prompts, "prompt_length": [len(p) for p in prompts], "labels": labels})
        n, sampling = self.plan.n, self.s.sampling_for(iteration)
        with timers("rollout"):
            while not td.all_consumed("rollout"):
                batch, idx = td.get("rollout", ["prompts", "labels"], self.plan.reads["actor_rollout_dispatch_size"],
                                    get_n_samples=True)
                tasks = [int(t) for t in decode_labels(self.tokenizer, [r.tolist() for r in batch["labels"]])]
                rows = self.episodes.rows([r.tolist() for r in batch["prompts"]], tasks, [i // n for i in idx],
                                          [i % n for i in idx])
                self.episodes.run(rows, engine, sampling)
                self.put(td, idx, rows, version)
                acc.update({"env/turns/mean": [float(r.episode.turns) for r in rows],
                            "env/done/mean": [float(r.episode.done) for r in rows]})

    def put(self, td, idx: list[int], rows: list[_Row], version: int) -> None:
        responses = [torch.tensor(r.tokens, dtype=torch.long) for r in rows]
        td.put(["responses", "response_length", "rollout_logprobs", "policy_version", *MULTI_TURN_COLUMNS], idx,
               [responses, [len(r) for r in responses], [torch.tensor(r.logprobs, dtype=torch.float32) for r in rows],
                [version] * len(idx), [torch.tensor(r.mask, dtype=torch.long) for r in rows],
                [r.episode.turns for r in rows]])
        self.rewards.update({i: r.episode.reward for i, r in zip(idx, rows)})

    def scores(self, idx: list[int]) -> list[float]:
        """The episodes' rewards of dock rows ``idx`` (each handed out once)."""
        return [self.rewards.pop(i) for i in idx]

    def state_files(self) -> dict:
        return {}
