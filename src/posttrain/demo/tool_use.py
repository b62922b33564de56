"""Multi-turn tool use that learns: products of two 3-digit numbers with the code interpreter.

    python -m posttrain.demo.tool_use [--out runs/tool_use] [--model PATH] [--sft-steps N] [--iters N]

1. the task: "What is 347 * 582?"; the train and test problems are drawn disjointly, locally. No
   small model multiplies 3-digit numbers in its head; with the tool it is a matter of copying
   the numbers into a call and the tool's answer into ``\\boxed{}``;
2. the model: a tiny random-init Qwen2 (``posttrain init-model``, tokenizer trained on the traces),
   or any Hugging Face directory (``--model``, e.g. SmolLM2-135M-Instruct);
3. an SFT warm start on synthetic traces built in token space exactly as the rollout builds them
   (the call, the tool's output encoded once with the template's observation wrapping, the boxed
   answer; the loss on the model's tokens only), saved every 5 steps;
   the warm start solves between ``--sft-target`` (40%) and ``--sft-target + --sft-band`` (50%) of a
   validation split: the first checkpoint that reaches the target, or, when it jumps past the band,
   a blend of it with the checkpoint before (:func:`capped_warm_start`);
4. DAPO with the code interpreter (``configs/dapo_tiny_multi_turn.yaml``, the seed's multi-turn
   recipe shrunk);
5. held-out greedy accuracy (``retool_reward`` = 1) after SFT and after DAPO, with the tool, and
   the no-tool baseline: the same models generating alone, where a call gets no answer and the
   model writes on by itself.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.checkpoint import list_checkpoints
from posttrain.commands.init_model import init_model
from posttrain.commands.train import plan_named
from posttrain.config.multi_turn import load_tool_file
from posttrain.data.preprocess import write_token_rows
from posttrain.data.templates import get_template
from posttrain.loops.build import train as train_run
from posttrain.models.loading import resolve_model_dir
from posttrain.paths import configs_dir, shipped_file
from posttrain.reward.verifiers.minerva import retool_reward
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.multi_turn import MultiTurnEngine, ObservationFormat, TurnLimits
from posttrain.rollout.native import NativeEngine
from posttrain.tools.parsers import TOOL_PARSERS
from posttrain.tools.runner import ToolRunner

TOOLS = "configs/tools/retool.yaml"  # the shipped code-interpreter tools file (posttrain.paths.shipped_file)

TEMPLATE = "tiny_tool"
CALL = '<tool_call>{{"name": "code_interpreter", "arguments": {{"code": "print({a} * {b})"}}}}'
END_TAG = "</tool_call>"


def product_problems(count: int, seed: int, exclude: set[tuple[int, int]] = frozenset()) -> list[tuple[int, int]]:
    """``count`` distinct pairs of 3-digit numbers, none in ``exclude``."""
    rng, out, seen = random.Random(seed), [], set(exclude)
    while len(out) < count:
        pair = (rng.randint(100, 999), rng.randint(100, 999))
        if pair not in seen:
            seen.add(pair)
            out.append(pair)
    return out


def question(a: int, b: int) -> str:
    return f"What is {a} * {b}?"


def trace_tokens(tokenizer, observation, a: int, b: int) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, response ids, response mask: 0 on the tool's tokens) of the ideal conversation,
    in the rollout's exact tokens."""
    template = observation.template  # the demo's chat template (tiny_tool)
    prompt = tokenizer.encode(template.render_prompt(question(a, b), tokenizer=tokenizer), add_special_tokens=False)
    call = tokenizer.encode(CALL.format(a=a, b=b), add_special_tokens=False) + \
        tokenizer.encode(END_TAG, add_special_tokens=False)
    tool = observation.encode([f"{a * b}\n"], closed=False)
    answer = tokenizer.encode(f"\\boxed{{{a * b}}}", add_special_tokens=False) + [tokenizer.eos_token_id]
    return prompt, call + tool + answer, [1] * len(call) + [0] * len(tool) + [1] * len(answer)


