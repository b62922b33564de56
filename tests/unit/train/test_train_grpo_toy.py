"""A tiny GRPO loop built from the pieces: sample -> reward -> group_norm -> update.

Checks that the sampler's own log-probs equal ``compute_logprobs`` for the sampled tokens (the
temperature-divided logits of the seed) and that the reward goes up.
"""

import pytest
import torch

from posttrain.algo.advantages import ADVANTAGE_ESTIMATORS, scores_to_token_level_rewards
from posttrain.training.engine import TrainEngine
from posttrain.training.batch import build_batch
from posttrain.training.loss_fns import make_actor_loss_fn
from posttrain.training.options import ActorLossOptions
from posttrain.training.optim import build_lr_scheduler, build_optimizer

from tests.unit.train.test_train_engine import tiny_model

TARGET, TEMPERATURE, GROUP, STEPS = 7, 0.7, 8, 3


@torch.no_grad()
def sample(model, prompts, generator):
    """Plain ancestral sampling without a cache; returns responses and the sampler's log-probs."""
    responses = [[] for _ in prompts]
    logprobs = torch.zeros(len(prompts), STEPS)
    for t in range(STEPS):
        batch = build_batch(prompts, [r if r else [0] for r in responses], pad_token_id=0)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        if t == 0:  # no response yet: drop the placeholder column
            ids, mask = ids[:, :-1], mask[:, :-1]
        out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
        logp = torch.log_softmax(out.logits[:, -1].float() / TEMPERATURE, dim=-1)
        tokens = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
        logprobs[:, t] = logp.gather(-1, tokens[:, None]).squeeze(-1)
        for row, token in zip(responses, tokens.tolist()):
            row.append(token)
    return responses, logprobs


@pytest.mark.slow
def test_grpo_toy_loop_raises_reward_and_logprobs_match_sampler():
    model = tiny_model(seed=1)
    model.eval()
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.0)
    scheduler = build_lr_scheduler(opt, lr=1e-2, lr_decay_style="constant", total_steps=16)
    engine = TrainEngine(model, opt, scheduler, micro_batch_size=12)
    generator = torch.Generator().manual_seed(0)
    prompts = [p for p in ([1, 2, 3], [4, 5], [6, 9, 10, 11]) for _ in range(GROUP)]  # contiguous groups
    loss_fn = make_actor_loss_fn(ActorLossOptions(temperature=TEMPERATURE))
    mean_rewards = []
    for it in range(8):
        responses, sampler_logprobs = sample(model, prompts, generator)
        batch = build_batch(prompts, responses, pad_token_id=0)
        batch["old_logprobs"] = engine.compute_logprobs(batch, temperature=TEMPERATURE)
        if it == 0:
            assert torch.allclose(batch["old_logprobs"], sampler_logprobs, atol=1e-5)
        scores = torch.tensor([sum(tok == TARGET for tok in r) / STEPS for r in responses])
        mean_rewards.append(scores.mean().item())
        rewards = scores_to_token_level_rewards(scores, batch["response_mask"])
        batch["advantages"], _ = ADVANTAGE_ESTIMATORS.get("group_norm")(
            rewards, batch["response_mask"], group_size=GROUP
        )
        engine.update(batch, loss_fn, mini_batch_size=12)
    assert sum(mean_rewards[-2:]) / 2 > sum(mean_rewards[:2]) / 2 + 0.2, mean_rewards
