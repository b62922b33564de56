"""``rl_config.compile_regions: auto``: compile a region only where it pays back within the run.

At the first update, for each compiled region of :mod:`posttrain.training.fused_regions`, on the
run's shapes (the model's sizes; up to :data:`PROBE_TOKENS` tokens, scaled to the update's token
count):

1. the region's eager forward + backward is timed (no compilation: milliseconds on a tiny model).
   Times its calls per update and the updates left, that is the most the region could save in the
   run. Where that is less than the compile time expected (the time recorded by the last compile of
   the region with this torch, in :data:`RECORD` of Inductor's cache directory, whose on-disk cache
   makes a later compile faster; else :data:`COLD_COMPILE_S`), the region stays eager, uncompiled.
2. Otherwise the region compiles (its first call, timed and recorded) and its compiled call is timed
   against the eager one, interleaved; it is used when it is at least :data:`MARGIN` faster.

Each choice is logged and kept as a :class:`Choice` (``run.json``'s ``compiled_regions``).
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from posttrain.files import write_text_atomic
from posttrain.training import compiled_logprob, fused_regions
from posttrain.training.remove_padding import pack
from posttrain.training.lm_head import CHUNK_ELEMENTS

log = logging.getLogger(__name__)

PROBE_TOKENS = 1024  # tokens of a probe call (the update's count when smaller)
COLD_COMPILE_S = {"rms_norm": 6.0, "silu_mul": 3.0, "rotary": 20.0, "logprob": 10.0}  # forward + backward, 2-core EPYC
MARGIN = 0.05  # a compiled call at least this much faster than the eager one
RECORD = "posttrain_compile_regions.json"
REPEATS = 3


@dataclass(frozen=True)
class Choice:
    """One region's decision: ``on``, the seconds per update eager (and compiled, when it compiled), the
    compile's seconds (measured, or the estimate that kept it uncompiled) and why, in words."""

    on: bool
    eager_s: float
    compiled_s: float | None
    compile_s: float
    reason: str

    def to_json(self) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}


def _record_path() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / RECORD


def _recorded() -> dict[str, float]:
    try:
        return dict(json.loads(_record_path().read_text()).get(torch.__version__, {}))
    except (OSError, ValueError, AttributeError):
        return {}


def _record(region: str, seconds: float) -> None:
    try:
        path = _record_path()
        data = json.loads(path.read_text()) if path.exists() else {}
        data.setdefault(torch.__version__, {})[region] = round(seconds, 2)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(data, indent=1) + "\n")
    except (OSError, ValueError):
        log.debug("could not record the compile time in %s", RECORD)


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _outputs(out) -> list[torch.Tensor]:
    return [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None and o.requires_grad]


def _fwd_bwd(eager: Callable, compiled: Callable, args: tuple) -> tuple[Callable[[], None], Callable[[], None]]:
    """Calls of ``eager(*args)`` and ``compiled(*args)`` with their backward, on the same leaves and fixed
    dense upstream gradients (made by an eager call: nothing compiles before the compiled call)."""
    leaves = tuple(a.detach().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a
                   for a in args)
    with torch.enable_grad():
        grads = [torch.randn_like(o) for o in _outputs(eager(*leaves))]

    def call(fn: Callable) -> Callable[[], None]:
        def run() -> None:
            with torch.enable_grad():
                torch.autograd.backward(_outputs(fn(*leaves)), grads)
        return run
    return call(eager), call(compiled)


def _eager_logprob(logits: torch.Tensor, labels: torch.Tensor):
    from posttrain.algo.logprob import scaled_logprobs_and_entropy

    return scaled_logprobs_and_entropy(logits.float() / 0.7, labels, True, False)


def _compiled_logprob(logits: torch.Tensor, labels: torch.Tensor):
    return compiled_logprob.compiled_logprobs_and_entropy()(logits, labels, 0.7, True, False)