def write_data(out: Path, tokenizer, train: list[tuple[int, int]], test: list[tuple[int, int]]) -> dict[str, str]:
    """SFT traces, RL prompts and test prompts as indexed datasets under ``out``."""
    observation = ObservationFormat(get_template(TEMPLATE, configs_dir() / "tiny_templates.json"), tokenizer)
    sft = {"input_ids": [], "labels": [], "attention_mask": []}
    for a, b in train:
        prompt, response, mask = trace_tokens(tokenizer, observation, a, b)
        sft["input_ids"].append(prompt + response)  # trained on the model's tokens only, as RL does
        sft["labels"].append([-100] * len(prompt) + [t if m else -100 for t, m in zip(response, mask)])
        sft["attention_mask"].append([1] * (len(prompt) + len(response)))
    write_token_rows(out / "sft" / "data", sft)
    paths = {"sft": str(out / "sft" / "data")}
    for name, pairs in (("rl", train), ("test", test)):
        prompts = [trace_tokens(tokenizer, observation, a, b)[0] for a, b in pairs]
        write_token_rows(out / name / "data", {
            "input_ids": prompts, "attention_mask": [[1] * len(p) for p in prompts],
            "labels": [tokenizer.encode(str(a * b), add_special_tokens=False) for a, b in pairs]})
        paths[name] = str(out / name / "data")
    return paths


def init_tiny_model(out: Path, train: list[tuple[int, int]], seed: int) -> Path:
    """A tiny random-init Qwen2 whose tokenizer is trained on the traces' text."""
    corpus = out / "corpus.txt"
    corpus.parent.mkdir(parents=True, exist_ok=True)
    corpus.write_text("".join(f"{question(a, b)}\n{CALL.format(a=a, b=b)}{END_TAG}\n{a * b}\n\\boxed{{{a * b}}}\n"
                              for a, b in train[:500]))
    return init_model("tiny_qwen2", out / "model", corpus=corpus, vocab_size=400, seed=seed, force=True)


def evaluate(model_dir: str | Path, tokenizer_dir: str | Path, pairs: list[tuple[int, int]], *,
             tools: bool, max_tokens: int = 64) -> dict[str, float]:
    """Greedy held-out accuracy (``retool_reward`` = 1) and mean tool calls, with the code tool or
    without it (the model generates alone)."""
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    model_dir = resolve_model_dir(model_dir)  # a save directory: its latest iter_XXXXXXX
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    template = get_template(TEMPLATE, configs_dir() / "tiny_templates.json")
    observation = ObservationFormat(template, tok)
    prompts = [trace_tokens(tok, observation, a, b)[0] for a, b in pairs]
    common = dict(pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id])
    if tools:
        engine = MultiTurnEngine(model, tokenizer=tok, runner=ToolRunner(load_tool_file(shipped_file(TOOLS))),
                                 parser=TOOL_PARSERS.get("hermes"), observation=observation,
                                 limits=TurnLimits(max_tool_calls=2, max_total_response_length=2 * max_tokens),
                                 **common)
    else:
        engine = NativeEngine(model, **common)
    outs = engine.generate(prompts, 1, SamplingParams(temperature=0.0, max_tokens=max_tokens if tools else 2 * max_tokens))
    scores, calls = [], []
    for (a, b), group in zip(pairs, outs):
        out = group[0]
        text = tok.decode(out.token_ids, skip_special_tokens=False)
        scores.append(retool_reward(text, str(a * b), tool_call_num=out.tool_call_num))
        calls.append(out.tool_call_num)
    return {"accuracy": sum(s == 1.0 for s in scores) / len(scores), "tool_calls": sum(calls) / len(calls)}


