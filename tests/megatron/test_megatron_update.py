"""The Megatron-Core backend's engine (posttrain.training.megatron.engine.MegatronEngine) equals the
HF engine (TrainEngine) with the same loss function (make_actor_loss_fn: GRPO's clipped loss,
token-mean over each mini-batch, clip 0.2; clip_grad 1.0; Adam, or SGD with momentum in one case): 2 epochs of 2 shuffled
mini-batches of left-padded prompts and right-padded responses give, step by step, the same
pg_loss, entropy, clip fraction, approximate KL, gradient norm and lr within 1e-4 relative at TP 2,
at PP 2 (2 gloo ranks) and at TP 2 x PP 2 (4 ranks), with and without sequence parallelism; then
the same log-probs and entropy on every rank; and the trained weights gathered back into the HF
layout (posttrain.training.megatron.model.hf_weights) equal the HF engine's. SFT's loss (make_sft_loss_fn) likewise, at TP 2."""

from __future__ import annotations

import pytest
import torch

from tests.megatron.spawn_ranks import run_on_ranks

pytestmark = pytest.mark.slow
TEMPERATURE, LR = 0.9, 1e-2


def grpo_batch(hf_dir: str):
    """4 rows of the training layout, with old log-probs a little off the model's and random advantages."""
    from transformers import AutoModelForCausalLM

    from posttrain.training.engine import TrainEngine
    from posttrain.training.batch import build_batch

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


def loss_fn(kind: str = "grpo"):
    """The same loss function object in both engines."""
    from posttrain.training.loss_fns import make_actor_loss_fn, make_sft_loss_fn
    from posttrain.training.options import ActorLossOptions

    return make_actor_loss_fn(ActorLossOptions(temperature=TEMPERATURE)) if kind == "grpo" else make_sft_loss_fn()


def hf_run(hf_dir: str, batch, kind: str, optimizer: str = "adam"):
    """2 epochs of 2 shuffled mini-batches (4 optimizer steps), then the log-probs and the weights."""
    from transformers import AutoModelForCausalLM

    from posttrain.training.engine import TrainEngine
    from posttrain.training.optim import build_optimizer

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    engine = TrainEngine(model, build_optimizer(model, LR, weight_decay=0.0, optimizer=optimizer, sgd_momentum=0.9),
                         clip_grad=1.0, micro_batch_size=1,
                         metric_prefix="actor" if kind == "grpo" else "sft")
    steps = engine.update(batch, loss_fn(kind), mini_batch_size=2, epochs=2, shuffle=True, seed=5)
    after = engine.compute_logprobs(batch, temperature=TEMPERATURE, with_entropy=True)
    return steps, after, {name: p.detach() for name, p in model.named_parameters()}


