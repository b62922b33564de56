"""Megatron-layout checkpoints of the Megatron-Core backend on 2 gloo ranks (TP 2, and PP 2), in
both formats (torch_dist, and the legacy per-rank torch files): a GRPO step, save, a second step; a
fresh model that loads the checkpoint takes the same second step (the same metrics and weights);
`posttrain convert` turns the saved checkpoint into an HF directory holding exactly the weights the
run had when it saved. A torch_dist checkpoint saved at TP 2 resumes at PP 2 (Megatron reshards the
weights and the Adam moments on load) and takes the TP 2 run's second step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.megatron.spawn_ranks import run_on_ranks
from tests.megatron.test_megatron_update import LR, grpo_batch, loss_fn

pytestmark = pytest.mark.slow


def fresh(hf_dir: str):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from posttrain.training.megatron.model import hf_to_megatron

    [chunk], args = hf_to_megatron(hf_dir, for_training=True)
    wrapped = DistributedDataParallel(chunk.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False), chunk)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.0, clip_grad=1.0,
                                                       bf16=False), [wrapped])
    return chunk, wrapped, optimizer, args


def worker(rank: int, hf_dir: str, tp: int, pp: int, save: str, fmt: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from posttrain.cli import main
    from posttrain.training.megatron.checkpoint import Part, load_megatron_checkpoint, save_megatron_checkpoint
    from posttrain.training.megatron.cpu_shims import cpu_megatron
    from posttrain.training.megatron.engine import MegatronEngine
    from posttrain.training.megatron.model import hf_weights

    batch = grpo_batch(hf_dir)
    with cpu_megatron():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        model_parallel_cuda_manual_seed(7)

        def step(wrapped, optimizer):
            return MegatronEngine(wrapped, optimizer, vocab_size=100).update(batch, loss_fn(), mini_batch_size=4)

        chunk, wrapped, optimizer, args = fresh(hf_dir)
        step(wrapped, optimizer)
        save_megatron_checkpoint(save, 1, {"": Part([chunk], optimizer, {})}, args, ckpt_format=fmt)
        saved = dict(hf_weights([chunk], args))
        want = step(wrapped, optimizer)
        want_weights = dict(hf_weights([chunk], args))
        if rank == 0:
            torch.save({"step": want, "weights": want_weights}, Path(save).parent / "second_step.pt")

        chunk, wrapped, optimizer, args = fresh(hf_dir)  # from the HF weights again, then resumed
        assert load_megatron_checkpoint(save, [chunk], optimizer)["iteration"] == 1
        got = step(wrapped, optimizer)
        assert got == want, (got, want)
        for name, value in dict(hf_weights([chunk], args)).items():
            assert torch.equal(value, want_weights[name]), name
        ps.destroy_model_parallel()
    dist.barrier()
    if rank == 0:  # the saved run, back to HF: the weights it had at iteration 1
        from safetensors.torch import load_file

        out = f"{save}_hf"
        assert main(["convert", "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", save,
                     "--save-dir", out, "--tokenizer-model", hf_dir]) == 0
        converted = {}
        for shard in sorted(Path(out).glob("**/*.safetensors")):  # the seed's convention: <save-dir>/mg2hf/
            converted.update(load_file(shard))
        assert sorted(converted) == sorted(saved), (set(converted) ^ set(saved))
        for name, value in saved.items():
            assert torch.equal(converted[name], value), name
    dist.barrier()


@pytest.mark.parametrize("tp,pp,fmt", [(2, 1, "torch_dist"), (1, 2, "torch_dist"), (2, 1, "torch")])
def test_a_saved_megatron_run_resumes_exactly_and_converts_back(tiny_hf, tmp_path, tp, pp, fmt):
    run_on_ranks(worker, str(tiny_hf("qwen2")), tp, pp, str(tmp_path / "ckpt"), fmt, out=tmp_path)
    if fmt == "torch_dist":  # the TP 2 checkpoint, resumed at PP 2
        run_on_ranks(resharded_worker, str(tiny_hf("qwen2")), 3 - tp, 3 - pp, str(tmp_path / "ckpt"),
                     out=tmp_path)


def resharded_worker(rank: int, hf_dir: str, tp: int, pp: int, save: str) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from posttrain.training.megatron.checkpoint import load_megatron_checkpoint
    from posttrain.training.megatron.cpu_shims import cpu_megatron
    from posttrain.training.megatron.engine import MegatronEngine
    from posttrain.training.megatron.model import hf_weights

    want = torch.load(Path(save).parent / "second_step.pt", weights_only=True)
    with cpu_megatron():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        model_parallel_cuda_manual_seed(7)
        chunk, wrapped, optimizer, args = fresh(hf_dir)
        assert load_megatron_checkpoint(save, [chunk], optimizer)["iteration"] == 1
        got = MegatronEngine(wrapped, optimizer, vocab_size=100).update(grpo_batch(hf_dir), loss_fn(),
                                                                         mini_batch_size=4)
        for key, value in want["step"][0].items():
            assert got[0][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
        for name, value in dict(hf_weights([chunk], args)).items():
            torch.testing.assert_close(value, want["weights"][name], rtol=0, atol=1e-5)
        ps.destroy_model_parallel()


def test_a_corrupt_shard_is_named_before_any_worker_starts(tiny_hf, tmp_path):
    """The megatron backend's reload check (checked_start): every rank file of the Megatron
    checkpoint in ``load`` is read before a model is built; a truncated one is named."""
    from posttrain.checkpoint import CheckpointLoad
    from posttrain.cli import main
    from posttrain.errors import CheckpointError
    from posttrain.rundir import checked_start

    mcore = tmp_path / "mcore"
    assert main(["convert", "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir",
                 str(tiny_hf("qwen2")), "--save-dir", str(mcore), "--target-tensor-parallel-size", "2"]) == 0
    load = CheckpointLoad(str(mcore), finetune=True)
    assert checked_start(str(mcore), load, megatron=True).source == str(mcore)
    shard = mcore / "release" / "mp_rank_01" / "model_optim_rng.pt"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="mp_rank_01/model_optim_rng.pt: not a readable torch checkpoint"):
        checked_start(str(mcore), load, megatron=True)
