"""`posttrain convert` under hostile input (issue 35, docs/reliability/probe3_convert.md): sizes,
targets it must not delete, damaged or misplaced rank files, a full disk, killed runs' leftovers.

Each test's docstring starts with the probe case ids it guards. One TP 2 x PP 2 checkpoint is
converted per module and copied by the tests that damage it.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.cli import main
from posttrain.models.mcore import mcore_files, targets

MG_TO_HF = ["convert", "--load-model-type", "mg", "--save-model-type", "hf"]
HF_TO_MG = ["convert", "--load-model-type", "hf", "--save-model-type", "mg"]


@pytest.fixture(scope="module")
def ckpts(tiny_hf, tmp_path_factory):
    """``{"hf": model dir, "tp2pp2": ..., "tp1": ...}``, converted once (read-only: copy to damage)."""
    root = tmp_path_factory.mktemp("convert_ckpts")
    hf = tiny_hf("qwen2")
    out = {"hf": hf}
    for name, tp, pp in (("tp2pp2", 2, 2), ("tp1", 1, 1)):
        assert main([*HF_TO_MG, "--load-dir", str(hf), "--save-dir", str(root / name), "--target-tensor-parallel-size",
                     str(tp), "--target-pipeline-parallel-size", str(pp)]) == 0
        out[name] = root / name
    return out


def refused(capsys, argv, pattern):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert re.search(pattern, err), err
    assert "Traceback" not in err
    return err


def copy_of(ckpts, name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(ckpts[name], dst)
    return dst


def rank_file(root: Path, name: str) -> Path:
    return root / "release" / name / mcore_files.RANK_FILE


def hf_to_mg(ckpts, save: Path, *extra: str) -> list[str]:
    return [*HF_TO_MG, "--load-dir", str(ckpts["hf"]), "--save-dir", str(save), *extra]


def staged(path: Path) -> list[str]:
    return [p.name for p in path.rglob(f"{targets.STAGING_PREFIX}*")] if path.exists() else []


# ---- sizes -------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags,pattern", [
    (["--target-tensor-parallel-size", "0"], "--target-tensor-parallel-size must be a positive integer, found 0"),
    (["--target-pipeline-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "0"],
     "--num-layers-per-virtual-pipeline-stage must be a positive integer, found 0"),
    (["--target-pipeline-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "-1"],
     "--num-layers-per-virtual-pipeline-stage must be a positive integer, found -1"),
    (["--make-vocab-size-divisible-by", "1000000000"], "pads the vocabulary of 100 tokens to 1000000000 rows"),
    (["--target-tensor-parallel-size", str(2**31)], "tensor parallel size 2147483648 does not divide the model's 4"),
])
def test_sizes_below_one_or_absurd_are_refused_by_flag(ckpts, tmp_path, capsys, flags, pattern):
    """Probe V1c, V4b, CV3, CV4, CV1: TP 0 (was ZeroDivisionError), VPP 0 (was written as plain PP 2),
    VPP -1, a divisor that pads the vocabulary to 10^9 rows (was an allocator traceback), TP 2^31:
    refused by flag, nothing written."""
    refused(capsys, hf_to_mg(ckpts, tmp_path / "mg", *flags), pattern)
    assert not (tmp_path / "mg").exists()


# ---- the --save-dir of hf -> mg ------------------------------------------------------------------

@pytest.mark.parametrize("force", [False, True])
def test_a_user_release_file_or_dir_in_the_target_is_never_deleted(ckpts, tmp_path, capsys, force):
    """Probe V7d, V7e, CV13, CV16: a user file named release, a user release/ dir, a link named release,
    a release/ another tool wrote (no convert manifest): refused without --force and with it;
    nothing of it is deleted."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "release").write_text("mine")
    (tmp_path / "b" / "release").mkdir(parents=True)
    (tmp_path / "b" / "release" / "mine.txt").write_text("precious")
    extra = ["--force"] if force else []
    refused(capsys, hf_to_mg(ckpts, tmp_path / "a", *extra), "a file .*/a/release that posttrain convert did not write")
    refused(capsys, hf_to_mg(ckpts, tmp_path / "b", *extra), "a directory .*/b/release that posttrain convert did not")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "release").symlink_to(tmp_path / "b" / "release")
    refused(capsys, hf_to_mg(ckpts, tmp_path / "c", *extra), "a link .*/c/release that posttrain convert did not")
    assert (tmp_path / "c" / "release").is_symlink()
    assert (tmp_path / "a" / "release").read_text() == "mine"
    assert (tmp_path / "b" / "release" / "mine.txt").read_text() == "precious"
    other = copy_of(ckpts, "tp1", tmp_path)
    (other / "release" / targets.MANIFEST).unlink()
    refused(capsys, hf_to_mg(ckpts, other, "--force"), "no .posttrain-convert.json in it.*Move .*release away")
    assert rank_file(other, "mp_rank_00").is_file()
    assert staged(tmp_path) == []


