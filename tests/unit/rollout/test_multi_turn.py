"""The multi-turn engine: token-exact trajectories, the loss mask, KV-cache continuation equal to
re-prefilling, limits and errors."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from posttrain.data.templates import get_template
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.multi_turn import MultiTurnEngine, ObservationFormat, TurnLimits
from posttrain.rollout.native import NativeEngine
from posttrain.tools.base import Tool
from posttrain.tools.hermes import ToolCall
from posttrain.tools.parsers import TOOL_PARSERS, ToolParser
from posttrain.tools.runner import ToolRunner


def _schema(name: str, params: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "description": name, "parameters": {
        "type": "object", "properties": params or {}, "required": list(params or {})}}}


class Square(Tool):
    """Answers ``x * x`` for {"x": int}."""

    def execute(self, arguments: dict) -> str:
        return str(arguments["x"] ** 2)


class Echo(Tool):
    def execute(self, arguments: dict) -> str:
        return "ok 42"


class ScriptedLM(torch.nn.Module):
    """A stand-in causal LM for checking the engine's bookkeeping: at position p it puts all mass on
    ``script[p + 1]``, and it records, per row and position, every token fed to it. It keeps no
    cache: it needs none to follow its script."""

    def __init__(self, script: list[int], vocab: int):
        super().__init__()
        self.script, self.vocab = script, vocab
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.fed: list[dict[int, list[int]]] = []  # per call: position -> fed tokens (over rows)

    def forward(self, input_ids, attention_mask, position_ids, use_cache=True, cache=None, logits_to_keep=None):
        chunk = attention_mask[:, -input_ids.shape[1]:]
        self.fed.append([[(int(p), int(t)) for t, p, m in zip(ids, pos, msk) if m]
                         for ids, pos, msk in zip(input_ids, position_ids, chunk)])
        last = position_ids[:, -1]
        logits = torch.full((input_ids.shape[0], 1, self.vocab), -100.0)
        for b, p in enumerate(last.tolist()):
            if p + 1 < len(self.script):
                logits[b, 0, self.script[p + 1]] = 100.0
        return SimpleNamespace(logits=logits)


def _enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _engine(model, tok, tools, *, limits: TurnLimits, parser: ToolParser | None = None, template="qwen_retool"):
    return MultiTurnEngine(model, tokenizer=tok, runner=ToolRunner(tools, max_workers=2),
                           parser=parser or TOOL_PARSERS.get("hermes"),
                           observation=ObservationFormat(get_template(template), tok), limits=limits,
                           pad_token_id=tok.pad_token_id, eos_token_ids=[tok.convert_tokens_to_ids("<|im_end|>")])


def test_three_tool_calls_train_on_exactly_the_sampled_and_tool_tokens(tiny_tokenizer):
    tok = tiny_tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    prompt = _enc(tok, "<|im_start|>user\nsquare 3, then 4, then 5<|im_end|>\n<|im_start|>assistant\n")
    turns, tools_out = [], []
    for x in (3, 4, 5):
        turns.append(_enc(tok, f'<tool_call>{{"name": "square", "arguments": {{"x": {x}}}}}') + _enc(tok, "</tool_call>"))
        # written by hand, not by ObservationFormat: the turn paused at </tool_call>, so <|im_end|> leads
        tools_out.append(_enc(tok, f"<|im_end|>\n<|im_start|>tool\n{x * x}<|im_end|>\n<|im_start|>assistant\n"))
    final = _enc(tok, "\\boxed{50}") + [im_end]
    response, mask = [], []
    for turn, out in zip(turns, tools_out):
        response += turn + out
        mask += [1] * len(turn) + [0] * len(out)
    response += final
    mask += [1] * len(final)
    model = ScriptedLM(prompt + response, len(tok))
    engine = _engine(model, tok, {"square": Square(_schema("square", {"x": {"type": "integer"}}))},
                     limits=TurnLimits(max_tool_calls=5, max_total_response_length=400, admit_every=2))
    outs = engine.generate([prompt], 2, SamplingParams(temperature=1.0, max_tokens=64, seed=3))

    for out in outs[0]:
        assert out.token_ids == response
        assert out.response_mask == mask
        assert out.tool_call_num == 3 and out.finish_reason == "stop"
        assert all(lp == 0.0 for lp, m in zip(out.logprobs, mask) if not m)
        assert all(lp > -1e-3 for lp, m in zip(out.logprobs, mask) if m)  # the script's tokens: p = 1
    # token in, token out: every position of prompt + response was fed exactly once per row, with
    # exactly the trajectory's token (no re-prefill, no re-encoding)
    for row in range(2):
        fed = Counter()
        tokens = {}
        for call in model.fed:
            pairs = call[0] if len(call) == 1 else call[row]  # the prefill holds the one unique prompt
            for p, t in pairs:
                fed[p] += 1
                tokens[p] = t
        full = prompt + response
        assert sorted(fed) == list(range(len(full) - 1))  # the last token (<|im_end|>) is never fed
        assert set(fed.values()) == {1}
        assert [tokens[p] for p in range(len(full) - 1)] == full[:-1]
    metrics = engine.pop_metrics()
    assert metrics["tool/calls"] == 6 and metrics["tool/errors"] == 0


def _frequent_token(engine: NativeEngine, tok, prompts, sampling) -> int:
    """A token the model samples often, that encodes back to itself (used as a pause tag)."""
    outs = engine.generate(prompts, 4, sampling)
    counts = Counter(t for group in outs for o in group for t in o.token_ids[2:])
    for token, _ in counts.most_common():
        if _enc(tok, tok.decode([token])) == [token] and token != tok.pad_token_id:
            return token
    pytest.skip("no round-trippable frequent token")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_kv_continuation_equals_reprefilling_on_a_real_model(mini_qwen2_dir, tiny_tokenizer, temperature):
    from transformers import AutoModelForCausalLM

    tok = tiny_tokenizer
    model = AutoModelForCausalLM.from_pretrained(str(mini_qwen2_dir), dtype=torch.float32)
    sampling = SamplingParams(temperature=temperature, top_k=4, max_tokens=12, seed=11)
    prompts = [_enc(tok, "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"),
               _enc(tok, "<|im_start|>user\n7 * 8 = ?<|im_end|>\n<|im_start|>assistant\n"),
               _enc(tok, "<|im_start|>user\nthree<|im_end|>\n<|im_start|>assistant\n")]
    plain = NativeEngine(model, pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id])
    tag = tok.decode([_frequent_token(plain, tok, prompts, sampling)])
    # every turn that ends at the tag calls the echo tool
    parser = ToolParser("every_pause", start_tag="", end_tag=tag, parse=lambda text: [ToolCall(name="echo")])
    engine = _engine(model, tok, {"echo": Echo(_schema("echo"))}, parser=parser,
                     limits=TurnLimits(max_tool_calls=3, max_total_response_length=60, admit_every=3))
    kv = engine.generate(prompts, 3, sampling)
    ref = engine.generate_reprefill(prompts, 3, sampling)
    calls = [o.tool_call_num for group in kv for o in group]
    assert sum(calls) >= 3, calls  # the check is about continued rows
    for g_kv, g_ref in zip(kv, ref):
        for a, b in zip(g_kv, g_ref):
            assert a.token_ids == b.token_ids
            assert a.response_mask == b.response_mask
            assert a.tool_call_num == b.tool_call_num and a.finish_reason == b.finish_reason
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
    # without tool calls, the multi-turn engine samples what the single-turn engine samples
    no_tools = _engine(model, tok, {}, limits=TurnLimits(max_tool_calls=0, max_total_response_length=60))
    single = plain.generate(prompts, 3, sampling)
    multi = no_tools.generate(prompts, 3, sampling)
    assert [[o.token_ids for o in g] for g in single] == [[o.token_ids for o in g] for g in multi]


def test_limits_end_rows_and_bad_calls_reach_the_model(tiny_tokenizer):
    tok = tiny_tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    prompt = _enc(tok, "<|im_start|>user\ngo<|im_end|>\n<|im_start|>assistant\n")
    call = _enc(tok, "<tool_call>{not json") + _enc(tok, "</tool_call>")
    # a malformed call: the model reads the parser's message as the tool's output, and goes on
    out1 = _enc(tok, "<|im_end|>\n<|im_start|>tool\n")
    script = prompt + call
    model = ScriptedLM(script, len(tok))
    engine = _engine(model, tok, {}, limits=TurnLimits(max_tool_calls=2, max_total_response_length=400))
    out = engine.generate([prompt], 1, SamplingParams(temperature=0.0, max_tokens=40))[0][0]
    assert out.token_ids[:len(call)] == call
    tool_text = tok.decode([t for t, m in zip(out.token_ids, out.response_mask) if not m])
    assert tool_text.startswith(tok.decode(out1)) and "[error: the tool call is not valid JSON" in tool_text
    assert engine.pop_metrics()["tool/errors"] == 1
    # the response budget cuts a row inside its tool output: it ends there, "length"
    model2 = ScriptedLM(prompt + call + [im_end], len(tok))
    short = _engine(model2, tok, {}, limits=TurnLimits(max_tool_calls=2, max_total_response_length=len(call) + 3))
    out = short.generate([prompt], 1, SamplingParams(temperature=0.0, max_tokens=40))[0][0]
    assert len(out.token_ids) == len(call) + 3 and out.finish_reason == "length"
    assert out.response_mask == [1] * len(call) + [0] * 3


def test_tool_output_is_truncated_by_characters():
    limits = TurnLimits(max_tool_calls=1, max_total_response_length=10, max_tool_response_length=4,
                        truncate_side="middle")
    assert limits.truncate("abcdefgh") == "ab...(truncated)...gh"
    assert TurnLimits(1, 10, max_tool_response_length=4).truncate("abcdefgh") == "abcd...(truncated)"
    assert TurnLimits(1, 10, max_tool_response_length=4, truncate_side="right").truncate("abcdefgh") == \
        "(truncated)...efgh"
    with pytest.raises(Exception, match="tool_response_truncate_side"):
        TurnLimits(1, 10, truncate_side="top")


@pytest.mark.parametrize("body,error", [
    ('{"name": "a", "arguments": {"x": ' + "[" * 1100 + "]" * 1100 + "}}", "nested too deeply"),
    ('{"name": "a", "arguments": {"x": ' + "7" * 4400 + "}}", "an integer too long to read"),
    ('{"name": "\\ud800", "arguments": "x"}', "are a string that is not valid JSON"),
], ids=["H4-nesting", "H5-long-integer", "SB45-surrogate"])
def test_nothing_the_model_writes_in_a_call_stops_the_rollout(tiny_tokenizer, body, error):
    """Probes H4 and H5 (the parser raised RecursionError / ValueError inside _start_tools) and SB45
    (an error message holding a lone surrogate made the observation's encode raise)."""
    tok = tiny_tokenizer
    prompt = _enc(tok, "<|im_start|>user\ngo<|im_end|>\n<|im_start|>assistant\n")
    call = _enc(tok, "<tool_call>" + body) + _enc(tok, "</tool_call>")
    engine = _engine(ScriptedLM(prompt + call, len(tok)), tok, {},
                     limits=TurnLimits(max_tool_calls=1, max_total_response_length=len(call) + 200))
    out = engine.generate([prompt], 1, SamplingParams(temperature=0.0, max_tokens=len(call) + 10))[0][0]
    assert out.token_ids[:len(call)] == call and out.tool_call_num == 1
    tool_text = tok.decode([t for t, m in zip(out.token_ids, out.response_mask) if not m])
    assert "[error: " in tool_text and error in tool_text
