"""Accuracy dumps (``msprobe_config``): posttrain's own equivalent of the seed's msprobe.

Within the iterations ``step_start..step_end`` (both 0: every iteration) a :class:`DumpRecorder`
writes, for each dumped iteration, ``<dump_path>/step_<i>/rank_<r>/<role>.jsonl``: one JSON record
per tensor, each with the statistics of :func:`tensor_stats` (``max``, ``min``, ``mean``, ``norm``
(L2) over the finite values, ``nan`` and ``inf`` counts, ``numel``), its shape and dtype, the loop
phase it came from and ``seq``, its place in the process's execution order (shared by all roles,
so ``posttrain compare-dumps`` walks the dumps in the order they were computed). A step's files are
written when the step ends (also when it raises: a non-finite loss), each to a temporary name and
renamed; role files of an earlier run in that step's folder are removed.

The roles are the config's switches:

* ``key_data`` (``key_data_dump``): the experience of the iteration (prompts, responses, scores,
  the rollout's, old and reference log-probs, advantages, returns, values; the offline loops: their
  batch), the on-policy loss functions' inputs and outputs per micro-batch (``logprobs``, ``ratio`` =
  exp(logprobs - old_logprobs) on the response tokens, ``loss`` and the loss metrics), the update's
  metrics (``actor/grad_norm``...) and each parameter's gradient as it is accumulated
  (``grad/<parameter>``); what the loop hands over is :mod:`posttrain.loops.dump_points`;
* ``actor_infer`` (``actor_infer_dump``): every named module's inputs and outputs in the rollout's
  model calls, numbered from 0 in each iteration, whose number is in ``token_range_start..
  token_range_end`` (the prefill is call 0, each decode step one more);
* ``actor_train`` (``actor_train_dump``): the actor's modules in the old log-prob pass and the update;
* ``reference`` (``reference_dump``): the reference's modules; ``critic_train``
  (``critic_train_dump``): the critic's in its value pass and its update. The token range applies
  to the rollout only: the other passes run each sequence in one call.

Module statistics come from global forward hooks (``torch.nn.modules.module``) installed for the
phase alone and named through the phase's models (:meth:`DumpRecorder.watch`), so a model copy
the rollout engine samples from is named like the model itself. ``configurations_dump`` writes the
resolved config as ``<dump_path>/configurations.json`` (:meth:`DumpRecorder.write_config`).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROLES = ("key_data", "actor_infer", "actor_train", "reference", "critic_train")
# the loop's phases (metrics.timers names) -> the role whose switch dumps their modules
PHASE_ROLES = {"rollout": "actor_infer", "old_log_p": "actor_train", "update": "actor_train",
               "reference_model": "reference", "critic_model": "critic_train", "update_critic": "critic_train"}
STATS = ("max", "min", "mean", "norm", "nan", "inf", "numel")


@dataclass(frozen=True)
class DumpOptions:
    """``msprobe_config``, checked (:func:`posttrain.config.options.dump_options`)."""

    dump_path: str
    roles: frozenset[str] = frozenset()  # the roles of ROLES that are dumped
    configurations: bool = False
    step_start: int = 0
    step_end: int = 0  # inclusive; both 0: every iteration
    token_start: int = 0
    token_end: int = 0  # inclusive

    def dumps_step(self, iteration: int) -> bool:
        return (self.step_start == self.step_end == 0) or self.step_start <= iteration <= self.step_end


CHUNK = 1 << 22  # elements converted to float64 at a time: a big tensor (logits) is never copied whole


def tensor_stats(tensor) -> dict[str, Any]:
    """``max``, ``min``, ``mean`` and ``norm`` (L2) of the finite values (None when there are none),
    the ``nan`` and ``inf`` counts and ``numel``; computed in float64, ``CHUNK`` elements at a time."""
    import torch

    flat = tensor.detach().reshape(-1)
    high, low, total, squares, count, nan = -math.inf, math.inf, 0.0, 0.0, 0, 0
    for chunk in flat.split(CHUNK):
        c = chunk.to(torch.float64)
        finite = torch.isfinite(c)
        nan += int(torch.isnan(c).sum())
        values = c[finite]
        if values.numel():
            high, low = max(high, float(values.max())), min(low, float(values.min()))
            total, squares, count = total + float(values.sum()), squares + float(values.square().sum()), \
                count + values.numel()
    out: dict[str, Any] = {"max": None, "min": None, "mean": None, "norm": None}
    if count:
        out = {"max": high, "min": low, "mean": total / count, "norm": math.sqrt(squares)}
    out.update(nan=nan, inf=flat.numel() - count - nan, numel=flat.numel())
    return out


def named_tensors(prefix: str, value: Any, depth: int = 0) -> Iterator[tuple[str, Any]]:
    """The tensors in a module's inputs or outputs (tuples, lists, dicts, HF ``ModelOutput``), named
    ``prefix.<index or key>``; other values (caches, None) are skipped."""
    import torch

    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif depth < 3 and isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from named_tensors(f"{prefix}.{i}", item, depth + 1)
    elif depth < 3 and isinstance(value, dict):
        for key, item in value.items():
            yield from named_tensors(f"{prefix}.{key}", item, depth + 1)


@dataclass
class _Watch:
    """The phase whose modules are dumped now: its role, the models that name them, the call count."""

    role: str
    phase: str
    roots: Callable[[], list]
    names: dict = field(default_factory=dict)  # module -> name (None: not one of the phase's models)
    root_set: set = field(default_factory=set)
    calls: int = -1  # calls of a root model so far in this phase (the rollout's token number)

    def name_of(self, module) -> str | None:
        """The module's name in its model; an unknown module looks the models up again (a sampling
        copy made during the phase), and is remembered as None when it is not theirs."""
        if module not in self.names:
            for root in self.roots():
                self.root_set.add(root)
                self.names.update({m: (n or type(root).__name__) for n, m in root.named_modules()})
            self.names.setdefault(module, None)
        return self.names[module]


class DumpRecorder:
    """The dumps of one process (``rank``); every method is a no-op outside the step window."""

    def __init__(self, options: DumpOptions | None, rank: int = 0) -> None:
        self.options, self.rank = options, rank
        self.iteration: int | None = None
        self.records: dict[str, list[dict]] = {}
        self.seq = 0
        self.phase_name = ""
        self.written: list[Path] = []

    def on(self, role: str) -> bool:
        return (self.options is not None and self.iteration is not None and role in self.options.roles
                and self.options.dumps_step(self.iteration))

    def write_config(self, config_json: str) -> None:
        """``configurations_dump``: the resolved config as ``<dump_path>/configurations.json``."""
        if self.options is not None and self.options.configurations:
            from posttrain.metrics.sinks import write_text_atomic

            path = Path(self.options.dump_path) / "configurations.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(path, config_json)
            self.written.append(path)

    @contextlib.contextmanager
    def step(self, iteration: int) -> Iterator[None]:
        """Around one iteration: its records are written when it ends (also when it raises)."""
        self.iteration, self.records, self.seq = iteration, {}, 0
        try:
            yield
        finally:
            if self.records:
                self._write(iteration)
            self.iteration, self.records = None, {}

    def record(self, role: str, name: str, value, **extra: Any) -> None:
        """The statistics of the tensor ``value`` under ``role`` (when that role is dumped this
        iteration); ``extra``: more fields of the record (a module's ``tensor`` and ``call``)."""
        if not self.on(role):
            return
        row = {"seq": self.seq, "step": self.iteration, "role": role, "phase": self.phase_name, "name": name,
               **extra, "shape": list(value.shape), "dtype": str(value.dtype).replace("torch.", ""),
               **tensor_stats(value)}
        self.seq += 1
        self.records.setdefault(role, []).append(row)

    def record_scalars(self, role: str, values: dict[str, float]) -> None:
        """Scalar metrics (a loss, a gradient norm) as one-element tensors."""
        if self.on(role):
            import torch

            for name, value in values.items():
                if isinstance(value, (int, float)) or getattr(value, "numel", lambda: 0)() == 1:
                    self.record(role, name, torch.tensor(float(value)))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Around one phase of the loop (``metrics.timers`` names); the phase's models are named by
        :meth:`watch`."""
        previous, self.phase_name = self.phase_name, name
        try:
            yield
        finally:
            self.phase_name = previous

    @contextlib.contextmanager
    def watch(self, phase: str, roots: Callable[[], list]) -> Iterator[None]:
        """Dump the modules of ``roots()`` (the phase's models, looked up again when an unknown module
        runs) while ``phase`` runs, when the phase's role is dumped this iteration."""
        role = PHASE_ROLES[phase]
        if not self.on(role):
            yield
            return
        from torch.nn.modules import module as nn_module

        watch = _Watch(role, phase, roots)
        pre = nn_module.register_module_forward_pre_hook(lambda m, args: self._count(watch, m))
        post = nn_module.register_module_forward_hook(lambda m, args, out: self._module_io(watch, m, args, out))
        try:
            with self.phase(phase):
                yield
        finally:
            pre.remove()
            post.remove()

    def watch_loss(self, loss_fn):
        """``key_data_dump``: ``loss_fn`` (a :class:`~posttrain.training.base.LossFn`) whose
        ``after_forward`` also records its inputs (the response tokens' log-probs and their ratio to
        the old ones, or a critic's values) and outputs (the loss and its metrics); the math is untouched."""
        if self.options is None or "key_data" not in self.options.roles:
            return loss_fn
        import dataclasses

        inner, values = loss_fn.after_forward, loss_fn.consumes == "values"

        def after_forward(first, *args, **kw):
            micro_batch = args[-1]
            mask = micro_batch["response_mask"].bool()
            self.record("key_data", "critic/values" if values else "logprobs", first.detach()[mask])
            old = None if values else micro_batch.get("old_logprobs")
            if old is not None:
                self.record("key_data", "ratio", (first.detach() - old).exp()[mask])
            loss, metrics = inner(first, *args, **kw)
            self.record("key_data", "critic/loss" if values else "loss", loss.detach())
            self.record_scalars("key_data", metrics)
            return loss, metrics

        return dataclasses.replace(loss_fn, after_forward=after_forward)

    @contextlib.contextmanager
    def watch_grads(self, model) -> Iterator[None]:
        """``key_data_dump``: each trainable parameter's gradient of ``model`` as it is accumulated
        (``grad/<parameter>``, once per micro-batch) while the block runs."""
        if model is None or not self.on("key_data"):
            yield
            return
        handles = [p.register_post_accumulate_grad_hook(
            lambda p, name=name: self.record("key_data", f"grad/{name}", p.grad))
            for name, p in model.named_parameters() if p.requires_grad]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _count(self, watch: _Watch, module) -> None:
        if watch.name_of(module) is not None and module in watch.root_set:
            watch.calls += 1

    def _module_io(self, watch: _Watch, module, args, output) -> None:
        name = watch.name_of(module)
        if name is None:
            return
        o = self.options
        if watch.role == "actor_infer" and not o.token_start <= watch.calls <= o.token_end:
            return
        for kind, value in (("input", args), ("output", output)):
            for tensor_name, tensor in named_tensors(kind, value):
                self.record(watch.role, name, tensor, tensor=tensor_name, call=watch.calls)

    def _write(self, iteration: int) -> None:
        from posttrain.metrics.sinks import write_text_atomic

        folder = Path(self.options.dump_path) / f"step_{iteration}" / f"rank_{self.rank}"
        folder.mkdir(parents=True, exist_ok=True)
        for role, rows in self.records.items():
            path = folder / f"{role}.jsonl"
            write_text_atomic(path, "".join(json.dumps(r, allow_nan=True) + "\n" for r in rows))
            self.written.append(path)
        for stale in folder.glob("*.jsonl"):  # an earlier run's roles in this dump_path: this step is ours now
            if stale.stem not in self.records:
                stale.unlink()
