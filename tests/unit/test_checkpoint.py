"""Checkpoints: atomic save, exact resume (weights, optimizer, scheduler, RNG), seed resume flags."""

import errno
import os
import random
import stat

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from posttrain import checkpoint as ckpt
from posttrain.errors import CheckpointError
from tests.helpers.runs import run_cli, tree

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matmuls: ~40x slower with 2 threads on a loaded 2-core box

IDS = torch.tensor([[1, 5, 9, 13, 2, 7], [3, 3, 8, 60, 1, 0]])


def tiny(seed=0, tie=False, hidden=32):
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2,
                                        num_key_value_heads=1, intermediate_size=64, vocab_size=64,
                                        tie_word_embeddings=tie))


def optim(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def train(model, opt, sched, steps):
    for _ in range(steps):
        model(input_ids=IDS, labels=IDS).loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()


def draws(gen):
    return (random.random(), float(np.random.rand()), torch.rand(3).tolist(),
            torch.rand(2, generator=gen).tolist())


def scramble_rng(gen):
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    gen.manual_seed(99)


def same_params(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture
def trained():
    model = tiny(0)
    opt, sched = optim(model)
    train(model, opt, sched, 2)
    return model, opt, sched


def test_round_trip_restores_everything_exactly(tmp_path, trained):
    from posttrain.models.init_model import train_tokenizer

    model, opt, sched = trained
    # the tokenizer as a user loads it from a model directory (transformers picks the class from
    # config.json, so load it that way rather than comparing with the in-memory trained one)
    train_tokenizer(["What is 1 + 2? <answer>3</answer>"] * 20, vocab_size=300).save_pretrained(tmp_path / "src")
    model.save_pretrained(tmp_path / "src")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "src"))
    gen = torch.Generator().manual_seed(5)
    gen_before = torch.rand(4, generator=gen)  # advance the stream before saving
    perm = torch.randperm(10)
    path = ckpt.save_checkpoint(tmp_path / "save", 2, model, opt, sched, tokenizer=tok, generator=gen,
                                sampler_state={"epoch": 1, "perm": perm},
                                trainer_state={"consumed_samples": 8, "kl_coef": 0.0125})
    assert path == tmp_path / "save" / "iter_0000002"
    assert (tmp_path / "save" / "latest_checkpointed_iteration.txt").read_text() == "2\n"
    expected = draws(gen)

    other = tiny(1)
    opt2, sched2 = optim(other)
    gen2 = torch.Generator()
    scramble_rng(gen2)
    assert not same_params(model, other)
    state = ckpt.load_checkpoint(tmp_path / "save", other, opt2, sched2, generator=gen2)

    assert draws(gen2) == expected and gen_before.numel() == 4
    assert same_params(model, other)
    assert state["iteration"] == 2 and state["consumed_samples"] == 8 and state["kl_coef"] == 0.0125
    assert state["sampler_state"]["epoch"] == 1 and torch.equal(state["sampler_state"]["perm"], perm)
    assert sched2.last_epoch == sched.last_epoch == 2
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])
    for p, q in zip(model.parameters(), other.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], opt2.state[q][key])
    # one more step on each stays identical (moments and schedule really restored)
    train(model, opt, sched, 1)
    train(other, opt2, sched2, 1)
    assert same_params(model, other)

    # the iter dir is a Hugging Face model directory
    hf = AutoModelForCausalLM.from_pretrained(str(path))
    hf_tok = AutoTokenizer.from_pretrained(str(path))
    assert hf_tok.encode("What is 1 + 2?") == tok.encode("What is 1 + 2?")
    assert hf_tok.get_vocab() == tok.get_vocab() and hf_tok.chat_template == tok.chat_template
    ref = tiny(1)
    ckpt.load_weights(path, ref)
    with torch.no_grad():
        assert torch.equal(hf(input_ids=IDS).logits, ref(input_ids=IDS).logits)


