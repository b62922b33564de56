"""Two gloo ranks with DDP take the same step as one process with the whole mini-batch.

The model is a small pure-torch LM (no transformers import) to keep the three processes cheap.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

MODEL_AND_BATCH = textwrap.dedent(
    """
    import torch

    class TinyLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.tok = torch.nn.Embedding(16, 8)
            self.pos = torch.nn.Embedding(16, 8)
            self.head = torch.nn.Linear(8, 16)

        def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
            hidden = torch.tanh(self.tok(input_ids) + self.pos(position_ids)).cumsum(1)  # causal mix
            return self.head(hidden)

    def make_batch():
        g = torch.Generator().manual_seed(0)
        lens = torch.tensor([3, 1, 2, 3, 1, 3, 2, 2])
        mask = (torch.arange(3)[None] < lens[:, None]).float()
        ids = torch.randint(1, 16, (8, 5), generator=g)
        ids[:, 2:] *= mask.long()
        return {
            "input_ids": ids,
            "attention_mask": torch.cat([torch.ones(8, 2), mask], 1).long(),
            "response_mask": mask,
            "old_logprobs": -torch.rand(8, 3, generator=g) * mask,
            "advantages": torch.randn(8, 1, generator=g) * mask,
        }
    """
)

SCRIPT = MODEL_AND_BATCH + textwrap.dedent(
    """
    import datetime, os, sys
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from posttrain.training.engine import TrainEngine
    from posttrain.training.loss_fns import make_actor_loss_fn

    def worker(rank, out):
        # A file store: no port to collide on, and no rank owns a TCP server the other may outlive.
        # a bounded wait: a rank that never arrives fails the run instead of hanging it
        dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=120))
        model = TinyLM()
        mine = {k: v[rank * 4 : rank * 4 + 4] for k, v in make_batch().items()}
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        engine = TrainEngine(ddp, torch.optim.SGD(ddp.parameters(), lr=0.5), clip_grad=0.0, micro_batch_size=3)
        metrics = engine.update(mine, make_actor_loss_fn(), mini_batch_size=4)[0]
        if rank == 0:
            torch.save({"params": [p.detach() for p in model.parameters()], "metrics": metrics}, out)
        dist.barrier()
        # leave without gloo's teardown: once in the suite a rank hung past this barrier, at its exit
        os._exit(0)

    if __name__ == "__main__":
        mp.spawn(worker, args=(sys.argv[1],), nprocs=2)
    """
)


@pytest.mark.slow
def test_ddp_two_ranks_match_single_process(tmp_path):
    from posttrain.training.engine import TrainEngine
    from posttrain.training.loss_fns import make_actor_loss_fn

    script = tmp_path / "ddp.py"
    script.write_text(SCRIPT)
    out = tmp_path / "rank0.pt"
    store = tmp_path / "store"
    # gloo over loopback: the host name may resolve to an address the container cannot reach
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script), str(out), str(store)], env=env, capture_output=True,
                          text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ddp = torch.load(out)

    scope: dict = {}
    exec(MODEL_AND_BATCH, scope)  # the same model and batch, in this process
    model = scope["TinyLM"]()
    engine = TrainEngine(model, torch.optim.SGD(model.parameters(), lr=0.5), clip_grad=0.0, micro_batch_size=8)
    single = engine.update(scope["make_batch"](), make_actor_loss_fn(), mini_batch_size=8)[0]
    moved = max((p - q).abs().max().item() for p, q in zip(model.parameters(), scope["TinyLM"]().parameters()))
    assert moved > 1e-3  # the step did something
    for a, b in zip(model.parameters(), ddp["params"]):
        assert torch.allclose(a, b, atol=1e-6)
    for key in ("actor/pg_loss", "actor/entropy", "actor/ppo_kl", "actor/grad_norm"):
        assert ddp["metrics"][key] == pytest.approx(single[key], rel=1e-4, abs=1e-6)