@pytest.mark.parametrize("force", [False, True])
def test_a_training_save_dir_is_named_as_such_and_never_converted_into(ckpts, tmp_path, capsys, force):
    """Probe V7f, V7h: a posttrain training save dir (HF iter_*, tracker 2) is called what it is, and
    refused even with --force: convert's release/ and tracker would make a resume start from the
    converted base instead of iteration 2."""
    save = tmp_path / "run"
    for i in (1, 2):
        shutil.copytree(ckpts["hf"], save / f"iter_{i:07d}")
    (save / mcore_files.TRACKER).write_text("2\n")
    refused(capsys, hf_to_mg(ckpts, save, *(["--force"] if force else [])),
            r"holds posttrain training checkpoints \(HF format\) \(iter_0000001, iter_0000002; tracker '2'\).*"
            r"--force does not override")
    assert (save / mcore_files.TRACKER).read_text() == "2\n" and not (save / "release").exists()


def test_the_hf_directory_itself_is_refused_as_the_save_dir(ckpts, tmp_path, capsys):
    """Probe CV11: --save-dir = --load-dir would make the HF model dir load as a Megatron checkpoint."""
    model = tmp_path / "model"
    shutil.copytree(ckpts["hf"], model)
    refused(capsys, [*HF_TO_MG, "--load-dir", str(model), "--save-dir", str(model)], "--save-dir .* is the --load-dir")
    assert not (model / "release").exists()


# ---- the mg2hf/ target -----------------------------------------------------------------------------

def test_force_replaces_only_files_convert_wrote_in_mg2hf(ckpts, tmp_path, capsys):
    """Probe V8b, CV35, CV36: --force into an mg2hf/ holding the user's model_backup.safetensors, an
    index json or config.json is refused naming the file, and nothing is deleted; over convert's own
    output (its manifest) --force replaces it and keeps the user's notes."""
    out = tmp_path / "save" / "mg2hf"
    out.mkdir(parents=True)
    user = {"model_backup.safetensors": "w", "model.safetensors.index.json": "{}", "notes.txt": "n"}
    for name, text in user.items():
        (out / name).write_text(text)
    argv = [*MG_TO_HF, "--load-dir", str(ckpts["tp1"]), "--save-dir", str(out.parent), "--force"]
    refused(capsys, argv, "model.safetensors.index.json was not written by posttrain convert")
    assert {p.name: p.read_text() for p in out.iterdir()} == user
    (out / "model.safetensors.index.json").unlink()
    assert main(argv) == 0  # model_backup.safetensors is not a name convert writes: kept
    (out / "notes.txt").write_text("mine")
    assert main([*MG_TO_HF, "--load-dir", str(ckpts["tp2pp2"]), "--save-dir", str(out.parent), "--force"]) == 0
    assert (out / "notes.txt").read_text() == "mine" and (out / "model_backup.safetensors").read_text() == "w"
    assert targets.read_manifest(out) >= {"config.json", "model.safetensors"}
    (out / targets.MANIFEST).unlink()  # the user's own copy of the output now: nothing is convert's
    refused(capsys, argv, "config.json was not written by posttrain convert")


def test_convert_outputs_are_readable_by_all(ckpts, tmp_path):
    """Probe V17: the mg -> hf dir is 0755 and its files 0644 (they were 0700 and 0600), as are release/'s."""
    old = os.umask(0o022)
    try:
        assert main([*MG_TO_HF, "--load-dir", str(ckpts["tp1"]), "--save-dir", str(tmp_path)]) == 0
    finally:
        os.umask(old)
    out = tmp_path / "mg2hf"
    assert out.stat().st_mode & 0o777 == 0o755
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == {p.name: 0o644 for p in out.iterdir()}
    assert (ckpts["tp1"] / "release").stat().st_mode & 0o777 == 0o755


# ---- damaged or misplaced rank files ----------------------------------------------------------------