def probes(model: torch.nn.Module, tokens: int, response_tokens: int) -> dict[str, tuple]:
    """Per region of ``model``: (eager function, compiled function, probe inputs, probe calls per update), at
    an update of ``tokens`` packed tokens of which ``response_tokens`` reach the LM head."""
    dtype = next(model.parameters()).dtype
    found, n = fused_regions.regions(model), max(1, min(tokens, PROBE_TOKENS))
    scale = tokens / n
    rand = lambda *shape: torch.randn(*shape, dtype=dtype)  # noqa: E731
    out = {}
    if found["rms_norm"]:
        m = found["rms_norm"][0]
        out["rms_norm"] = (fused_regions.rms_norm, fused_regions.compiled("rms_norm"),
                           (rand(1, n, m.weight.shape[-1]), m.weight.detach().clone(), m.variance_epsilon),
                           scale * len(found["rms_norm"]))
    if found["silu_mul"]:
        width = found["silu_mul"][0].gate_proj.out_features
        out["silu_mul"] = (fused_regions.silu_mul, fused_regions.compiled("silu_mul"),
                           (rand(1, n, width), rand(1, n, width)), scale * len(found["silu_mul"]))
    if found["rotary"]:
        m = found["rotary"][0]
        heads, kv, dim = m.config.num_attention_heads, m.config.num_key_value_heads, m.head_dim
        q = rand(1, n, heads * dim).view(1, n, heads, dim).transpose(1, 2)  # the attention's layout
        k = rand(1, n, kv * dim).view(1, n, kv, dim).transpose(1, 2)
        out["rotary"] = (fused_regions.rotary, fused_regions.compiled("rotary"), (q, k, rand(1, n, dim), rand(1, n, dim)),
                         scale * len(found["rotary"]))
    inner = getattr(model, "module", model)  # DDP keeps the model in .module
    head = getattr(inner, "get_output_embeddings", lambda: None)()
    if isinstance(head, torch.nn.Linear) and response_tokens > 0:
        chunk = max(1, min(response_tokens, CHUNK_ELEMENTS // head.out_features))
        logits = torch.randn(chunk, head.out_features)
        labels = torch.randint(0, head.out_features, (chunk,))
        out["logprob"] = (_eager_logprob, _compiled_logprob, (logits, labels), response_tokens / chunk)
    return out


def choose(region: str, probe: tuple, updates_left: int) -> Choice:
    """Time ``probe`` eager; compile it and time it compiled only when it could pay back in ``updates_left``."""
    eager_fn, compiled_fn, args, calls = probe
    eager, fused = _fwd_bwd(eager_fn, compiled_fn, args)
    eager()  # warm-up
    per_call = statistics.median(_timed(eager) for _ in range(REPEATS))
    eager_s, expected = per_call * calls, _recorded().get(region, COLD_COMPILE_S[region])
    if eager_s * updates_left <= expected:
        return Choice(False, eager_s, None, expected, f"its eager time, {eager_s * updates_left:.2f} s over "
                      f"{updates_left} updates, is less than the compile's (about {expected:.1f} s)")
    compile_s = max(0.0, _timed(fused) - per_call)
    _record(region, compile_s)
    pairs = [(_timed(eager), _timed(fused)) for _ in range(REPEATS)]
    e, c = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
    on = c < (1 - MARGIN) * e
    saving = (e - c) * calls * updates_left
    return Choice(on, e * calls, c * calls, compile_s, f"compiled {e / c:.2f}x the eager speed; "
                  f"{saving:+.2f} s over {updates_left} updates, against {compile_s:.1f} s of compile")


def update_tokens(batch: dict[str, torch.Tensor], share_prompts: bool, mask_key: str = "response_mask") -> tuple[int, int]:
    """(packed tokens, tokens reaching the LM head) of one pass over ``batch``: with ``share_prompts`` each
    distinct prefix counts once (posttrain's packing, :func:`posttrain.training.remove_padding.pack`)."""
    mask, responses = batch.get("attention_mask"), batch.get(mask_key)
    if mask is None:
        return 0, 0
    response_tokens = int(responses.sum()) if responses is not None else 0
    if not share_prompts or responses is None or "input_ids" not in batch:
        return int(mask.sum()), response_tokens
    packed = pack({**batch, "response_mask": responses}, share_prompts=True)
    return packed["input_ids"].shape[1], packed["keep"].numel()


def choose_regions(model: torch.nn.Module, tokens: int, response_tokens: int, updates_left: int) -> dict[str, Choice]:
    """The :class:`Choice` of every region ``model`` has (:func:`choose`), logged."""
    choices = {}
    for region, probe in probes(model, tokens, response_tokens).items():
        choices[region] = choice = choose(region, probe, updates_left)
        log.info("compile_regions auto: %s %s: %s", region, "on" if choice.on else "off", choice.reason)
    return choices
