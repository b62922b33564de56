"""Turn-level credit (``rl_config.turn_credit: turn``) on a two-turn task where only the second turn
is rewarded.

* The on-policy loop's advantage phase, on a real TransferDock holding multi-turn rows (tool tokens
  masked), writes each sampled token its turn's advantage: hand-checked values, and the
  trajectory-level default unchanged.
* A tiny run learns: a 2-layer Qwen2 writes turn 1, a scripted tool answers with fixed tokens
  (masked out), the model writes turn 2, and only turn 2 is rewarded (its share of target tokens).
  Advantages from :func:`posttrain.algo.turn_credit.turn_level_advantages` (turn 1's tokens get
  ``gamma * (s - mean)``, hand-checked every iteration), the update is the project's GRPO actor loss;
  the second-turn reward rises over a few iterations.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from posttrain.algo.policy_loss import actor_loss
from posttrain.algo.turn_credit import turn_level_advantages
from posttrain.config.options import AdvantageOptions
from posttrain.loops.experience import MULTI_TURN_COLUMNS, new_dock
from posttrain.loops.onpolicy import OnPolicyTrainer

GAMMA = 0.5
# two groups of two rows: turn 1, tool tokens (0), turn 2
MASKS = [[1, 1, 0, 0, 1], [1, 0, 1, 1], [1, 1, 0, 1, 1, 1], [1, 0, 0, 1]]
SCORES = [1.0, 0.0, 0.25, 0.75]


def _dock_advantages(turn_credit: str, estimator: str = "grpo_no_std") -> list[list[float]]:
    """The loop's advantage phase on a dock holding MASKS and SCORES."""
    td = new_dock(len(MASKS), 2, guarantee_order=True, seed=0, extra_columns=MULTI_TURN_COLUMNS)
    idx = list(range(len(MASKS)))
    td.put(["response_length", "scores", "response_mask", "tool_call_num"], idx,
           [[len(m) for m in MASKS], torch.tensor(SCORES), [torch.tensor(m) for m in MASKS], [1] * len(MASKS)])
    plan = SimpleNamespace(advantages=AdvantageOptions(estimator=estimator, gamma=GAMMA, turn_credit=turn_credit),
                           reads={"adv_dispatch_size": len(MASKS)}, n=2)
    OnPolicyTrainer.advantages(SimpleNamespace(plan=plan), td)
    batch, _ = td.get("metrics", ["advantages"], indexes=idx)
    return [row.tolist() for row in batch["advantages"]]


def test_the_loop_gives_each_turn_its_own_advantage():
    # group 1: scores 1, 0 -> turn 1 +-.5 * .5, turn 2 +-.5; group 2: .25, .75 -> turn 1 -+.125, turn 2 -+.25
    want = [[0.25, 0.25, 0, 0, 0.5], [-0.25, 0, -0.5, -0.5],
            [-0.125, -0.125, 0, -0.25, -0.25, -0.25], [0.125, 0, 0, 0.25]]
    got = _dock_advantages("turn")
    for g, w in zip(got, want):
        assert g == pytest.approx(w)
    # the default: one value per trajectory on every token (the loss masks the tool tokens)
    trajectory = _dock_advantages("trajectory")
    assert trajectory[0] == pytest.approx([0.5] * 5) and trajectory[3] == pytest.approx([0.25] * 4)


PROMPTS, N, TURN, TOOL = 4, 8, 4, [5, 6, 7]  # prompts, samples each, tokens per turn, the tool's answer


def _sample(model, prefix: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    tokens = prefix
    for _ in range(count):
        with torch.no_grad():
            logits = model(tokens).logits[:, -1].float()
        tokens = torch.cat([tokens, torch.multinomial(logits.softmax(-1), 1, generator=generator)], dim=1)
    return tokens[:, prefix.shape[1]:]


def _episode(model, prompts: torch.Tensor, generator: torch.Generator):
    """(sequences, response_mask, turn-2 tokens) of a two-turn episode per row."""
    first = _sample(model, prompts, TURN, generator)
    tool = torch.tensor(TOOL).expand(len(prompts), -1)
    second = _sample(model, torch.cat([prompts, first, tool], dim=1), TURN, generator)
    response = torch.cat([first, tool, second], dim=1)
    mask = torch.cat([torch.ones_like(first), torch.zeros_like(tool), torch.ones_like(second)], dim=1)
    return torch.cat([prompts, response], dim=1), mask, second


def test_a_tiny_two_turn_run_learns_from_the_second_turns_reward(mini_qwen2_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(mini_qwen2_dir, dtype=torch.float32)
    vocab = model.config.vocab_size
    targets = torch.arange(vocab) % 8 == 3  # the tokens turn 2 is rewarded for
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-2)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, vocab, (PROMPTS, 3), generator=generator).repeat_interleave(N, 0)
    rewards = []
    for _ in range(8):
        sequences, mask, second = _episode(model, prompts, generator)
        scores = targets[second].float().mean(-1)
        rewards.append(scores.mean().item())
        advantages, _ = turn_level_advantages("grpo_no_std", scores, mask, group_size=N, gamma=GAMMA)
        centred = scores - scores.reshape(-1, N).mean(-1).repeat_interleave(N)  # by hand: s - group mean
        assert advantages[:, :TURN] == pytest.approx(GAMMA * centred[:, None].expand(-1, TURN), abs=1e-6)
        assert advantages[:, -TURN:] == pytest.approx(centred[:, None].expand(-1, TURN), abs=1e-6)
        assert (advantages[:, TURN:TURN + len(TOOL)] == 0).all()
        logits = model(sequences).logits[:, prompts.shape[1] - 1:-1].float()
        logprobs = logits.log_softmax(-1).gather(-1, sequences[:, prompts.shape[1]:, None]).squeeze(-1)
        loss, _ = actor_loss(logprobs, logprobs.detach(), advantages, mask)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert rewards[-1] > rewards[0] + 0.3, rewards  # .125 -> .98 in 8 iterations (generator seeds 1, 2: .10 -> .91, .12 -> .65)