def test_flipped_bytes_in_a_rank_file_are_found_by_the_zip_crc(ckpts, tmp_path, capsys):
    """Probe V10b: 200 flipped bytes in the second half of a rank file were converted silently; the
    zip CRC names the damaged member, and a failed mg -> hf leaves no --save-dir behind (LO3)."""
    mg = copy_of(ckpts, "tp2pp2", tmp_path)
    f = rank_file(mg, "mp_rank_01_001")
    data = bytearray(f.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 200] = bytes(b ^ 0xFF for b in data[mid:mid + 200])
    f.write_bytes(bytes(data))
    refused(capsys, [*MG_TO_HF, "--load-dir", str(mg), "--save-dir", str(tmp_path / "new")],
            r"mp_rank_01_001/model_optim_rng.pt: the member .*data/\d+ fails its CRC check")
    assert not (tmp_path / "new").exists()


def _swap(a: Path, b: Path) -> None:
    tmp = a.with_suffix(".swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


@pytest.mark.parametrize("case,pattern", [
    ("V12a", r"mp_rank_01_000/model_optim_rng.pt: its args say tensor_model_parallel_size = 1 but"),
    ("V12b", r"mp_rank_01_001/model_optim_rng.pt: its args say pipeline_model_parallel_size = 1 but"),
    ("V12e", r"mp_rank_01_001/model_optim_rng.pt: it holds the shard of TP rank 0, PP rank 1 but sits in the slot"),
    ("V12e-foreign", r"mp_rank_01_001/model_optim_rng.pt is a copy of .*mp_rank_00_001"),
    ("CV34", r"mp_rank_00_000/model_optim_rng.pt: it holds the shard of TP rank 1, PP rank 0"),
    ("layers", r"mp_rank_01_001/model_optim_rng.pt: its 'model' holds 4 layers but pipeline stage 1 .* has 2"),
    ("shapes", r"mp_rank_01_000/model_optim_rng.pt: decoder.layers.0.mlp.linear_fc2.weight has shape \(64, 128\) but"),
])
def test_a_rank_file_that_does_not_belong_in_its_slot_is_refused(ckpts, tmp_path, capsys, case, pattern):
    """Probe V12a, V12b, V12e, CV34: a TP 1 file in a TP 2 slot (was a traceback), a TP 2 x PP 1 file
    in a PP 2 slot, TP rank 0's shard copied over rank 1's (with and without convert's slot record),
    two TP ranks swapped (were all converted with wrong tensors); the same with only the layer count
    or one shard's shape wrong."""
    mg = copy_of(ckpts, "tp2pp2", tmp_path)
    if case == "V12a":
        shutil.copy(rank_file(ckpts["tp1"], "mp_rank_00"), rank_file(mg, "mp_rank_01_000"))
    elif case == "CV34":
        _swap(rank_file(mg, "mp_rank_00_000"), rank_file(mg, "mp_rank_01_000"))
    else:
        src, dst = rank_file(mg, "mp_rank_00_001"), rank_file(mg, "mp_rank_01_001")
        obj = torch.load(src, weights_only=False)
        if case == "V12b":
            obj["args"].pipeline_model_parallel_size = 1
        elif case == "V12e-foreign":  # a Megatron-made file: no slot record, so the CRCs tell
            obj.pop(mcore_files.SLOT_KEY)
            torch.save(obj, src)
        elif case == "layers":
            obj = torch.load(dst, weights_only=False)
            for k in [k for k in obj["model"] if k.startswith("decoder.layers.1.")]:
                obj["model"][k.replace("layers.1.", "layers.3.")] = obj["model"][k]
                obj["model"][k.replace("layers.1.", "layers.2.")] = obj["model"][k]
        elif case == "shapes":
            src, dst = rank_file(mg, "mp_rank_01_000"), rank_file(mg, "mp_rank_01_000")
            obj = torch.load(src, weights_only=False)
            w = obj["model"]["decoder.layers.0.mlp.linear_fc2.weight"]
            obj["model"]["decoder.layers.0.mlp.linear_fc2.weight"] = torch.cat([w, w], dim=1)
        torch.save(obj, dst)
    refused(capsys, [*MG_TO_HF, "--load-dir", str(mg), "--save-dir", str(tmp_path / "out")], pattern)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text,pattern", [('{"model_type": "qwen2",\n', r"not valid JSON \(line 2, column 1"),
                                          ("", r"not valid JSON \(line 1, column 1"),
                                          ("[1, 2]", "expected a JSON object of model settings, found list")])
def test_a_broken_config_json_is_named(ckpts, tmp_path, capsys, text, pattern):
    """Probe V14d, CV30, CV31: a truncated, empty or non-object config.json (was a JSONDecodeError traceback)."""
    model = tmp_path / "model"
    shutil.copytree(ckpts["hf"], model)
    (model / "config.json").write_text(text)
    refused(capsys, [*HF_TO_MG, "--load-dir", str(model), "--save-dir", str(tmp_path / "mg")],
            re.escape(str(model / "config.json")) + ": " + pattern)


