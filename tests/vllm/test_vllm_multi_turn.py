"""Multi-turn tool use on the real vLLM (:mod:`posttrain.rollout.vllm_multi_turn`) against the native
multi-turn engine: in fp32 greedy the same conversations (tokens, masks, calls, finish reasons,
log-probs) with an end tag of one token and of two tokens; sampled, every sampled token's log-prob is
the model's on the whole conversation so far (tool tokens included) and tool tokens are masked."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from posttrain.data.templates import get_template
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.multi_turn import MultiTurnEngine, ObservationFormat, TurnLimits
from posttrain.rollout.native import NativeEngine
from posttrain.tools.base import Tool
from posttrain.tools.hermes import ToolCall
from posttrain.tools.parsers import ToolParser
from posttrain.tools.runner import ToolRunner

GREEDY = SamplingParams(temperature=0.0, top_k=-1, max_tokens=10)
LIMITS = TurnLimits(max_tool_calls=3, max_total_response_length=60, admit_every=3)


class Echo(Tool):
    def execute(self, arguments: dict) -> str:
        return "ok 42"


ECHO = {"echo": Echo({"type": "function", "function": {"name": "echo", "description": "echo", "parameters": {
    "type": "object", "properties": {}, "required": []}}})}


@pytest.fixture(scope="module")
def model(tiny_tokenizer):
    """A random Qwen2 on the tiny tokenizer (head dim 64 for vLLM's CPU attention), its weights spread
    wider than HF's default so that greedy decoding varies (and writes the chat's end of turn)."""
    from tests.helpers.vllm_models import vllm_qwen2

    return vllm_qwen2(len(tiny_tokenizer), tied=False, initializer_range=0.1)


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    texts = ["hello there", "7 * 8 = ?", "three", "what is the sum of 12 and 30"]
    return [tiny_tokenizer.encode(f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n",
                                  add_special_tokens=False) for t in texts]


@pytest.fixture(scope="module")
def vllm(model):
    from posttrain.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(model, eos_token_ids=[2], dtype="float32", max_model_len=256, max_num_seqs=16,
                      max_num_batched_tokens=512, enable_prefix_caching=True)


def pause_tags(model, tok, prompts) -> tuple[str, str]:
    """The one-token and the two-token end tag the greedy model writes most often (text that encodes
    back to the same tokens), so that turns pause there and call the echo tool."""
    outs = NativeEngine(model, pad_token_id=0, eos_token_ids=[2]).generate(prompts, 1, GREEDY)
    ones, twos = Counter(), Counter()
    for out in (group[0].token_ids for group in outs):
        ones.update(t for t in out if t != 2)
        twos.update((a, b) for a, b in zip(out, out[1:]) if a != b and 2 not in (a, b))
    round_trips = lambda ids: tok.encode(tok.decode(list(ids)), add_special_tokens=False) == list(ids)
    one = next((tok.decode([t]) for t, _ in ones.most_common() if round_trips([t])), None)
    two = next((tok.decode(list(p)) for p, _ in twos.most_common() if round_trips(p)), None)
    assert one is not None and two is not None, "no round-trippable tag in the greedy outputs"
    return one, two


def turns(tok, tag: str) -> dict:
    """The multi-turn pieces around a parser whose every turn ending at ``tag`` calls the echo tool."""
    parser = ToolParser("every_pause", start_tag="", end_tag=tag, parse=lambda text: [ToolCall(name="echo")])
    return dict(tokenizer=tok, runner=ToolRunner(ECHO, max_workers=2), parser=parser,
                observation=ObservationFormat(get_template("qwen_retool"), tok), limits=LIMITS)


@pytest.fixture(scope="module")
def tags(model, tiny_tokenizer, prompts):
    return pause_tags(model, tiny_tokenizer, prompts)


@pytest.mark.parametrize("tag_tokens", [1, 2])
def test_greedy_conversations_are_the_native_engines(model, vllm, tiny_tokenizer, prompts, tags, tag_tokens):
    from posttrain.rollout.vllm_multi_turn import VLLMMultiTurnEngine

    tok, tag = tiny_tokenizer, tags[tag_tokens - 1]
    assert len(tok.encode(tag, add_special_tokens=False)) == tag_tokens
    native = MultiTurnEngine(model, pad_token_id=0, eos_token_ids=[2], **turns(tok, tag))
    ours = VLLMMultiTurnEngine(vllm, **turns(tok, tag))
    want = native.generate(prompts, 2, GREEDY)
    got = ours.generate(prompts, 2, GREEDY)
    calls = [o.tool_call_num for group in want for o in group]
    assert sum(calls) >= 2, calls  # the check is about continued conversations
    for g_got, g_want in zip(got, want):
        for a, b in zip(g_got, g_want):
            assert a.token_ids == b.token_ids
            assert a.response_mask == b.response_mask
            assert (a.tool_call_num, a.finish_reason) == (b.tool_call_num, b.finish_reason)
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    metrics = ours.pop_metrics()
    assert metrics["tool/calls"] == sum(calls)
    assert metrics.get("rollout/sync_probe_diff", 0.0) < 1e-4  # the engine's own metrics pass through


def test_sampled_turns_score_the_whole_conversation(model, vllm, tiny_tokenizer, prompts, tags):
    """At T = 1 without truncation each sampled token's log-prob is the model's given everything
    before it (prompt, earlier turns, tool outputs); tool tokens are the observation format's
    encoding of the echo output, masked, with log-prob 0."""
    from posttrain.rollout.vllm_multi_turn import VLLMMultiTurnEngine

    tok = tiny_tokenizer
    pieces = turns(tok, tags[1])
    ours = VLLMMultiTurnEngine(vllm, **pieces)
    sampling = SamplingParams(temperature=1.0, top_k=-1, max_tokens=10, seed=5)
    outs = ours.generate(prompts[:2], 3, sampling, prompt_keys=[7, 8])
    again = ours.generate(prompts[1:2], 3, sampling, prompt_keys=[8])  # the same samples, alone
    assert [o.token_ids for o in again[0]] == [o.token_ids for o in outs[1]]
    observations = [pieces["observation"].encode(["ok 42"], closed=closed) for closed in (False, True)]
    continued = 0
    for prompt, group in zip(prompts, outs):
        for out in group:
            ids = torch.tensor([prompt + out.token_ids])
            with torch.no_grad():
                logprobs = model(input_ids=ids).logits[0, len(prompt) - 1:-1].log_softmax(-1)
            want = logprobs.gather(-1, ids[0, len(prompt):, None])[:, 0]
            mask = torch.tensor(out.response_mask, dtype=torch.bool)
            assert torch.tensor(out.logprobs)[mask] == pytest.approx(want[mask], abs=1e-4)
            assert all(lp == 0.0 for lp, m in zip(out.logprobs, out.response_mask) if not m)
            segments = tool_segments(out.token_ids, out.response_mask)
            assert len(segments) == out.tool_call_num
            for k, segment in enumerate(segments):
                last = k == len(segments) - 1 and out.finish_reason == "length"
                assert any(segment == o or (last and o[:len(segment)] == segment) for o in observations), segment
            continued += out.tool_call_num > 0 and out.response_mask[-1] == 1
    assert continued >= 1  # some conversation went on after a tool output


def tool_segments(tokens: list[int], mask: list[int]) -> list[list[int]]:
    """The runs of tokens with mask 0 (one per admitted tool turn)."""
    segments, previous = [], 1
    for token, m in zip(tokens, mask):
        if not m:
            if previous:
                segments.append([])
            segments[-1].append(token)
        previous = m
    return segments

