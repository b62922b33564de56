"""Probe 3, the convert area: run one case by id (``python probe3_convert_cases.py V7d``), ``all``, or ``list``.

Each case builds what it needs under ``$PROBE_WORK`` (default ``/tmp/probe3_convert``; the tiny model
and the converted fixtures are built once there, by the code under test), runs ``posttrain convert``
in a subprocess with this interpreter and ``PYTHONPATH``, and prints the exit status, the last line
of stderr and what it found on disk afterwards. Give "before" and "after" runs their own
``PROBE_WORK``. I5 and CV45 mount a 64 MiB tmpfs (root only) and unmount it afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

WORK = Path(os.environ.get("PROBE_WORK", "/tmp/probe3_convert"))
PY = sys.executable
ENV = dict(os.environ, OMP_NUM_THREADS="1")
CASES: dict[str, tuple[str, object]] = {}


def case(cid: str, what: str):
    def register(fn):
        CASES[cid] = (what, fn)
        return fn
    return register


def posttrain(*argv: str, timeout: int = 600, limit_as: int | None = None) -> tuple[int, str]:
    def limits():
        if limit_as:
            import resource
            resource.setrlimit(resource.RLIMIT_AS, (limit_as, limit_as))
    p = subprocess.run([PY, "-m", "posttrain", *argv], env=ENV, capture_output=True, text=True, timeout=timeout,
                       preexec_fn=limits)
    return p.returncode, p.stderr + p.stdout


def convert(*argv: str, **kw) -> tuple[int, str]:
    return posttrain("convert", *argv, **kw)


def report(rc: int, out: str, **seen) -> None:
    lines = [ln for ln in out.splitlines() if ln.strip() and "Writing model shards" not in ln]
    err = [ln for ln in lines if ln.startswith(("error:", "Traceback")) or "Error" in ln.split(":")[0]]
    print(f"rc={rc}")
    print("message:", (err[-1] if err else lines[-1] if lines else "")[:400])
    for k, v in seen.items():
        print(f"{k}: {v}")


def model() -> Path:
    m = WORK / "model"
    if not (m / "config.json").is_file():
        rc, out = posttrain("init-model", "--model", "tiny_qwen2", "--output", str(m))
        assert rc == 0, out
    return m


def h2m(save: Path, *extra: str, **kw) -> tuple[int, str]:
    return convert("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(model()),
                   "--save-dir", str(save), *extra, **kw)


def m2h(load: Path, save: Path, *extra: str, **kw) -> tuple[int, str]:
    return convert("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(load),
                   "--save-dir", str(save), *extra, **kw)


def fixture(name: str, tp: int, pp: int) -> Path:
    d = WORK / "fix" / name
    if not (d / "latest_checkpointed_iteration.txt").is_file():
        shutil.rmtree(d, ignore_errors=True)
        rc, out = h2m(d, "--target-tensor-parallel-size", str(tp), "--target-pipeline-parallel-size", str(pp))
        assert rc == 0, out
    return d


def fresh(cid: str) -> Path:
    d = WORK / "c" / cid
    if d.is_mount():
        subprocess.run(["umount", str(d)], check=False)
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    return d


def copy_fixture(name: str, tp: int, pp: int, cid: str) -> Path:
    d = fresh(cid) / "mg"
    shutil.copytree(fixture(name, tp, pp), d)
    return d


def rank_file(root: Path, name: str) -> Path:
    return root / "release" / name / "model_optim_rng.pt"


def wrong_tensors(out: Path) -> str:
    from safetensors.torch import load_file
    f = out / "mg2hf" / "model.safetensors"
    if not f.is_file():
        return "no output"
    a, b = load_file(str(model() / "model.safetensors")), load_file(str(f))
    return f"{sum(not (a[k].shape == b[k].shape and (a[k] == b[k]).all().item()) for k in a)} of {len(a)} tensors differ"


def listing(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*")) if d.exists() else ["(absent)"]


def staging_left(d: Path) -> list[str]:
    return [p.name for p in d.iterdir() if p.name.startswith(".posttrain-convert-") or ".tmp-" in p.name] \
        if d.exists() else []


# ---- probe 2's cases -----------------------------------------------------------------------------

@case("V1c", "TP 0")
def v1c():
    d = fresh("V1c")
    report(*h2m(d / "mg", "--target-tensor-parallel-size", "0"), left=listing(d))


@case("V4b", "VPP 0 with PP 2")
def v4b():
    d = fresh("V4b")
    report(*h2m(d / "mg", "--target-pipeline-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "0"),
           left=listing(d)[:4])


@case("V7d", "a user file named release in the target, no tracker, no --force")
def v7d():
    d = fresh("V7d")
    (d / "release").write_text("my release notes\n")
    rc, out = h2m(d)
    report(rc, out, release_is=("user file kept" if (d / "release").is_file() else "replaced/gone"))


@case("V7e", "a user dir release/ with mine.txt, no tracker, no --force")
def v7e():
    d = fresh("V7e")
    (d / "release").mkdir()
    (d / "release" / "mine.txt").write_text("precious\n")
    rc, out = h2m(d)
    report(rc, out, mine_txt=("kept" if (d / "release" / "mine.txt").is_file() else "DELETED"))


def training_save_dir(cid: str) -> Path:
    """A posttrain training save dir: iter_0000001/, iter_0000002/ (HF checkpoints), tracker 2."""
    d = fresh(cid)
    for i in (1, 2):
        shutil.copytree(model(), d / f"iter_{i:07d}")
    (d / "latest_checkpointed_iteration.txt").write_text("2\n")
    return d


@case("V7f", "the target is a posttrain training save dir (iter_*, tracker 2)")
def v7f():
    d = training_save_dir("V7f")
    report(*h2m(d))


@case("V7h", "the same with --force; what a resume from it would find")
def v7h():
    d = training_save_dir("V7h")
    rc, out = h2m(d, "--force")
    report(rc, out, tracker=(d / "latest_checkpointed_iteration.txt").read_text().strip(),
           release=(d / "release").exists())


@case("V8b", "mg2hf/ holds model_backup.safetensors, a user index json, notes.txt; --force")
def v8b():
    d = fresh("V8b")
    (d / "mg2hf").mkdir()
    shutil.copy(model() / "model.safetensors", d / "mg2hf" / "model_backup.safetensors")
    (d / "mg2hf" / "model.safetensors.index.json").write_text('{"mine": true}')
    (d / "mg2hf" / "notes.txt").write_text("mine\n")
    rc, out = m2h(fixture("tp2pp2", 2, 2), d, "--force")
    report(rc, out, kept=sorted(p.name for p in (d / "mg2hf").iterdir()))


@case("V10b", "200 bytes flipped in the second half of a rank file")
def v10b():
    mg = copy_fixture("tp2pp2", 2, 2, "V10b")
    f = rank_file(mg, "mp_rank_01_001")
    data = bytearray(f.read_bytes())
    start = len(data) // 2
    for i in range(start, start + 200):
        data[i] ^= 0xFF
    f.write_bytes(bytes(data))
    rc, out = m2h(mg, mg.parent / "out")
    report(rc, out, result=wrong_tensors(mg.parent / "out"))


@case("V12a", "a TP 1 rank file in a TP 2 slot")
def v12a():
    mg = copy_fixture("tp2pp2", 2, 2, "V12a")
    shutil.copy(rank_file(fixture("tp1", 1, 1), "mp_rank_00"), rank_file(mg, "mp_rank_01_000"))
    rc, out = m2h(mg, mg.parent / "out")
    report(rc, out, result=wrong_tensors(mg.parent / "out"))


@case("V12b", "a TP 2 x PP 1 rank file in the TP 2 x PP 2 slot mp_rank_01_001")
def v12b():
    mg = copy_fixture("tp2pp2", 2, 2, "V12b")
    shutil.copy(rank_file(fixture("tp2pp1", 2, 1), "mp_rank_01"), rank_file(mg, "mp_rank_01_001"))
    rc, out = m2h(mg, mg.parent / "out")
    report(rc, out, result=wrong_tensors(mg.parent / "out"))


@case("V12e", "TP rank 0's shard copied over TP rank 1's")
def v12e():
    mg = copy_fixture("tp2pp2", 2, 2, "V12e")
    shutil.copy(rank_file(mg, "mp_rank_00_001"), rank_file(mg, "mp_rank_01_001"))
    rc, out = m2h(mg, mg.parent / "out")
    report(rc, out, result=wrong_tensors(mg.parent / "out"))


def model_copy(cid: str) -> Path:
    d = fresh(cid) / "model"
    shutil.copytree(model(), d)
    return d


def h2m_from(src: Path, save: Path, *extra: str) -> tuple[int, str]:
    return convert("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(src),
                   "--save-dir", str(save), *extra)


@case("V14d", "config.json truncated")
def v14d():
    m = model_copy("V14d")
    (m / "config.json").write_text('{"model_type": "qwen2",\n')
    report(*h2m_from(m, m.parent / "mg"))


@case("V17", "modes of convert's outputs (mg -> hf dir and weights, release/, --merge-lora dir)")
def v17():
    d = fresh("V17")
    m2h(fixture("tp2pp2", 2, 2), d)
    rc, out = h2m(d / "mg")
    lora = adapter("ok")
    posttrain("convert", "--load-model-type", "hf", "--save-model-type", "hf", "--merge-lora",
              "--load-dir", str(lora), "--save-dir", str(d / "merged"))

    def mode(p):
        return oct(p.stat().st_mode & 0o777) if p.exists() else "absent"
    report(rc, out, mg2hf=mode(d / "mg2hf"), mg2hf_weights=mode(d / "mg2hf" / "model.safetensors"),
           release=mode(d / "mg" / "release"), merged=mode(d / "merged"),
           merged_weights=mode(d / "merged" / "model.safetensors"))


def tmpfs(cid: str, free_mb: int) -> Path:
    d = fresh(cid) / "full"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(d)], check=True)
    subprocess.run(["dd", "if=/dev/zero", f"of={d}/filler", "bs=1M", f"count={64 - free_mb}"],
                   capture_output=True, check=False)
    return d


@case("I5", "hf -> mg onto a full disk (64 MiB tmpfs, 20 MiB free; the checkpoint is 38 MiB)")
def i5():
    d = tmpfs("I5", 20)
    try:
        rc, out = h2m(d / "mg")
        report(rc, out, left=[n for n in listing(d) if n != "filler"])
    finally:
        subprocess.run(["umount", str(d)], check=False)


@case("CV45", "mg -> hf onto a full disk (20 MiB free)")
def cv45():
    d = tmpfs("CV45", 20)
    try:
        rc, out = m2h(fixture("tp1", 1, 1), d / "hf")
        report(rc, out, left=[n for n in listing(d) if n != "filler"])
    finally:
        subprocess.run(["umount", str(d)], check=False)


def kill_during(argv: list[str], where: Path, pattern: str, sig: int, delay: float) -> int:
    p = subprocess.Popen([PY, "-m", "posttrain", "convert", *argv], env=ENV, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL,  # a background shell ignores SIGINT: give the child Python's
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    t0 = time.time()
    while time.time() - t0 < 120 and p.poll() is None:
        if where.exists() and any(where.glob(pattern)):
            time.sleep(delay)
            p.send_signal(sig)
            break
        time.sleep(0.01)
    return p.wait()


def kill_case(cid: str, sig: int, mg_to_hf: bool = False) -> None:
    d = fresh(cid)
    if mg_to_hf:
        argv = ["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(fixture("tp2pp2", 2, 2)),
                "--save-dir", str(d)]
    else:
        argv = ["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(model()), "--save-dir",
                str(d), "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2"]
    rc = kill_during(argv, d, ".*", sig, 0.0 if mg_to_hf else 0.05)
    after_kill = staging_left(d)
    rc2, out = convert(*argv)
    report(rc2, out, killed_rc=rc, staging_after_kill=after_kill, staging_after_rerun=staging_left(d),
           published=sorted(p.name for p in d.iterdir()))


@case("LO1", "SIGKILL mid hf -> mg, then a re-run")
def lo1():
    kill_case("LO1", signal.SIGKILL)


@case("LO2", "SIGTERM mid hf -> mg, then a re-run")
def lo2():
    kill_case("LO2", signal.SIGTERM)


@case("LO3", "a failed mg -> hf (a truncated rank file) into a new --save-dir")
def lo3():
    mg = copy_fixture("tp2pp2", 2, 2, "LO3")
    f = rank_file(mg, "mp_rank_01_001")
    f.write_bytes(f.read_bytes()[:300000])
    rc, out = m2h(mg, mg.parent / "newdir")
    report(rc, out, save_dir_exists=(mg.parent / "newdir").exists())


# ---- new cases -----------------------------------------------------------------------------------

@case("CV1", "TP 2**31")
def cv1():
    d = fresh("CV1")
    report(*h2m(d / "mg", "--target-tensor-parallel-size", str(2**31)), left=listing(d))


@case("CV2", "PP -3")
def cv2():
    d = fresh("CV2")
    report(*h2m(d / "mg", "--target-pipeline-parallel-size", "-3"), left=listing(d))


@case("CV3", "VPP -1 with PP 2")
def cv3():
    d = fresh("CV3")
    report(*h2m(d / "mg", "--target-pipeline-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "-1"),
           left=listing(d)[:3])


@case("CV4", "--make-vocab-size-divisible-by 1000000000 (6 GB address-space limit)")
def cv4():
    d = fresh("CV4")
    report(*h2m(d / "mg", "--make-vocab-size-divisible-by", "1000000000", limit_as=6 << 30), left=listing(d)[:3])


@case("CV5", "an odd vocabulary divisor (7) with TP 2: padding 300 -> 308, round trip")
def cv5():
    d = fresh("CV5")
    rc, out = h2m(d / "mg", "--make-vocab-size-divisible-by", "7", "--target-tensor-parallel-size", "2")
    rc2, out2 = m2h(d / "mg", d)
    report(rc2, out + out2, first_rc=rc, result=wrong_tensors(d))


@case("CV6", "--target-expert-model-parallel-size 0")
def cv6():
    d = fresh("CV6")
    report(*h2m(d / "mg", "--target-expert-model-parallel-size", "0"))


@case("CV7", "--num-layer-list 3,3 with mg -> hf (the split comes from the checkpoint)")
def cv7():
    d = fresh("CV7")
    report(*m2h(fixture("tp2pp2", 2, 2), d, "--num-layer-list", "3,3"), files=listing(d)[:2])


@case("CV8", "--orm with mg -> hf of a causal LM checkpoint")
def cv8():
    d = fresh("CV8")
    rc, out = m2h(fixture("tp1", 1, 1), d, "--orm")
    arch = json.loads((d / "mg2hf" / "config.json").read_text())["architectures"] if rc == 0 else "-"
    report(rc, out, architectures=arch)


@case("CV9", "--merge-lora with --params-dtype bf16")
def cv9():
    d = fresh("CV9")
    rc, out = posttrain("convert", "--load-model-type", "hf", "--save-model-type", "hf", "--merge-lora",
                        "--load-dir", str(adapter("ok")), "--save-dir", str(d / "merged"), "--params-dtype", "bf16")
    dtype = json.loads((d / "merged" / "config.json").read_text()).get("dtype", "?") if rc == 0 else "-"
    report(rc, out, merged_dtype=dtype)


@case("CV10", "mg -> hf with --tokenizer-model a directory holding no tokenizer files")
def cv10():
    d = fresh("CV10")
    (d / "tok").mkdir()
    (d / "tok" / "readme.txt").write_text("no tokenizer here\n")
    rc, out = m2h(fixture("tp1", 1, 1), d, "--tokenizer-model", str(d / "tok"))
    report(rc, out, files=listing(d / "mg2hf"))


@case("CV11", "hf -> mg with --save-dir = --load-dir")
def cv11():
    m = model_copy("CV11")
    report(*h2m_from(m, m), model_dir=sorted(p.name for p in m.iterdir()))


@case("CV12", "mg -> hf with --save-dir = --load-dir (the Megatron dir)")
def cv12():
    mg = copy_fixture("tp1", 1, 1, "CV12")
    report(*m2h(mg, mg), mg_dir=sorted(p.name for p in mg.iterdir()))


@case("CV13", "target release is a symlink to a user dir, no tracker, no --force")
def cv13():
    d = fresh("CV13")
    (d / "mine").mkdir()
    (d / "mine" / "data.txt").write_text("precious\n")
    os.symlink(d / "mine", d / "mg_release_link")
    (d / "t").mkdir()
    os.symlink(d / "mine", d / "t" / "release")
    rc, out = h2m(d / "t")
    report(rc, out, link=("kept" if (d / "t" / "release").is_symlink() else "gone"),
           data=("kept" if (d / "mine" / "data.txt").is_file() else "DELETED"))


@case("CV14", "mg2hf/ is a symlink to a user dir holding config.json and notes; --force")
def cv14():
    d = fresh("CV14")
    (d / "mine").mkdir()
    (d / "mine" / "config.json").write_text('{"mine": 1}')
    (d / "mine" / "notes.txt").write_text("mine\n")
    (d / "t").mkdir()
    os.symlink(d / "mine", d / "t" / "mg2hf")
    rc, out = m2h(fixture("tp1", 1, 1), d / "t", "--force")
    report(rc, out, user_config=(d / "mine" / "config.json").read_text()[:30])


@case("CV15", "a read-only target (read-only tmpfs)")
def cv15():
    d = fresh("CV15") / "ro"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,ro", "tmpfs", str(d)], check=True)
    try:
        report(*h2m(d / "mg"))
    finally:
        subprocess.run(["umount", str(d)], check=False)


@case("CV16", "--force over a release/ another tool wrote (no convert manifest)")
def cv16():
    mg = copy_fixture("tp1", 1, 1, "CV16")
    (mg / "release" / ".posttrain-convert.json").unlink(missing_ok=True)
    (mg / "release" / "their_notes.txt").write_text("written by megatron\n")
    rc, out = h2m(mg, "--force")
    report(rc, out, their_notes=("kept" if (mg / "release" / "their_notes.txt").is_file() else "DELETED"))


def tracker_case(cid: str, text: bytes) -> None:
    mg = copy_fixture("tp1", 1, 1, cid)
    (mg / "latest_checkpointed_iteration.txt").write_bytes(text)
    report(*m2h(mg, mg.parent / "out"))


@case("CV17", "tracker holds binary garbage")
def cv17():
    tracker_case("CV17", b"\x00\xffabc\n")


@case("CV18", "tracker names iteration 7, which is absent")
def cv18():
    tracker_case("CV18", b"7\n")


@case("CV19", "tracker is empty")
def cv19():
    tracker_case("CV19", b"")


@case("CV20", "the first rank file cut to half (its args are read first)")
def cv20():
    mg = copy_fixture("tp2pp2", 2, 2, "CV20")
    f = rank_file(mg, "mp_rank_00_000")
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    report(*m2h(mg, mg.parent / "out"))


@case("CV21", "a rank file replaced by a directory")
def cv21():
    mg = copy_fixture("tp2pp2", 2, 2, "CV21")
    f = rank_file(mg, "mp_rank_01_000")
    f.unlink()
    f.mkdir()
    report(*m2h(mg, mg.parent / "out"))


def planted(cid: str, how: str) -> None:
    import numpy as np
    import torch

    mg = copy_fixture("tp1", 1, 1, cid)
    flag = mg.parent / "PWNED"
    f = rank_file(mg, "mp_rank_00")

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {flag}",))

    d = torch.load(f, weights_only=False)
    if how == "numpy":
        arr = np.empty(1, dtype=object)
        arr[0] = Evil()
        d["args"].evil = arr
        torch.save(d, f)
    else:
        d["model"]["evil"] = Evil()
        torch.save(d, f, _use_new_zipfile_serialization=False)
    rc, out = m2h(mg, mg.parent / "out")
    report(rc, out, code_ran=flag.exists())


@case("CV22", "pickled code inside a numpy object array in args")
def cv22():
    planted("CV22", "numpy")


@case("CV23", "pickled code in a rank file saved in torch's legacy (non-zip) format")
def cv23():
    planted("CV23", "legacy")


@case("CV24", "SIGINT mid hf -> mg --force TP 2 x PP 2 over a complete TP 1 checkpoint")
def cv24():
    mg = copy_fixture("tp1", 1, 1, "CV24")
    before = rank_file(mg, "mp_rank_00").read_bytes()
    argv = ["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(model()), "--save-dir", str(mg),
            "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2", "--force"]
    rc = kill_during(argv, mg, ".posttrain-convert-*", signal.SIGINT, 0.05)
    report(rc, "", old_checkpoint=("intact" if rank_file(mg, "mp_rank_00").is_file()
                                   and rank_file(mg, "mp_rank_00").read_bytes() == before else "CHANGED"),
           staging=staging_left(mg), tracker=(mg / "latest_checkpointed_iteration.txt").read_text().strip())


@case("CV25", "SIGKILL mid mg -> hf, then a re-run")
def cv25():
    kill_case("CV25", signal.SIGKILL, mg_to_hf=True)


@case("CV26", "two hf -> mg conversions into one --save-dir at once")
def cv26():
    d = fresh("CV26")
    argv = ["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(model()), "--save-dir", str(d)]
    ps = [subprocess.Popen([PY, "-m", "posttrain", "convert", *argv, *extra], env=ENV, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
          for extra in ([], ["--target-tensor-parallel-size", "2"])]
    outs = [(p.wait(), p.stdout.read()) for p in ps]
    rc, out = m2h(d, d)
    report(rc, out, runs=[o[0] for o in outs], result=wrong_tensors(d), staging=staging_left(d))


@case("CV27", "mg -> hf with a whole pipeline stage missing")
def cv27():
    mg = copy_fixture("tp2pp2", 2, 2, "CV27")
    for n in ("mp_rank_00_001", "mp_rank_01_001"):
        shutil.rmtree(mg / "release" / n)
    report(*m2h(mg, mg.parent / "out"))


@case("CV28", "mg -> hf of a posttrain training save dir (HF iter_*)")
def cv28():
    d = training_save_dir("CV28")
    report(*m2h(d, d.parent / "out"))


@case("CV29", "a model dir without tokenizer files: hf -> mg -> hf into a new dir")
def cv29():
    m = model_copy("CV29")
    for n in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (m / n).unlink(missing_ok=True)
    rc, out = h2m_from(m, m.parent / "mg")
    rc2, out2 = m2h(m.parent / "mg", m.parent / "hf")
    report(rc2, out + out2, first_rc=rc, files=listing(m.parent / "hf" / "mg2hf"))


def bad_config(cid: str, text: str) -> None:
    m = model_copy(cid)
    (m / "config.json").write_text(text)
    report(*h2m_from(m, m.parent / "mg"), left=listing(m.parent / "mg")[:2])


@case("CV30", "config.json zero bytes")
def cv30():
    bad_config("CV30", "")


@case("CV31", "config.json is a JSON list")
def cv31():
    bad_config("CV31", "[1, 2, 3]\n")


@case("CV32", "config.json num_hidden_layers \"six\"")
def cv32():
    cfg = json.loads((model() / "config.json").read_text())
    cfg["num_hidden_layers"] = "six"
    bad_config("CV32", json.dumps(cfg))


@case("CV33", "model.safetensors: one q_proj weight with half its rows")
def cv33():
    import torch
    from safetensors.torch import load_file, save_file

    m = model_copy("CV33")
    t = load_file(str(m / "model.safetensors"))
    name = "model.layers.1.self_attn.q_proj.weight"
    t[name] = t[name][: t[name].shape[0] // 2].clone()
    save_file(t, str(m / "model.safetensors"), metadata={"format": "pt"})
    del torch
    report(*h2m_from(m, m.parent / "mg", "--target-tensor-parallel-size", "2"), left=listing(m.parent / "mg")[:2])


@case("CV34", "TP rank files swapped (mp_rank_00_000 <-> mp_rank_01_000)")
def cv34():
    mg = copy_fixture("tp2pp2", 2, 2, "CV34")
    a, b = rank_file(mg, "mp_rank_00_000"), rank_file(mg, "mp_rank_01_000")
    tmp = a.with_suffix(".swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)
    rc, out = m2h(mg, mg.parent / "out")
    report(rc, out, result=wrong_tensors(mg.parent / "out"))


@case("CV35", "mg2hf/ holds the user's own config.json (no manifest); --force")
def cv35():
    d = fresh("CV35")
    (d / "mg2hf").mkdir()
    (d / "mg2hf" / "config.json").write_text('{"mine": 1}\n')
    rc, out = m2h(fixture("tp1", 1, 1), d, "--force")
    report(rc, out, user_config=(d / "mg2hf" / "config.json").read_text()[:20])


@case("CV36", "--force over convert's own mg2hf/ (a user notes.txt beside it)")
def cv36():
    d = fresh("CV36")
    m2h(fixture("tp1", 1, 1), d)
    (d / "mg2hf" / "notes.txt").write_text("mine\n")
    rc, out = m2h(fixture("tp2pp2", 2, 2), d, "--force")
    report(rc, out, files=sorted(p.name for p in (d / "mg2hf").iterdir()), result=wrong_tensors(d))


@case("CV37", "--save-dir under a file (model/config.json/sub)")
def cv37():
    m = model_copy("CV37")
    report(*h2m(m / "config.json" / "sub"))


@case("CV38", "a rank file with one tensor missing (the key deleted)")
def cv38():
    import torch

    mg = copy_fixture("tp2pp2", 2, 2, "CV38")
    f = rank_file(mg, "mp_rank_01_001")
    d = torch.load(f, weights_only=False)
    d["model"].pop("decoder.layers.1.mlp.linear_fc2.weight")
    torch.save(d, f)
    report(*m2h(mg, mg.parent / "out"))


@case("CV39", "a stale staging dir of a dead run (pid 999999) in the target; hf -> mg --force")
def cv39():
    mg = copy_fixture("tp1", 1, 1, "CV39")
    stale = mg / ".posttrain-convert-mg-dead"
    stale.mkdir()
    (stale / ".posttrain-convert-staging").write_text("999999\n")
    (stale / "junk.bin").write_bytes(b"x" * 1000)
    user = mg / ".posttrain-convert-notmine"  # the name only, no marker: not convert's
    user.mkdir()
    rc, out = h2m(mg, "--force")
    report(rc, out, stale=stale.exists(), unmarked_kept=user.exists())


def adapter(kind: str) -> Path:
    """A LoRA adapter dir (r 8, q_proj and v_proj, random B) on the tiny model; ``kind`` tampers it."""
    d = WORK / "lora" / kind
    if (d / "adapter_config.json").is_file():
        return d
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model()))
    peft = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    peft.save_pretrained(str(d))
    cfg_path = d / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = str(model())
    if kind == "rank":
        cfg["r"] = 16
    elif kind == "targets":
        cfg["target_modules"] = ["k_proj"]
    elif kind == "otherbase":
        other = WORK / "lora" / "other_base"
        if not (other / "config.json").is_file():
            yaml = WORK / "lora" / "tiny_wide.yaml"  # tiny_qwen2 with hidden size 192
            yaml.write_text(Path("configs/model/tiny_qwen2.yaml").read_text().replace("tiny_qwen2:", "tiny_wide:")
                            .replace("hidden_size: 384", "hidden_size: 192"))
            rc, out = posttrain("init-model", "--model", str(yaml), "--output", str(other))
            assert rc == 0, out
        cfg["base_model_name_or_path"] = str(other)
    cfg_path.write_text(json.dumps(cfg) if kind != "badjson" else '{"r": 8,')
    return d


def merge_case(cid: str, kind: str) -> None:
    d = fresh(cid)
    rc, out = posttrain("convert", "--load-model-type", "hf", "--save-model-type", "hf", "--merge-lora",
                        "--load-dir", str(adapter(kind)), "--save-dir", str(d / "merged"))
    changed = "-"
    if rc == 0:
        from safetensors.torch import load_file
        a, b = load_file(str(model() / "model.safetensors")), load_file(str(d / "merged" / "model.safetensors"))
        changed = sorted({k.split(".")[-2] for k in a if k in b and not (a[k] == b[k]).all().item()})
    report(rc, out, modules_changed_by_merge=changed, left=listing(d))


@case("CV40", "--merge-lora of a good adapter (q_proj, v_proj)")
def cv40():
    merge_case("CV40", "ok")


@case("CV41", "--merge-lora: adapter_config.json says r 16, the weights are r 8")
def cv41():
    merge_case("CV41", "rank")


@case("CV42", "--merge-lora: adapter_config.json says target k_proj, the weights are q_proj/v_proj")
def cv42():
    merge_case("CV42", "targets")


@case("CV43", "--merge-lora: the adapter's base names another model (hidden size 192, not 384)")
def cv43():
    merge_case("CV43", "otherbase")


@case("CV44", "--merge-lora: adapter_config.json truncated")
def cv44():
    merge_case("CV44", "badjson")


@case("CV46", "--merge-lora --force into a copy of the base model dir (probe 2's V16c)")
def cv46():
    d = fresh("CV46")
    shutil.copytree(model(), d / "basecopy")
    (d / "basecopy" / "notes.txt").write_text("mine\n")
    rc, out = posttrain("convert", "--load-model-type", "hf", "--save-model-type", "hf", "--merge-lora",
                        "--load-dir", str(adapter("ok")), "--save-dir", str(d / "basecopy"), "--force")
    from safetensors.torch import load_file
    same = all((a == b).all().item() for a, b in zip(load_file(str(model() / "model.safetensors")).values(),
                                                      load_file(str(d / "basecopy" / "model.safetensors")).values()))
    report(rc, out, base_copy_weights=("unchanged" if same else "overwritten by the merge"))


@case("CV47", "hf -> mg with --tokenizer-model (the seed's command passes it)")
def cv47():
    d = fresh("CV47")
    report(*h2m(d / "mg", "--tokenizer-model", str(model() / "tokenizer.json")))


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "list"
    if which == "list":
        for cid, (what, _) in CASES.items():
            print(f"{cid}\t{what}")
        sys.exit(0)
    for cid in (CASES if which == "all" else which.split(",")):
        what, fn = CASES[cid]
        print(f"=== {cid}: {what}")
        fn()
        sys.stdout.flush()