# ---- full disk, read-only target, killed runs ------------------------------------------------------

def test_a_full_disk_is_one_message_and_leaves_nothing(ckpts, tmp_path, capsys, monkeypatch):
    """Probe I5, CV45: the disk fills during hf -> mg (torch.save's RuntimeError) or mg -> hf (an
    ENOSPC OSError): one message saying so, and the target, created by the run, is gone; too little
    free space up front is refused before any work, with the bytes needed."""
    import posttrain.models.mcore.convert as conv
    import posttrain.models.mcore.hf_files as hf_files

    def full_torch_save(obj, path, *a, **k):
        Path(path).write_bytes(b"x" * 1000)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")

    def full_save_file(tensors, path, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(conv.torch, "save", full_torch_save)
    refused(capsys, hf_to_mg(ckpts, tmp_path / "full" / "mg"), r"the disk is full: writing .*/full/mg ran out of space")
    assert not (tmp_path / "full").exists()
    monkeypatch.setattr(hf_files, "save_file", full_save_file)
    refused(capsys, [*MG_TO_HF, "--load-dir", str(ckpts["tp1"]), "--save-dir", str(tmp_path / "hf")],
            r"the disk is full: writing .*/hf/mg2hf ran out of space")
    assert not (tmp_path / "hf").exists()
    monkeypatch.setattr(targets, "_free_bytes", lambda path: 1000)
    refused(capsys, hf_to_mg(ckpts, tmp_path / "mg"), r"needs about \d+\.\d MiB but only 0\.0 MiB are free")


def test_an_unwritable_target_is_one_message(ckpts, tmp_path, capsys, monkeypatch):
    """Probe CV15: a read-only target (EROFS from mkdir; a read-only mount said so before the free
    space is checked, which named a full disk) is one message naming the directory."""
    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(targets.tempfile, "mkdtemp", read_only)
    refused(capsys, hf_to_mg(ckpts, tmp_path / "mg"), r"cannot write in .*/mg .*Read-only file system")
    assert not (tmp_path / "mg").exists()
    monkeypatch.setattr(targets.os, "access", lambda path, mode: False)  # checked before the free space
    refused(capsys, hf_to_mg(ckpts, tmp_path / "mg"), r"cannot write in .* \(a read-only file system, or no write")


def test_a_dead_runs_staging_dir_is_removed_by_the_next_run(ckpts, tmp_path):
    """Probe LO1, LO2, CV25, CV39: a SIGKILL'd run's staging dir (name and marker with a dead pid) is
    removed by the next conversion into the same place; a dir of that name without the marker, or a
    live process's, is kept. SIGTERM ends convert as Ctrl-C does, so its own staging goes too."""
    mg = copy_of(ckpts, "tp1", tmp_path)
    dead, unmarked, live = (mg / f"{targets.STAGING_PREFIX}{n}" for n in ("mg-dead", "mine", "mg-live"))
    for d in (dead, unmarked, live):
        d.mkdir()
    (dead / targets.STAGING_MARKER).write_text("999999999\n")
    (live / targets.STAGING_MARKER).write_text(f"{os.getppid()}\n")
    before = signal.getsignal(signal.SIGTERM)
    assert main(hf_to_mg(ckpts, mg, "--force")) == 0
    assert not dead.exists() and unmarked.exists() and live.exists()
    assert signal.getsignal(signal.SIGTERM) is before  # the caller's SIGTERM handling is back
    from posttrain.commands.convert import _sigterm_as_interrupt

    try:
        with _sigterm_as_interrupt(), pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, before)


# ---- flags the mode does not use -------------------------------------------------------------------

@pytest.mark.parametrize("argv,pattern", [
    ([*MG_TO_HF, "--num-layer-list", "3,3"], "--num-layer-list 3,3: mg -> hf reads the split"),
    ([*MG_TO_HF, "--num-layers-per-virtual-pipeline-stage", "1"], "--num-layers-per-virtual-pipeline-stage 1: mg -> hf"),
    (["convert", "--load-model-type", "hf", "--save-model-type", "hf", "--merge-lora", "--params-dtype", "bf16"],
     "--params-dtype bf16: --merge-lora writes the merged model in its base's layout and dtype"),
])
def test_a_flag_the_conversion_does_not_use_is_refused(tmp_path, capsys, argv, pattern):
    """Probe CV7, CV9: --num-layer-list with mg -> hf and --params-dtype with --merge-lora were accepted and ignored."""
    refused(capsys, [*argv, "--load-dir", str(tmp_path / "x"), "--save-dir", str(tmp_path / "y")], pattern)


