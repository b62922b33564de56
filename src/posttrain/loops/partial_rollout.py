"""Partial rollout (``rl_config.partial_rollout_max_split`` N > 1; seed 7.5).

A long generation holds up its whole batch. With partial rollout the rollout's TransferDock holds
two batches of prompts (``2 x global_batch_size`` groups of ``n`` rows) and each *round* gives
every unfinished sample at most ``max_tokens // N`` new tokens. A sample is complete when it ends
with a stop token, reaches ``max_tokens``, or fills ``max_model_len``. Rounds repeat until the dock
holds ``global_batch_size`` complete groups and, with ``require_max_age_all_finished``, every group
of age ``N - 1`` is complete (such groups get the rest of their budget in one round). The update
takes the oldest complete groups (lowest slot first among equals); the others wait, one age
older, and the next batch of prompts fills the freed slots.

A continued sample is re-prefilled from its prompt and partial response (the weights changed
since the last round, so its old KV cache would be wrong) and draws its tokens from the same keyed
streams, at the positions where it stopped (on vLLM: a new request on the prompt and partial
response, seeded by the sample's key and position, so its later tokens come from another stream
than the unsplit sample's; docs/rollout.md). Each segment's rollout log-probs are those of the
weights that sampled it, and ``policy_version`` keeps the oldest segment's version: the update's
ratio is taken against the trainer's recomputed old log-probs, and the rollout correction
(``rl_config.rollout_correction``) compares those with the segments' log-probs (docs/async.md).

The dock columns ``age`` (iterations waited) and ``finished`` (per row) are the seed's
completeness and age tracking; :meth:`PartialRollout.state_dict` is saved with each checkpoint.

With images (``rl_config.is_multimodal``, ``images=True``) the dock also keeps each sample's
``pixel_values`` and ``image_grid_thw`` (:data:`posttrain.models.vlm.MM_KEYS`): every generate call
(a fresh prompt, or a continued sample re-prefilled from its prompt and partial response) passes
the row's images, so the engine's prefill embeds them and builds the 3-D rotary positions of the
whole sequence, and :meth:`PartialRollout.take` hands them to the update with the finished samples.
The saved dock holds them too, so a resumed run continues its samples with their images.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from posttrain.loops.multimodal import prompt_media
from posttrain.models.vlm import MM_KEYS
from posttrain.transfer_dock import TransferDock

COLUMNS = ("prompts", "prompt_length", "labels", "responses", "rollout_logprobs", "policy_version", "age", "finished")
STATE_FILE = "partial_rollout.pt"


class PartialRollout:
    """The rollout dock of partial rollout and its rounds (see the module docstring)."""

    def __init__(self, *, n: int, global_batch_size: int, max_split: int, max_tokens: int, max_model_len: int | None,
                 require_max_age_all_finished: bool = True, images: bool = False):
        self.n, self.gbs, self.max_age = n, global_batch_size, max_split
        self.max_tokens, self.max_model_len = max_tokens, max_model_len
        self.budget = max(1, max_tokens // max_split)
        self.require_oldest = require_max_age_all_finished
        self.images = images  # each row keeps its prompt's images (MM_KEYS) and every generate gets them
        self.columns = (*COLUMNS, *(MM_KEYS if images else ()))
        self.dock = TransferDock(2 * global_batch_size * n, self.columns, ("partial_rollout",), n_samples_per_prompt=n,
                                 guarantee_order=True)
        self.rounds = 0

    # ---- one iteration -----------------------------------------------------------------------
    def free_groups(self) -> list[int]:
        ready = self.dock.ready_rows("prompts").reshape(-1, self.n)[:, 0]
        return [int(g) for g in np.flatnonzero(~ready)]

    def add_prompts(self, prompts: list[list[int]], labels: list[torch.Tensor],
                    images: dict[str, list[torch.Tensor]] | None = None) -> None:
        """Put a batch of prompts into the lowest free groups (each prompt ``n`` times), age 0;
        ``images``: each prompt's ``pixel_values`` and ``image_grid_thw`` (a pool with images)."""
        assert self.images == (images is not None), "a pool with images takes each prompt's images, others none"
        groups = self.free_groups()[: len(prompts)]
        rows = [g * self.n + j for g in groups for j in range(self.n)]
        rep = lambda values: [v for v in values for _ in range(self.n)]  # noqa: E731
        self.dock.put(list(self.columns), rows, [
            rep([torch.tensor(p, dtype=torch.long) for p in prompts]), rep([len(p) for p in prompts]), rep(labels),
            [torch.zeros(0, dtype=torch.long)] * len(rows), [torch.zeros(0)] * len(rows), [-1] * len(rows),
            [0] * len(rows), [0] * len(rows), *(rep(images[key]) for key in (MM_KEYS if images else ()))])

    def row_images(self, rows: list[int]) -> dict[str, list]:
        """``generate``'s ``images=`` argument for ``rows`` (one entry per row: its images' and videos'
        cells, None for a text-only prompt); no argument for a pool without images."""
        if not self.images:
            return {}
        return {"images": [prompt_media({key: self.dock.cell(key, r) for key in MM_KEYS}) for r in rows]}

    def fill(self, engine, sampling, stop_token_ids: list[int], version: int) -> None:
        """Rounds of generation with ``engine`` (weights ``version``) until an update is ready: in
        one decode that keeps its KV cache and stops at the first round boundary where the update
        is ready, when the engine can (the native engine, every unfinished sample in one wave);
        else one ``generate`` per round, each re-prefilling the samples it continues."""
        self.rounds = 0
        while not self.update_ready():
            if getattr(engine, "supports_rounds", False) and len(self._unfinished()) <= engine.max_num_seqs:
                self.decode(engine, sampling, stop_token_ids, version)
            else:
                self.round(engine, sampling, stop_token_ids, version)
                self.rounds += 1

    def decode(self, engine, sampling, stop_token_ids: list[int], version: int) -> None:
        """Every unfinished sample in one decode (one prefill of its prompt and partial response),
        each up to the rest of its budget, checked every ``max_tokens // N`` tokens: the decode
        ends at the first check where the update is ready. Within an iteration the weights do not
        change, so the rounds share the KV cache. (A group of age ``N - 1`` decodes in step with the
        others here, where :meth:`round` gives it its whole budget in the first round.)"""
        cell, rows, done_before = self.dock.cell, self._unfinished(), self._finished()

        def ready(finished: list[bool]) -> bool:
            return self.update_ready(done_before | {r for r, f in zip(rows, finished) if f})

        outs = engine.generate([cell("prompts", r).tolist() + cell("responses", r).tolist() for r in rows], 1,
                               sampling, stop_token_ids, prompt_keys=[r // self.n for r in rows],
                               sample_offsets=[r % self.n for r in rows],
                               position_offsets=[cell("responses", r).numel() for r in rows],
                               max_new_tokens=[self.max_tokens - cell("responses", r).numel() for r in rows],
                               stop_when=ready, stop_every=self.budget, **self.row_images(rows))
        for r, group in zip(rows, outs):
            self._append(r, group[0], version)
        longest = max((len(group[0].token_ids) for group in outs), default=0)
        self.rounds += -(-longest // self.budget)  # the rounds this decode stood for

    def round(self, engine, sampling, stop_token_ids: list[int], version: int) -> None:
        """Up to ``max_tokens // N`` new tokens for every unfinished sample (the rest of its budget
        at age ``N - 1`` with ``require_max_age_all_finished``)."""
        cell = self.dock.cell
        calls: dict[int, list[tuple[int, int]]] = {}  # budget -> (group, sample) rows continued
        fresh: list[int] = []  # groups not started: one prefill per prompt, n samples
        for g in self._occupied():
            rows = self._rows(g)
            if all(int(cell("finished", r)) for r in rows):
                continue
            if all(cell("responses", r).numel() == 0 for r in rows) and self._budget(g, 0) == self.budget:
                fresh.append(g)
                continue
            for r in rows:
                if not int(cell("finished", r)):
                    calls.setdefault(self._budget(g, cell("responses", r).numel()), []).append((g, r - g * self.n))
        if fresh:
            outs = engine.generate([cell("prompts", g * self.n).tolist() for g in fresh], self.n,
                                   replace(sampling, max_tokens=self.budget), stop_token_ids, prompt_keys=fresh,
                                   **self.row_images([g * self.n for g in fresh]))
            for g, group in zip(fresh, outs):
                for j, out in enumerate(group):
                    self._append(g * self.n + j, out, version)
        for budget, rows in sorted(calls.items()):
            prompts, offsets = [], []
            for g, j in rows:
                r = g * self.n + j
                prompts.append(cell("prompts", r).tolist() + cell("responses", r).tolist())
                offsets.append(cell("responses", r).numel())
            outs = engine.generate(prompts, 1, replace(sampling, max_tokens=budget), stop_token_ids,
                                   prompt_keys=[g for g, _ in rows], sample_offsets=[j for _, j in rows],
                                   position_offsets=offsets, **self.row_images([g * self.n + j for g, j in rows]))
            for (g, j), group in zip(rows, outs):
                self._append(g * self.n + j, group[0], version)

    def update_ready(self, finished: set[int] | None = None) -> bool:
        """``global_batch_size`` complete groups, and (``require_max_age_all_finished``) no group of
        age ``N - 1`` unfinished (the seed's ``get_update_ready``). ``finished``: the finished rows
        (default: the dock's)."""
        complete = self._complete(finished)
        if len(complete) < self.gbs:
            return False
        return not self.require_oldest or all(g in complete for g, age in self._ages().items()
                                              if age >= self.max_age - 1)

    def take(self) -> tuple[dict[str, list[torch.Tensor]], dict[str, float]]:
        """The update's groups (oldest complete first), removed from the dock; the others age by one.
        Returns their columns and the ``rollout/age_*`` and ``rollout/unfinished`` metrics."""
        ages = self._ages()
        chosen = sorted(self._complete(), key=lambda g: (-ages[g], g))[: self.gbs]
        rows = [g * self.n + j for g in chosen for j in range(self.n)]
        batch, _ = self.dock.get("partial_rollout", list(self.columns), indexes=rows)
        taken = [ages[g] for g in chosen]
        self.dock.clear_rows(rows)
        for g in self._occupied():
            self.dock.put(["age"], list(self._rows(g)), [[ages[g] + 1] * self.n])
        metrics = {"rollout/age_mean": float(np.mean(taken)), "rollout/age_max": float(max(taken)),
                   "rollout/unfinished": float(len(self._unfinished())), "rollout/rounds": float(self.rounds)}
        return batch, metrics

    # ---- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The dock as plain data (read back with ``weights_only=True``)."""
        from posttrain.loops.resume_files import plain_dock

        return plain_dock(self.dock.state_dict())

    def load_state_dict(self, state: dict) -> None:
        self.dock.load_state_dict(state)

    # ---- internals ---------------------------------------------------------------------------
    def _rows(self, group: int) -> range:
        return range(group * self.n, (group + 1) * self.n)

    def _unfinished(self) -> list[int]:
        return [r for g in self._occupied() for r in self._rows(g) if not int(self.dock.cell("finished", r))]

    def _finished(self) -> set[int]:
        return {r for g in self._occupied() for r in self._rows(g) if int(self.dock.cell("finished", r))}

    def _occupied(self) -> list[int]:
        ready = self.dock.ready_rows("prompts").reshape(-1, self.n)[:, 0]
        return [int(g) for g in np.flatnonzero(ready)]

    def _ages(self) -> dict[int, int]:
        return {g: int(self.dock.cell("age", g * self.n)) for g in self._occupied()}

    def _complete(self, finished: set[int] | None = None) -> set[int]:
        """The groups whose samples are all in ``finished`` (default: the dock's finished rows)."""
        finished = self._finished() if finished is None else finished
        return {g for g in self._occupied() if all(r in finished for r in self._rows(g))}

    def _budget(self, group: int, have: int) -> int:
        left = self.max_tokens - have
        if self.require_oldest and self._ages()[group] >= self.max_age - 1:
            return left
        return min(self.budget, left)

    def _append(self, row: int, out, version: int) -> None:
        cell = self.dock.cell
        tokens = torch.cat([cell("responses", row), torch.tensor(out.token_ids, dtype=torch.long)])
        logprobs = torch.cat([cell("rollout_logprobs", row), torch.tensor(out.logprobs, dtype=torch.float32)])
        first = int(cell("policy_version", row))
        total = int(cell("prompt_length", row)) + tokens.numel()
        finished = (out.finish_reason == "stop" or tokens.numel() >= self.max_tokens
                    or (self.max_model_len is not None and total >= self.max_model_len))
        self.dock.put(["responses", "rollout_logprobs", "policy_version", "finished"], [row],
                      [[tokens], [logprobs], [version if first < 0 else min(first, version)], [int(finished)]])