def test_disk_full_leaves_previous_checkpoint_and_tracker(tmp_path, trained, monkeypatch):
    model, opt, sched = trained
    save = tmp_path / "save"
    ckpt.save_checkpoint(save, 1, model, opt, sched, trainer_state={"consumed_samples": 4})

    def full(obj, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr("posttrain.checkpoint.save._torch_save", full)
    train(model, opt, sched, 1)
    with pytest.raises(CheckpointError, match=r"iteration 2 .*No space left on device.*iter_0000001 is intact"):
        ckpt.save_checkpoint(save, 2, model, opt, sched, trainer_state={"consumed_samples": 8})
    assert sorted(os.listdir(save)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "1\n"
    monkeypatch.undo()
    state = ckpt.load_checkpoint(save, tiny(3), *optim(tiny(3)), no_load_optim=True)
    assert state["iteration"] == 1 and state["consumed_samples"] == 4


def test_torch_zip_writer_running_out_of_space_says_the_disk_is_full(tmp_path, trained, monkeypatch):
    """Probe ISAVE: torch's zip writer reports a full disk as RuntimeError "unexpected pos": the message
    says the disk is full, and the previous checkpoint and the tracker are kept."""
    model, opt, sched = trained
    save = tmp_path / "save"
    ckpt.save_checkpoint(save, 1, model, opt, sched)

    def full(obj, path):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 14115136 vs 14115024")

    monkeypatch.setattr("posttrain.checkpoint.save._torch_save", full)
    with pytest.raises(CheckpointError, match=r"iteration 2 .*failed: the disk is full .*iter_0000001 is intact"):
        ckpt.save_checkpoint(save, 2, model, opt, sched)
    assert sorted(os.listdir(save)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]


def test_tracker_write_failure_rolls_back_the_new_directory(tmp_path, trained, monkeypatch):
    model, opt, sched = trained
    save = tmp_path / "save"
    ckpt.save_checkpoint(save, 1, model, opt, sched, trainer_state={"tag": "old"})

    def broken(save_dir, iteration):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("posttrain.checkpoint.save._write_tracker", broken)
    with pytest.raises(CheckpointError):
        ckpt.save_checkpoint(save, 2, model, opt, sched)
    with pytest.raises(CheckpointError):          # re-saving an existing iteration restores the old one
        ckpt.save_checkpoint(save, 1, model, opt, sched, trainer_state={"tag": "new"})
    assert sorted(os.listdir(save)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    assert '"tag": "old"' in (save / "iter_0000001" / "trainer_state.json").read_text()


def test_finetune_loads_weights_only(tmp_path, trained):
    model, opt, sched = trained
    ckpt.save_checkpoint(tmp_path, 7, model, opt, sched, trainer_state={"consumed_samples": 28})
    other = tiny(1)
    opt2, sched2 = optim(other)
    state = ckpt.load_checkpoint(tmp_path, other, opt2, sched2, finetune=True)
    assert state["iteration"] == 0 and state["consumed_samples"] == 0 and state["sampler_state"] is None
    assert same_params(model, other)
    assert len(opt2.state) == 0 and sched2.last_epoch == 0


def test_no_load_optim_and_no_load_rng(tmp_path, trained):
    model, opt, sched = trained
    gen = torch.Generator().manual_seed(1)
    ckpt.save_checkpoint(tmp_path, 3, model, opt, sched, generator=gen)
    expected = draws(gen)
    other = tiny(1)
    opt2, sched2 = optim(other)
    gen2 = torch.Generator()
    scramble_rng(gen2)
    state = ckpt.load_checkpoint(tmp_path, other, opt2, sched2, no_load_optim=True,
                                 no_load_rng=True, generator=gen2)
    assert state["iteration"] == 3 and same_params(model, other)
    assert len(opt2.state) == 0 and sched2.last_epoch == 0
    assert draws(gen2) != expected


def test_save_without_optim_then_resume_says_what_to_do(tmp_path, trained):
    model, opt, sched = trained
    ckpt.save_checkpoint(tmp_path, 1, model, opt, sched, save_optim=False, save_rng=False)
    with pytest.raises(CheckpointError, match="no_load_optim: true"):
        ckpt.load_checkpoint(tmp_path, tiny(1), *optim(tiny(1)))
    with pytest.raises(CheckpointError, match="no_load_rng: true"):
        ckpt.load_checkpoint(tmp_path, tiny(1), None, None, no_load_optim=False)


def test_plain_hf_directory_and_tied_weights(tmp_path):
    model = tiny(0, tie=True)
    model.save_pretrained(tmp_path / "hf")
    other = tiny(1, tie=True)
    state = ckpt.load_checkpoint(tmp_path / "hf", other)
    assert state["iteration"] == 0 and same_params(model, other)
    assert other.lm_head.weight.data_ptr() == other.model.embed_tokens.weight.data_ptr()


def test_load_errors(tmp_path, trained):
    model, opt, sched = trained
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint in .*empty"):
        ckpt.load_checkpoint(tmp_path / "empty", model)
    ckpt.save_checkpoint(tmp_path / "s", 1, model)
    with pytest.raises(CheckpointError, match="shape"):
        ckpt.load_checkpoint(tmp_path / "s", tiny(0, hidden=16), finetune=True)
    (tmp_path / "s" / "latest_checkpointed_iteration.txt").write_text("9\n")
    with pytest.raises(CheckpointError, match="names iteration 9"):
        ckpt.find_latest(tmp_path / "s")


def test_resolve_checkpoint_for_every_kind_of_model_path(tmp_path, trained):
    """Save dir -> its latest iter_*; iter_* -> itself; HF dir -> itself (weights only). Model
    loading (models.loading.load_causal_lm, posttrain eval) goes through the same function."""
    from posttrain.models.loading import load_causal_lm

    model, _, _ = trained
    for it in (1, 2):
        ckpt.save_checkpoint(tmp_path / "s", it, model, save_rng=False)
    assert ckpt.resolve_checkpoint(tmp_path / "s") == (tmp_path / "s" / "iter_0000002", True)
    assert ckpt.resolve_checkpoint(tmp_path / "s" / "iter_0000001") == (tmp_path / "s" / "iter_0000001", True)
    assert ckpt.is_hf_model_dir(tmp_path / "s" / "iter_0000002") and not ckpt.is_hf_model_dir(tmp_path / "s")
    model.save_pretrained(tmp_path / "hf")
    assert ckpt.resolve_checkpoint(tmp_path / "hf") == (tmp_path / "hf", False)
    assert same_params(model, load_causal_lm(tmp_path / "s"))
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "m.gguf").write_bytes(b"")
    with pytest.raises(CheckpointError, match="GGUF file"):
        ckpt.resolve_checkpoint(tmp_path / "gguf")


def test_find_latest_keep_last_and_iteration_dir(tmp_path, trained):
    model, _, _ = trained
    for it in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, it, model, keep_last=2, save_rng=False)
    assert [p.name for _, p in ckpt.list_checkpoints(tmp_path)] == ["iter_0000002", "iter_0000003"]
    assert ckpt.find_latest(tmp_path).name == "iter_0000003"
    (tmp_path / "latest_checkpointed_iteration.txt").unlink()
    assert ckpt.find_latest(tmp_path).name == "iter_0000003"
    state = ckpt.load_checkpoint(tmp_path / "iter_0000002", tiny(1), no_load_rng=True)
    assert state["iteration"] == 2


def test_extra_part_round_trip(tmp_path, trained):
    model, opt, sched = trained
    critic = tiny(4)
    copt, csched = optim(critic)
    train(critic, copt, csched, 1)
    ckpt.save_checkpoint(tmp_path, 1, model, opt, sched, extra={"critic": ckpt.Part(critic, copt, csched)})
    critic2 = tiny(5)
    copt2, csched2 = optim(critic2)
    ckpt.load_checkpoint(tmp_path, tiny(6), no_load_rng=True,
                         extra={"critic": ckpt.Part(critic2, copt2, csched2)})
    assert same_params(critic, critic2) and csched2.last_epoch == 1


# ---- files a user can read, and a symlink never followed (the reliability probe) -------------------
def test_model_and_checkpoint_files_are_readable(tmp_path, capsys, mini_world):
    """Probe O15: the modes of init-model's and a checkpoint's files under umask 022."""
    from transformers import AutoModelForCausalLM

    from posttrain.checkpoint import save_checkpoint

    old = os.umask(0o022)
    try:
        assert run_cli(["init-model", "--output", str(tmp_path / "m")], capsys)[0] == 0
        model = AutoModelForCausalLM.from_pretrained(mini_world / "model")
        save_checkpoint(tmp_path / "ckpt", 1, model)
    finally:
        os.umask(old)
    for root in (tmp_path / "m", tmp_path / "ckpt" / "iter_0000001"):
        assert stat.S_IMODE(root.stat().st_mode) == 0o755, root
        for f in root.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o644, f


def test_moved_aside_symlink_is_removed_and_its_target_kept(mini_world, tmp_path):
    """Probe O13: the iter_* directory a save replaces is a symlink to a user's directory."""
    from transformers import AutoModelForCausalLM

    from posttrain.checkpoint import save_checkpoint

    user = tmp_path / "userdir"
    user.mkdir()
    (user / "f.txt").write_text("mine")
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / "iter_0000001").symlink_to(user, target_is_directory=True)
    save_checkpoint(save, 1, AutoModelForCausalLM.from_pretrained(mini_world / "model"))
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    assert not (save / "iter_0000001").is_symlink()
    assert tree(user) == ["f.txt"]