def assert_same_update(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Adam divides by sqrt(v) + eps, so an element whose gradient is ~0 up to rounding (~1e-9,
    against eps 1e-8) moves by up to lr x 0.1 in either engine, in directions set by the rounding.
    Every element must agree within 0.2 x lr (a wrong layout moves most of them by far more), and
    all but 5 % within 1e-5 (4 steps; a 64-element bias had 1 such element). A key bias's exact
    gradient is 0 (it shifts every score of a query alike), so its whole update is such noise: only
    the first rule applies to it. The log-probs after the update are compared exactly above."""
    diff = (got - want).abs()
    assert float(diff.max()) <= 0.2 * LR, (name, float(diff.max()))
    if not name.endswith("k_proj.bias"):
        assert float((diff > 1e-5).float().mean()) <= 0.05, (name, float((diff > 1e-5).float().mean()))


def worker(rank: int, hf_dir: str, tp: int, pp: int, kind: str, micro_batch_size: int, packed: bool,
           sequence_parallel: bool = False, optimizer: str = "adam") -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from posttrain.training.megatron.cpu_shims import cpu_megatron
    from posttrain.training.megatron.engine import MegatronEngine
    from posttrain.training.megatron.model import hf_to_megatron, hf_weights

    batch = grpo_batch(hf_dir)
    want, want_after, want_weights = hf_run(hf_dir, batch, kind, optimizer)
    with cpu_megatron():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        [chunk], args = hf_to_megatron(hf_dir, for_training=True, sequence_parallel=sequence_parallel)
        assert chunk.config.sequence_parallel is sequence_parallel
        wrapped = DistributedDataParallel(chunk.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False), chunk)
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer=optimizer, lr=LR, weight_decay=0.0,
                                                           sgd_momentum=0.9, clip_grad=1.0, bf16=False), [wrapped])
        options = None
        if packed:  # token budgets of 20: two rows (17-18 tokens) packed in one sequence
            from posttrain.training.options import EngineOptions, TokenBudget

            options = EngineOptions(use_remove_padding=True, forward_budget=TokenBudget(20),
                                    update_budget=TokenBudget(20))
        engine = MegatronEngine(wrapped, optimizer, vocab_size=100, micro_batch_size=micro_batch_size,
                                metric_prefix="actor" if kind == "grpo" else "sft", options=options)
        assert engine.packing == packed
        if packed:  # and generate_config.offload_train_grad: the gradient buffers freed between updates
            from posttrain.training.megatron.engine import MegatronOffload

            engine.offload = MegatronOffload([wrapped], optimizer, optimizer_state=False, grads=True)
            engine.offload.to_host()
            assert engine.offload.grad_bytes() == 0
        got = engine.update(batch, loss_fn(kind), mini_batch_size=2, epochs=2, shuffle=True, seed=5)
        assert len(got) == len(want) == 4
        assert engine.offload is None or engine.offload.grad_bytes() == 0
        for step, (g, w) in enumerate(zip(got, want)):
            assert sorted(g) == sorted(w), (sorted(g), sorted(w))
            for key in w:
                # approximate KL is a mean of log-ratio differences (~1e-2 here): its absolute noise is
                # the log-probs' (atol 1e-4 below), which after 3 steps at lr 1e-2 reaches ~1e-5 on
                # AVX2-only CPUs (another BLAS kernel than AVX-512's)
                kl = key.endswith("/ppo_kl")
                assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-4 if kl else 1e-5), (step, key, g, w)
        # the next log-probs and entropy, on every rank (computed on the last stage, broadcast)
        logprobs, entropy = engine.compute_logprobs(batch, temperature=TEMPERATURE, with_entropy=True)
        torch.testing.assert_close(logprobs, want_after[0], rtol=0, atol=1e-4)
        torch.testing.assert_close(entropy, want_after[1], rtol=0, atol=1e-4)
        # the trained weights, gathered into the HF layout on every rank (the rollout's sync)
        got_weights = dict(hf_weights([chunk], args))
        assert sorted(got_weights) == sorted(want_weights)
        for name, value in want_weights.items():
            assert_same_update(name, got_weights[name], value)
        if kind == "grpo":  # both clippings were at work: the ratio's and the gradient norm's (above 1.0)
            assert max(w["actor/pg_clipfrac"] for w in want) > 0 and max(w["actor/grad_norm"] for w in want) > 1, want
        ps.destroy_model_parallel()


@pytest.mark.parametrize("model,tp,pp,loss,mbs,packed,sp,optimizer", [
    ("qwen2", 2, 1, "grpo", 1, False, False, "adam"), ("qwen2", 1, 2, "grpo", 1, False, False, "adam"),
    ("llama", 2, 1, "grpo", 2, False, False, "adam"), ("llama", 1, 2, "grpo", 2, False, False, "adam"),
    ("qwen2", 2, 2, "grpo", 2, False, False, "adam"), ("llama", 2, 1, "sft", 1, False, False, "sgd"),
    ("qwen2", 1, 2, "grpo", 2, True, False, "adam"), ("qwen2", 2, 1, "sft", 2, True, False, "adam"),
    ("qwen3", 2, 1, "grpo", 2, False, True, "adam"), ("qwen2", 2, 2, "grpo", 2, True, True, "adam")])
def test_the_megatron_engine_equals_the_hf_engine(tiny_hf, tmp_path, model, tp, pp, loss, mbs, packed, sp,
                                                  optimizer):
    """``mbs``: rows per micro-batch in the Megatron engine (2: the left- and right-padded rows of a
    mini-batch share one forward); ``packed``: their valid tokens packed into one sequence with a
    block-diagonal causal mask, micro-batches cut by a token budget, and the gradient buffers freed
    between updates (Megatron-Core's offload_grad_buffers); ``sp``: sequence parallelism (each
    sequence split over the TP ranks between the tensor-parallel layers, padded to a multiple of TP:
    the packed sequences of 17-18 tokens are; the norms' gradients summed over TP; Qwen3's q/k norms);
    ``optimizer``: ``sgd`` (momentum 0.9) is Megatron-Core's SGD against torch's in the HF engine."""
    run_on_ranks(worker, str(tiny_hf(model)), tp, pp, loss, mbs, packed, sp, optimizer, out=tmp_path,
                 world=tp * pp)