def capped_warm_start(checkpoints: list[tuple[int, Path]], score, target: float, band: float,
                      blend_dir: Path) -> tuple[float, Path, float]:
    """The warm start whose validation accuracy (``score(path)``) lands in ``[target, target + band]``.

    First the first checkpoint that reaches ``target``, by bisection over the saved steps (accuracy
    grows with the steps, in a sharp jump where the model learns to copy the numbers into a call).
    When that checkpoint overshoots the band (the jump fell between two saves: how far depends on
    the CPU's kernels), a blend of it with the checkpoint before, ``(1 - a) w_before + a w_after``,
    with ``a`` found by bisection, lands in the band on any machine. The last checkpoint if none
    reaches ``target``. Returns (step, the model's path, its accuracy); a blend's step is fractional."""
    lo, hi, first = 0, len(checkpoints) - 1, None
    scores: dict[int, float] = {}
    while lo <= hi:
        mid = (lo + hi) // 2
        scores[mid] = score(checkpoints[mid][1])
        if scores[mid] >= target:
            first, hi = mid, mid - 1
        else:
            lo = mid + 1
    pick = first if first is not None else len(checkpoints) - 1
    acc = scores[pick] if pick in scores else score(checkpoints[pick][1])
    if first is None or first == 0 or acc <= target + band:
        return float(checkpoints[pick][0]), checkpoints[pick][1], acc
    (step_lo, before), (step_hi, after) = checkpoints[first - 1], checkpoints[first]
    best, a_lo, a_hi = (float(step_hi), after, acc), 0.0, 1.0
    for _ in range(6):  # a to 1/64: the blends' accuracy moves by a few problems between steps
        a = (a_lo + a_hi) / 2
        path = blend(before, after, a, blend_dir / f"a{a:.4f}")
        accuracy = score(path)
        if accuracy >= target:
            best, a_hi = (step_lo + a * (step_hi - step_lo), path, accuracy), a
            if accuracy <= target + band:
                break
        else:
            a_lo = a
    return best


