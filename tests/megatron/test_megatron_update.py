"""The Megatron-Core backend's update (posttrain.train.megatron.engine.update_step) equals the HF
engine's: 2 GRPO optimizer steps (the actor loss of posttrain.algo, token-mean over the mini-batch,
clip 0.2, clip_grad 1.0, Adam) on a batch of left-padded prompts and right-padded responses give the
same pg_loss, entropy, clip fraction and gradient norm at TP 2, at PP 2 (2 gloo ranks) and at
TP 2 x PP 2 (4 ranks) as
TrainEngine.update in one process, within 1e-4 relative (fp32); the trained weights gathered back
into the HF layout (posttrain.train.megatron.model.hf_weights) equal the HF engine's."""

from __future__ import annotations

import pytest
import torch
from spawn_ranks import run_on_ranks

pytestmark = pytest.mark.slow
TEMPERATURE, LR = 0.9, 1e-2
COMPARED = ("actor/pg_loss", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl")


def grpo_batch(hf_dir: str):
    """4 rows of the training layout, with old log-probs a little off the model's and random advantages."""
    from transformers import AutoModelForCausalLM

    from posttrain.train.engine import TrainEngine
    from posttrain.train.layout import build_batch

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 100, (n,), generator=g) for n in (5, 3, 6, 4)]
    responses = [torch.randint(1, 100, (n,), generator=g) for n in (4, 6, 2, 5)]
    batch = build_batch(prompts, responses, pad_token_id=0)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    logprobs = TrainEngine(model, micro_batch_size=4).compute_logprobs(batch, temperature=TEMPERATURE)
    mask = batch["response_mask"].float()
    batch["old_logprobs"] = (logprobs + 0.2 * torch.randn(logprobs.shape, generator=g)) * mask
    batch["advantages"] = torch.randn(mask.shape[0], 1, generator=g).expand_as(mask) * mask
    return batch


def hf_steps(hf_dir: str, batch) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    from posttrain.train.engine import TrainEngine
    from posttrain.train.loss_fns import make_actor_loss_fn
    from posttrain.train.optim import build_optimizer

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    engine = TrainEngine(model, build_optimizer(model, LR, weight_decay=0.0), clip_grad=1.0, micro_batch_size=1)
    loss_fn = make_actor_loss_fn(temperature=TEMPERATURE, clip_ratio=0.2)
    steps = [engine.update(batch, loss_fn, mini_batch_size=4)[0] for _ in range(2)]
    return steps, {name: p.detach() for name, p in model.named_parameters()}


def assert_same_update(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Adam divides by sqrt(v) + eps, so an element whose gradient is ~0 up to rounding (~1e-9,
    against eps 1e-8) moves by up to lr x 0.1 in either engine, in directions set by the rounding.
    Every element must agree within 0.2 x lr (a wrong layout moves most of them by far more), and
    all but 1 % within 1e-5. A key bias's exact gradient is 0 (it shifts every score of a query
    alike), so its whole update is such noise: only the first rule applies to it."""
    diff = (got - want).abs()
    assert float(diff.max()) <= 0.2 * LR, (name, float(diff.max()))
    if not name.endswith("k_proj.bias"):
        assert float((diff > 1e-5).float().mean()) <= 0.01, (name, float((diff > 1e-5).float().mean()))


def megatron_loss(logprobs, entropy, micro_batch, num_tokens, num_seqs):
    from posttrain.algo.policy_loss import actor_loss

    return actor_loss(logprobs, micro_batch["old_logprobs"], micro_batch["advantages"], micro_batch["response_mask"],
                      entropy=entropy, clip_ratio=0.2, num_tokens=num_tokens, num_seqs=num_seqs)


def worker(rank: int, hf_dir: str, tp: int, pp: int) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from posttrain.train.megatron.cpu_shims import cpu_megatron
    from posttrain.train.megatron.engine import update_step
    from posttrain.train.megatron.model import hf_to_megatron, hf_weights

    batch = grpo_batch(hf_dir)
    want, want_weights = hf_steps(hf_dir, batch)
    with cpu_megatron():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        [chunk], args = hf_to_megatron(hf_dir, for_training=True)
        wrapped = DistributedDataParallel(chunk.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False), chunk)
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.0,
                                                           clip_grad=1.0, bf16=False), [wrapped])
        got = [update_step([wrapped], optimizer, batch, megatron_loss, vocab_size=100, temperature=TEMPERATURE)
               for _ in range(2)]
        for step, (g, w) in enumerate(zip(got, want)):
            assert g["grad_norm"] == pytest.approx(w["actor/grad_norm"], rel=1e-4), (step, g, w)
            if ps.is_pipeline_last_stage():
                for key in COMPARED:
                    assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-6), (step, key, g, w)
        # the trained weights, gathered into the HF layout on every rank (the rollout's sync)
        got_weights = dict(hf_weights(chunk, args))
        assert sorted(got_weights) == sorted(want_weights)
        for name, value in want_weights.items():
            assert_same_update(name, got_weights[name], value)
        # both clippings were at work: the ratio's (step 2) and the gradient norm's (step 1, above 1.0)
        assert want[1]["actor/pg_clipfrac"] > 0 and want[0]["actor/grad_norm"] > 1.0, want
        ps.destroy_model_parallel()


@pytest.mark.parametrize("kind,tp,pp", [("qwen2", 2, 1), ("qwen2", 1, 2), ("llama", 2, 1), ("llama", 1, 2),
                                        ("qwen2", 2, 2)])
def test_two_megatron_steps_equal_the_hf_engine(tiny_hf, tmp_path, kind, tp, pp):
    run_on_ranks(worker, str(tiny_hf(kind)), tp, pp, out=tmp_path, world=tp * pp)