def test_orm_and_an_empty_tokenizer_dir_are_refused_for_mg_to_hf(ckpts, tmp_path, capsys):
    """Probe CV8, CV10: --orm on a causal LM checkpoint, and a --tokenizer-model dir holding no
    tokenizer file, were accepted and ignored (a causal LM written, no tokenizer copied)."""
    base = [*MG_TO_HF, "--load-dir", str(ckpts["tp1"])]
    refused(capsys, [*base, "--save-dir", str(tmp_path / "a"), "--orm"], "--orm: .* is not a reward model")
    (tmp_path / "tok").mkdir()
    refused(capsys, [*base, "--save-dir", str(tmp_path / "b"), "--tokenizer-model", str(tmp_path / "tok")],
            "--tokenizer-model .*/tok holds none of the tokenizer files")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    weights = load_file(ckpts["hf"] / "model.safetensors")
    assert weights  # the fixture model is intact


def test_hf_weights_that_do_not_match_config_json_are_refused(ckpts, tmp_path, capsys):
    """Probe CV33: a q_proj weight with half its rows was split and written with exit 0."""
    from safetensors.torch import save_file

    model = tmp_path / "model"
    shutil.copytree(ckpts["hf"], model)
    weights = load_file(model / "model.safetensors")
    name = "model.layers.1.self_attn.q_proj.weight"
    weights[name] = weights[name][: weights[name].shape[0] // 2].clone()
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    refused(capsys, [*HF_TO_MG, "--load-dir", str(model), "--save-dir", str(tmp_path / "mg")],
            rf"{name} has shape \(32, 64\) but config.json describes \(64, 64\)")
    assert not (tmp_path / "mg").exists()


def test_a_directory_in_place_of_a_rank_file_is_called_one(ckpts, tmp_path, capsys):
    """Probe CV21: it was reported as a missing file."""
    mg = copy_of(ckpts, "tp2pp2", tmp_path)
    rank_file(mg, "mp_rank_01_000").unlink()
    rank_file(mg, "mp_rank_01_000").mkdir()
    refused(capsys, [*MG_TO_HF, "--load-dir", str(mg), "--save-dir", str(tmp_path / "out")],
            "mp_rank_01_000/model_optim_rng.pt is a directory, not a rank file")


def test_a_save_dir_under_a_file_is_one_message(ckpts, tmp_path, capsys):
    """Probe CV37: --save-dir model/config.json/sub was a NotADirectoryError traceback."""
    (tmp_path / "file").write_text("x")
    refused(capsys, hf_to_mg(ckpts, tmp_path / "file" / "sub"), r"cannot create .*/file/sub \(Not a directory")
    assert (tmp_path / "file").read_text() == "x"


@pytest.mark.parametrize("config,pattern", [
    ('{"r": 8,', r"adapter_config.json: not valid JSON \(line 1, column 9"),
    ('{"r": 8, "target_modules": ["k_proj"]}', r"target_modules \['k_proj'\] but adapter_model.safetensors holds "
                                               r"LoRA weights for \['q_proj'\], which would not be merged"),
])
def test_merge_lora_refuses_an_adapter_whose_config_is_broken_or_does_not_match_its_weights(tmp_path, capsys,
                                                                                           config, pattern):
    """Probe CV44, CV42: a truncated adapter_config.json was a JSONDecodeError traceback; a config that
    targets k_proj over q_proj weights merged nothing, with exit 0."""
    from safetensors.torch import save_file

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(config)
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 4)},
              str(adapter / "adapter_model.safetensors"))
    refused(capsys, ["convert", "--load-model-type", "hf", "--save-model-type", "hf", "--merge-lora", "--load-dir",
                     str(adapter), "--save-dir", str(tmp_path / "merged")], pattern)
    assert not (tmp_path / "merged").exists()


def test_a_megatron_lora_checkpoint_is_merged_not_converted(ckpts, tmp_path, capsys):
    """A megatron-backend LoRA run's checkpoint (its Megatron files the frozen base, its adapter in
    adapter_model.safetensors): a plain mg -> hf conversion would export the base alone; refused,
    naming --merge-lora."""
    root = copy_of(ckpts, "tp1", tmp_path)
    (root / "release" / "adapter_config.json").write_text("{}")
    refused(capsys, ["convert", "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(root),
                     "--save-dir", str(tmp_path / "hf")],
            r"holds a LoRA run .* posttrain convert --merge-lora --load-dir")
    assert not (tmp_path / "hf").exists()