def blend(before: Path, after: Path, a: float, out: Path) -> Path:
    """An HF model directory (``after``'s config and tokenizer) with the weights
    ``(1 - a) before + a after`` of two checkpoints of one run."""
    from safetensors.torch import load_file, save_file

    low, high = load_file(str(before / "model.safetensors")), load_file(str(after / "model.safetensors"))
    out.mkdir(parents=True, exist_ok=True)
    for item in after.iterdir():  # config, generation config, tokenizer; no trainer state: a plain model
        if item.is_file() and item.suffix in (".json", ".txt", ".model") and item.name != "trainer_state.json":
            shutil.copy2(item, out / item.name)
    save_file({k: torch.lerp(low[k], v, a).contiguous() for k, v in high.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def run(out: Path, *, model: str | None = None, sft_steps: int = 120, sft_target: float = 0.4, sft_band: float = 0.1,
        sft_lr: float = 1e-3, iters: int = 12, seed: int = 1, num_train: int = 2000, num_test: int = 100,
        num_val: int = 100, overrides: tuple[str, ...] = ()) -> dict:
    """The whole demo (see the module docstring); returns and writes ``summary.json``.

    The SFT warm start saves every 5 steps up to ``sft_steps``; DAPO starts from a warm start whose
    accuracy on a validation split (disjoint from train and test) lies in ``[sft_target, sft_target +
    sft_band]`` (:func:`capped_warm_start`), so that RL has room to show its gain on every machine."""
    start = time.time()
    out.mkdir(parents=True, exist_ok=True)
    test = product_problems(num_test, seed=10_000 + seed)
    val = product_problems(num_val, seed=20_000 + seed, exclude=set(test))
    train = product_problems(num_train, seed=seed, exclude=set(test) | set(val))
    model_dir = Path(model) if model else init_tiny_model(out, train, seed)

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    data = write_data(out / "data", tok, train, test)
    base = {"tool": evaluate(model_dir, model_dir, test, tools=True),
            "no_tool": evaluate(model_dir, model_dir, test, tools=False)}
    templates = f"megatron_training.prompt_type_path={configs_dir() / 'tiny_templates.json'}"
    sft = plan_named("sft_tiny_qwen2", None, [
        f"megatron_training.tokenizer_name_or_path={model_dir}", f"megatron_training.data_path={data['sft']}",
        f"megatron_training.save={out / 'sft_ckpt'}", f"rl_config.output_dir={out / 'sft'}",
        f"megatron_training.train_iters={sft_steps}", "megatron_training.seq_length=160",
        f"megatron_training.prompt_type={TEMPLATE}", f"megatron_training.seed={seed}", templates,
        f"megatron_training.lr={sft_lr}", "megatron_training.min_lr=0.0", "megatron_training.lr_decay_style=constant",
        "megatron_training.save_interval=5", "megatron_training.no_save_optim=true",
        "megatron_training.no_save_rng=true", "rl_config.use_tensorboard=false"])
    sft_start = time.time()
    train_run(sft)
    step, warm, val_acc = capped_warm_start(
        list_checkpoints(out / "sft_ckpt"),
        lambda path: evaluate(path, model_dir, val, tools=True)["accuracy"], sft_target, sft_band, out / "sft_blend")
    for path in [p for _, p in list_checkpoints(out / "sft_ckpt")] + sorted((out / "sft_blend").glob("a*")):
        if path != warm:  # keep the warm start only (disk)
            shutil.rmtree(path)
    summary = {"model": str(model_dir), "base": base, "sft_steps": step, "sft_val_accuracy": val_acc,
               "sft_seconds": time.time() - sft_start}
    summary["sft"] = {"tool": evaluate(warm, model_dir, test, tools=True),
                      "no_tool": evaluate(warm, model_dir, test, tools=False)}
    rl = plan_named("dapo_tiny_multi_turn", None, [
        f"megatron_training.tokenizer_name_or_path={model_dir}", f"megatron_training.data_path={data['rl']}",
        f"actor_config.load={warm}", f"actor_config.save={out / 'rl_ckpt'}",
        f"rl_config.output_dir={out / 'rl'}", f"megatron_training.train_iters={iters}",
        f"megatron_training.seed={seed}", templates, *overrides])
    rl_start = time.time()
    train_run(rl)
    summary["rl_seconds"] = time.time() - rl_start
    summary["rl"] = {"tool": evaluate(out / "rl_ckpt", model_dir, test, tools=True),
                     "no_tool": evaluate(out / "rl_ckpt", model_dir, test, tools=False)}
    rows = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary["rewards"] = [r.get("dapo/score/mean") for r in rows]
    summary["tool_calls"] = [r.get("tool_call_num/mean") for r in rows]
    summary["total_seconds"] = time.time() - start
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m posttrain.demo.tool_use", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/tool_use")
    p.add_argument("--model", default=None, help="HF model directory (default: a tiny random-init Qwen2)")
    p.add_argument("--sft-steps", type=int, default=120, help="the most SFT steps (checkpoints every 5)")
    p.add_argument("--sft-band", type=float, default=0.1, help="warm start: at most --sft-target plus this")
    p.add_argument("--sft-target", type=float, default=0.4,
                   help="warm start: the first SFT checkpoint that solves this share of a validation split")
    p.add_argument("--sft-lr", type=float, default=1e-3, help="SFT learning rate (1e-3 suits the tiny model)")
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides of the DAPO config")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    s = run(Path(args.out), model=args.model, sft_steps=args.sft_steps, sft_target=args.sft_target, sft_band=args.sft_band,
            sft_lr=args.sft_lr, iters=args.iters, seed=args.seed,
            overrides=tuple(args.overrides))
    print(f"warm start: SFT step {s['sft_steps']:g} (validation accuracy {s['sft_val_accuracy']:.0%})")
    for stage in ("base", "sft", "rl"):
        print(f"{stage:>4}: with the tool {s[stage]['tool']['accuracy']:.0%} "
              f"({s[stage]['tool']['tool_calls']:.2f} calls per answer), "
              f"without it {s[stage]['no_tool']['accuracy']:.0%}")
    print(f"DAPO reward per iteration: {['%.2f' % r for r in s['rewards'] if r is not None]}")
    print(f"time: SFT {s['sft_seconds']:.0f} s, DAPO {s['rl_seconds']:.0f} s, {s['total_seconds'] / 60:.1f} min in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
