"""Probe 3, the runs area (docs/reliability/probe3_runs.md): one case by id.

    python docs/reliability/probe3_runs_cases.py <id>      # runs the case, prints what it saw
    python docs/reliability/probe3_runs_cases.py list      # the ids and what each does

Environment: ``PROBE_DIR`` the probe's world (default /tmp/pr: ``probe/model``, ``probe/data/rl``,
``probe/cfg/grpo.yaml``, made as docs/reliability/probe3_runs.md's setup says); ``PROBE_SRC`` the
``src`` directory of the code under test (default this checkout's: "after"; the code at e292964
exported to a directory: "before"). Reference runs are made once per code under test, in
``probe/ref-<tag>/``; each case works on copies in ``probe/k-<tag>/<id>/``. The disk-full cases
mount a tmpfs (root) at ``/tmp/full_runs`` and unmount it afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]
WORLD = Path(os.environ.get("PROBE_DIR", "/tmp/pr"))
SRC = Path(os.environ.get("PROBE_SRC", HERE / "src")).resolve()
TAG = "after" if SRC == (HERE / "src").resolve() else "before-" + hashlib.sha1(str(SRC).encode()).hexdigest()[:6]
PY = os.environ.get("PROBE_PYTHON", sys.executable)
REF, K = WORLD / "probe" / f"ref-{TAG}", WORLD / "probe" / f"k-{TAG}"
FULL = Path("/tmp/full_runs") / TAG  # a tmpfs mounted here by the disk-full cases
MG = ["rl_config.actor_resource.num_npus=2", "actor_config.tensor_model_parallel_size=2"]
ASYNC, PR = ["rl_config.async_staleness=1"], ["rl_config.partial_rollout_max_split=2"]
CASES: dict[str, tuple[str, object]] = {}


def case(cid: str, what: str):
    def register(fn):
        CASES[cid] = (what, fn)
        return fn
    return register


# ---- running posttrain ---------------------------------------------------------------------------------
def env() -> dict:
    # the fp32 linear kernel pinned: else each fresh run times its own (probe 2's E6), and two fresh runs
    # may differ at rounding level; a resume takes its checkpoint's
    return {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "POSTTRAIN_CPU_LINEAR": "blas"}


def train_argv(name: str, *overrides: str, root: Path | None = None) -> list[str]:
    root = root or K
    return [PY, "-m", "posttrain", "train", "--config-path", str(WORLD / "probe/cfg"), "--config-name", "grpo",
            f"actor_config.save={root / name / 'ckpt'}", f"rl_config.output_dir={root / name / 'out'}", *overrides]


def run(argv: list[str], timeout: int = 900) -> tuple[int, str]:
    p = subprocess.run(argv, cwd=WORLD, env=env(), capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def G(name: str, *overrides: str, flags: tuple[str, ...] = (), root: Path | None = None) -> tuple[int, str]:
    return run(train_argv(name, *overrides, root=root) + list(flags))


def show(rc: int, out: str) -> None:
    """The exit status, whether a traceback was printed, and the error (or last) lines."""
    lines = [line for line in out.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(("error:", "Traceback", "WARNING posttrain", "warning:"))
              or "Error" in line.split(":")[0]]
    print(f"rc={rc} traceback={'Traceback' in out}")
    for line in (errors or lines)[-6:]:
        print("  |", line[:700])


def ref(name: str, *overrides: str) -> Path:
    """A reference run made once (its checkpoints in ``ckpt``, logs in ``out``)."""
    done = REF / name / "done"
    if not done.exists():
        shutil.rmtree(REF / name, ignore_errors=True)
        rc, out = G(name, *overrides, root=REF)
        assert rc == 0, out[-3000:]
        done.write_text("ok")
    return REF / name


def copy_ckpt(src: Path, cid: str) -> Path:
    """A copy of ``src``'s checkpoints (without the lock file) to damage: ``k-<tag>/<cid>/ckpt``."""
    dest = K / cid
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(src / "ckpt", dest / "ckpt", ignore=shutil.ignore_patterns(".posttrain.lock"))
    return dest / "ckpt"


def metrics(out_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["iteration"]: {k: v for k, v in r.items() if not (k.startswith("timing/") or k == "time" or k.endswith("tps"))}
            for r in rows}


def weights(ckpt_iter: Path):
    from safetensors.torch import load_file
    return load_file(str(ckpt_iter / "model.safetensors"))


def same_run(a_out: Path, b_out: Path, a_iter: Path | None = None, b_iter: Path | None = None) -> str:
    ma, mb = metrics(a_out), metrics(b_out)
    diff = [it for it in ma if ma.get(it) != mb.get(it)]
    text = f"metrics iterations {sorted(mb)} vs {sorted(ma)}; differing: {diff}"
    if a_iter is not None and b_iter is not None:
        wa, wb = weights(a_iter), weights(b_iter)
        worst = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
        text += f"; final weights max abs diff {worst}"
    return text


def resume(cid: str, load: Path, *overrides: str, flags: tuple[str, ...] = ()) -> tuple[int, str]:
    if not str(load).startswith(str(K / cid) + "/"):  # a fresh save dir for a resume from another case's copy
        shutil.rmtree(K / cid, ignore_errors=True)
    return G(cid, f"actor_config.load={load}", "actor_config.finetune=false", *overrides, flags=flags)


def killed_run(cid: str, lines: int, *overrides: str, sig=signal.SIGKILL) -> int:
    """Start ``train`` and send ``sig`` once its metrics.jsonl has ``lines`` lines."""
    shutil.rmtree(K / cid, ignore_errors=True)
    p = subprocess.Popen(train_argv(cid, *overrides), cwd=WORLD, env=env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    log = K / cid / "out" / "metrics.jsonl"
    while p.poll() is None:
        if log.exists() and len(log.read_text().splitlines()) >= lines:
            p.send_signal(sig)
            break
        time.sleep(0.05)
    return p.wait()


def kill_during_save(cid: str, pattern: str, delay: float, *overrides: str) -> int:
    """Start ``train`` and SIGKILL it ``delay`` s after a path matching ``pattern`` appears in its save dir."""
    shutil.rmtree(K / cid, ignore_errors=True)
    p = subprocess.Popen(train_argv(cid, *overrides), cwd=WORLD, env=env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    save = K / cid / "ckpt"
    while p.poll() is None:
        if save.is_dir() and any(save.glob(pattern)):
            time.sleep(delay)
            os.killpg(p.pid, signal.SIGKILL)
            break
        time.sleep(0.01)
    return p.wait()


def payload_ran(marker: str) -> None:
    print(f"payload ran: {(WORLD / f'{marker}-{TAG}').exists()}")


def truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def tracker(ckpt: Path) -> str:
    t = ckpt / "latest_checkpointed_iteration.txt"
    return t.read_text().strip() if t.exists() else "-"


MOUNTED = []


def mount_full(size: str = "64m") -> None:
    umount_full()
    MOUNTED.append(FULL)
    FULL.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(FULL)], check=True)


def fill_full(leave_kb: int = 0) -> None:
    subprocess.run(["dd", "if=/dev/zero", f"of={FULL / 'filler'}", "bs=1M"], capture_output=True)
    subprocess.run(["dd", "if=/dev/zero", f"of={FULL / 'filler2'}", "bs=4k"], capture_output=True)
    if leave_kb:
        truncate(FULL / "filler", max(0, (FULL / "filler").stat().st_size - leave_kb * 1024))


def umount_full() -> None:
    if MOUNTED and FULL.is_dir() and os.path.ismount(FULL):
        subprocess.run(["umount", str(FULL)], check=True)


# ---- probe 2's cases of this area -----------------------------------------------------------------------
def async_ref() -> Path:
    return ref("ka", "megatron_training.train_iters=4", "megatron_training.save_interval=2", *ASYNC)


def partial_ref() -> Path:
    return ref("kp", "megatron_training.train_iters=3", "megatron_training.save_interval=1", *PR)


def mg_ref() -> Path:
    return ref("mg", *MG, "megatron_training.train_iters=3", "megatron_training.save_interval=1")


@case("KN1", "async checkpoint, in_flight.pt cut to 20000 bytes; resume (then with --load-previous-on-corruption)")
def kn1():
    ck = copy_ckpt(async_ref(), "KN1")
    truncate(ck / "iter_0000004/in_flight.pt", 20000)
    show(*resume("KN1", ck, "megatron_training.train_iters=5", *ASYNC))
    show(*resume("KN1b", ck, "megatron_training.train_iters=5", *ASYNC, flags=("--load-previous-on-corruption",)))


@case("KN2", "in_flight.pt with an os.system payload; resume")
def kn2():
    ck = copy_ckpt(async_ref(), "KN2")
    _plant(ck / "iter_0000002/in_flight.pt", "PWNED_inflight", key=99)
    show(*resume("KN2", ck / "iter_0000002", "megatron_training.train_iters=4", *ASYNC))
    payload_ran("PWNED_inflight")


def _plant(path: Path, marker: str, key) -> None:
    """Add an os.system payload under ``key`` to the dict saved in ``path``."""
    import torch

    marker = f"{marker}-{TAG}"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {WORLD / marker}",))
    (WORLD / marker).unlink(missing_ok=True)
    d = torch.load(path, weights_only=False)
    d[key] = Evil()
    torch.save(d, path)


@case("KN3", "async checkpoint with in_flight.pt deleted; resume")
def kn3():
    ck = copy_ckpt(async_ref(), "KN3")
    (ck / "iter_0000002/in_flight.pt").unlink()
    show(*resume("KN3", ck / "iter_0000002", "megatron_training.train_iters=4", *ASYNC))


@case("KN4", "partial_rollout.pt with an os.system payload; resume")
def kn4():
    ck = copy_ckpt(partial_ref(), "KN4")
    _plant(ck / "iter_0000001/partial_rollout.pt", "PWNED_partial", key="_probe")
    show(*resume("KN4", ck / "iter_0000001", "megatron_training.train_iters=3", "megatron_training.save_interval=1",
                 *PR))
    payload_ran("PWNED_partial")


@case("E2b", "the async (k=1) checkpoint resumed synchronously (no async_staleness)")
def e2b():
    ck = copy_ckpt(async_ref(), "E2b")
    show(*resume("E2b", ck / "iter_0000002", "megatron_training.train_iters=4"))


def _mg_damaged(cid: str, damage) -> Path:
    ck = copy_ckpt(mg_ref(), cid)
    damage(ck / "iter_0000003")
    return ck


@case("F13a", "megatron TP 2: the latest shard __1_1.distcp cut to 100 KB; resume")
def f13a():
    ck = _mg_damaged("F13a", lambda d: truncate(d / "__1_1.distcp", 100_000))
    show(*resume("F13a", ck, *MG, "megatron_training.train_iters=4", "megatron_training.save_interval=1"))


@case("F13b", "F13a with --load-previous-on-corruption")
def f13b():
    ck = _mg_damaged("F13b", lambda d: truncate(d / "__1_1.distcp", 100_000))
    rc, out = resume("F13b", ck, *MG, "megatron_training.train_iters=4", "megatron_training.save_interval=1",
                     flags=("--load-previous-on-corruption",))
    show(rc, out)
    print("metrics iterations:", sorted(metrics(K / "F13b/out")) if (K / "F13b/out/metrics.jsonl").exists() else "-")


@case("F14", "megatron: common.pt = 'garbage', with --load-previous-on-corruption")
def f14():
    ck = _mg_damaged("F14", lambda d: (d / "common.pt").write_text("garbage"))
    show(*resume("F14", ck, *MG, "megatron_training.train_iters=4", "megatron_training.save_interval=1",
                 flags=("--load-previous-on-corruption",)))


@case("I3", "output_dir on a full disk (tmpfs)")
def i3():
    mount_full()
    fill_full()
    rc, out = G("I3", "megatron_training.train_iters=2", f"rl_config.output_dir={FULL / 'out3'}")
    show(rc, out)
    print("left in the full disk:", sorted(p.name for p in FULL.iterdir()))


@case("I8", "20 KB free: metrics.jsonl fills the disk mid-run; then free space and resume")
def i8():
    mount_full()
    fill_full(leave_kb=20)  # the lock file, config.json, run.json and a few metric lines
    shutil.rmtree(K / "I8", ignore_errors=True)
    rc, out = G("I8", "megatron_training.train_iters=12", f"rl_config.output_dir={FULL / 'out8'}")
    show(rc, out)
    text = (FULL / "out8/metrics.jsonl").read_bytes()
    ends = text.endswith(b"\n")
    print(f"metrics.jsonl {len(text)} bytes, ends with newline: {ends}, "
          f"lines: {len(text.splitlines())}; tracker {tracker(K / 'I8/ckpt')}")
    (FULL / "filler").unlink()
    rc, out = G("I8", "megatron_training.train_iters=12", f"rl_config.output_dir={FULL / 'out8'}",
                f"actor_config.load={K / 'I8/ckpt'}", "actor_config.finetune=false")
    show(rc, out)
    print("after resume, iterations:", sorted(metrics(FULL / "out8")))


@case("ISAVE", "the save on a full disk (hf): the previous checkpoint intact, tracker unchanged, resumable")
def isave():
    mount_full("160m")
    shutil.rmtree(K / "ISAVE", ignore_errors=True)
    rc, out = run(train_argv("ISAVE", "megatron_training.train_iters=4", root=FULL))
    show(rc, out)
    ck = FULL / "ISAVE/ckpt"
    print("tracker", tracker(ck), "entries", sorted(p.name for p in ck.iterdir()))
    rc, out = G("ISAVE2", "megatron_training.train_iters=4", f"actor_config.load={ck}", "actor_config.finetune=false")
    show(rc, out)


@case("LEFT", "a refused train (save dir in use by another run) leaves no new output dir or lock file")
def left():
    d = K / "LEFT"
    shutil.rmtree(d, ignore_errors=True)
    (d / "ckpt").mkdir(parents=True)
    import fcntl
    with open(d / "ckpt/.posttrain.lock", "w") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        show(*G("LEFT", f"rl_config.output_dir={d / 'new/out'}"))
    print("after:", sorted(str(p.relative_to(d)) for p in d.rglob("*")))


# ---- new cases (RN) ------------------------------------------------------------------------------------------
def _kill_resume(cid: str, lines: int, iters: int, save: int, *mode: str) -> None:
    """SIGKILL a run at ``lines`` metric lines, resume it in place, compare with an uninterrupted run."""
    base = ref(f"full{cid}", f"megatron_training.train_iters={iters}", f"megatron_training.save_interval={save}", *mode)
    rc = killed_run(cid, lines, f"megatron_training.train_iters={iters}", f"megatron_training.save_interval={save}",
                    *mode)
    print(f"killed: rc={rc}, tracker {tracker(K / cid / 'ckpt')}")
    rc, out = resume(cid, K / cid / "ckpt", f"megatron_training.train_iters={iters}",
                     f"megatron_training.save_interval={save}", *mode)
    show(rc, out)
    last = f"iter_{iters:07d}"
    print(same_run(base / "out", K / cid / "out", base / "ckpt" / last, K / cid / "ckpt" / last))


@case("RN1", "sync: SIGKILL at 3 metric lines (save every 2, 6 iterations), resume: same metrics and weights?")
def rn1():
    _kill_resume("RN1", 3, 6, 2)


@case("RN2", "async_staleness=1: SIGKILL at 3 lines, resume: same metrics and weights?")
def rn2():
    _kill_resume("RN2", 3, 6, 2, *ASYNC)


@case("RN3", "partial rollout (max_split 2): SIGKILL at 3 lines, resume: same metrics and weights?")
def rn3():
    _kill_resume("RN3", 3, 6, 2, *PR)


@case("RN4", "hf backend: SIGKILL 0.2 s after the save of iteration 2 starts (.iter_0000002.tmp-*), resume")
def rn4():
    base = ref("fullRN4", "megatron_training.train_iters=3")
    rc = kill_during_save("RN4", ".iter_0000002.tmp*", 0.2, "megatron_training.train_iters=3")
    ck = K / "RN4/ckpt"
    print(f"killed rc={rc}; tracker {tracker(ck)}; entries {sorted(p.name for p in ck.iterdir())}")
    rc, out = resume("RN4", ck, "megatron_training.train_iters=3")
    show(rc, out)
    print("temps left:", sorted(p.name for p in ck.glob(".iter_*")))
    print(same_run(base / "out", K / "RN4/out", base / "ckpt/iter_0000003", ck / "iter_0000003"))


@case("RN5", "megatron TP 2: SIGKILL 0.3 s after .iter_0000002.tmp appears, resume")
def rn5():
    rc = kill_during_save("RN5", ".iter_0000002.tmp", 0.3, *MG, "megatron_training.train_iters=3",
                          "megatron_training.save_interval=1")
    ck = K / "RN5/ckpt"
    print(f"killed rc={rc}; tracker {tracker(ck)}; entries {sorted(p.name for p in ck.iterdir())}")
    show(*resume("RN5", ck, *MG, "megatron_training.train_iters=3", "megatron_training.save_interval=1"))
    print("tracker after:", tracker(ck), sorted(p.name for p in ck.iterdir()))


@case("RN6", "the async (k=1) checkpoint resumed with async_staleness=2")
def rn6():
    ck = copy_ckpt(async_ref(), "RN6")
    show(*resume("RN6", ck / "iter_0000002", "megatron_training.train_iters=4", "rl_config.async_staleness=2"))


@case("RN7", "the partial-rollout checkpoint resumed without partial rollout")
def rn7():
    ck = copy_ckpt(partial_ref(), "RN7")
    show(*resume("RN7", ck / "iter_0000001", "megatron_training.train_iters=3"))


@case("RN8", "the partial-rollout (max_split 2) checkpoint resumed with max_split 4")
def rn8():
    ck = copy_ckpt(partial_ref(), "RN8")
    show(*resume("RN8", ck / "iter_0000001", "megatron_training.train_iters=3",
                 "rl_config.partial_rollout_max_split=4"))


@case("RN9", "partial_rollout.pt deleted, resume with the same setting")
def rn9():
    ck = copy_ckpt(partial_ref(), "RN9")
    (ck / "iter_0000003/partial_rollout.pt").unlink()
    show(*resume("RN9", ck, "megatron_training.train_iters=4", *PR))


@case("RN10", "partial_rollout.pt cut to 3000 bytes, resume (then --load-previous-on-corruption)")
def rn10():
    ck = copy_ckpt(partial_ref(), "RN10")
    truncate(ck / "iter_0000003/partial_rollout.pt", 3000)
    show(*resume("RN10", ck, "megatron_training.train_iters=4", *PR))
    show(*resume("RN10b", ck, "megatron_training.train_iters=4", *PR, flags=("--load-previous-on-corruption",)))


@case("RN11", "the synchronous checkpoint resumed with async_staleness=1 (a deliberate switch)")
def rn11():
    ck = copy_ckpt(ref("sync3", "megatron_training.train_iters=2"), "RN11")
    show(*resume("RN11", ck, "megatron_training.train_iters=3", *ASYNC))


@case("RN12", "in_flight.pt replaced by a valid torch file holding a tensor")
def rn12():
    import torch
    ck = copy_ckpt(async_ref(), "RN12")
    torch.save(torch.zeros(3), ck / "iter_0000002/in_flight.pt")
    show(*resume("RN12", ck / "iter_0000002", "megatron_training.train_iters=4", *ASYNC))


@case("RN13", "the async checkpoint resumed with another global_batch_size (the saved docks do not fit)")
def rn13():
    ck = copy_ckpt(async_ref(), "RN13")
    show(*resume("RN13", ck / "iter_0000002", "megatron_training.train_iters=4", *ASYNC,
                 "megatron_training.global_batch_size=8", "rl_config.mini_batch_size=8"))


def _concurrent(cid: str, a: list[str], b: list[str], delay: float = 3.0) -> None:
    shutil.rmtree(K / cid, ignore_errors=True)
    pa = subprocess.Popen(a, cwd=WORLD, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(delay)
    rc_b, out_b = run(b)
    out_a = pa.communicate()[0]
    print("A:"), show(pa.returncode, out_a)
    print("B:"), show(rc_b, out_b)


@case("RN14", "two trains on the same output dir (different saves) at once")
def rn14():
    out = f"rl_config.output_dir={K / 'RN14/out'}"
    _concurrent("RN14", train_argv("RN14", "megatron_training.train_iters=4", out),
                train_argv("RN14", "megatron_training.train_iters=4", out, f"actor_config.save={K / 'RN14/ckptB'}"))
    print("left:", sorted(p.name for p in (K / "RN14").iterdir()))


@case("RN15", "two trains on the same save dir (different output dirs) at once; B's new output dir left?")
def rn15():
    save = f"actor_config.save={K / 'RN15/ckpt'}"
    _concurrent("RN15", train_argv("RN15", "megatron_training.train_iters=4", save),
                train_argv("RN15", "megatron_training.train_iters=4", save, f"rl_config.output_dir={K / 'RN15/outB'}"))
    print("left:", sorted(p.name for p in (K / "RN15").iterdir()))


@case("RN16", "two resumes of the same checkpoint into the same dirs at once")
def rn16():
    base = copy_ckpt(ref("sync2", "megatron_training.train_iters=2"), "RN16")
    args = ["megatron_training.train_iters=4", f"actor_config.load={base}", "actor_config.finetune=false"]
    _concurrent("RN16x", train_argv("RN16", *args), train_argv("RN16", *args), delay=2)
    print("metrics iterations:", sorted(metrics(K / "RN16/out")), "tracker", tracker(base))


@case("RN17", "a 260 MB tmpfs fills at the 3rd save: previous checkpoint intact, tracker unchanged, resumable")
def rn17():
    mount_full("260m")
    rc, out = run(train_argv("RN17", "megatron_training.train_iters=5", root=FULL))
    show(rc, out)
    ck = FULL / "RN17/ckpt"
    print("tracker", tracker(ck), "entries", sorted(p.name for p in ck.iterdir()))
    show(*G("RN17b", "megatron_training.train_iters=5", f"actor_config.load={ck}", "actor_config.finetune=false"))


def _poisoned(cid: str, name: str, marker: str) -> None:
    ck = copy_ckpt(ref("sync2", "megatron_training.train_iters=2"), cid)
    _plant(ck / "iter_0000002" / name, marker, key="_probe")
    show(*resume(cid, ck, "megatron_training.train_iters=3"))
    payload_ran(marker)


@case("RN18", "optimizer.pt with an os.system payload")
def rn18():
    _poisoned("RN18", "optimizer.pt", "PWNED_optim")


@case("RN19", "rng.pt with an os.system payload")
def rn19():
    _poisoned("RN19", "rng.pt", "PWNED_rng")


@case("RN20", "sampler.pt with an os.system payload")
def rn20():
    _poisoned("RN20", "sampler.pt", "PWNED_sampler")


@case("RN21", "scheduler.pt with an os.system payload")
def rn21():
    _poisoned("RN21", "scheduler.pt", "PWNED_sched")


@case("RN22", "optimizer.pt truncated to half, resume (then --load-previous-on-corruption)")
def rn22():
    ck = copy_ckpt(ref("sync2", "megatron_training.train_iters=2"), "RN22")
    f = ck / "iter_0000002/optimizer.pt"
    truncate(f, f.stat().st_size // 2)
    show(*resume("RN22", ck, "megatron_training.train_iters=3"))
    show(*resume("RN22b", ck, "megatron_training.train_iters=3", flags=("--load-previous-on-corruption",)))


@case("RN23", "rng.pt = 'garbage' with --load-previous-on-corruption")
def rn23():
    ck = copy_ckpt(ref("sync2", "megatron_training.train_iters=2"), "RN23")
    (ck / "iter_0000002/rng.pt").write_text("garbage")
    show(*resume("RN23", ck, "megatron_training.train_iters=3", flags=("--load-previous-on-corruption",)))


@case("RN24", "the tracker names iteration 7, which does not exist")
def rn24():
    ck = copy_ckpt(ref("sync2", "megatron_training.train_iters=2"), "RN24")
    (ck / "latest_checkpointed_iteration.txt").write_text("7\n")
    show(*resume("RN24", ck, "megatron_training.train_iters=3"))


@case("RN25", "the tracker holds 'abc'")
def rn25():
    ck = copy_ckpt(ref("sync2", "megatron_training.train_iters=2"), "RN25")
    (ck / "latest_checkpointed_iteration.txt").write_text("abc\n")
    show(*resume("RN25", ck, "megatron_training.train_iters=3"))


@case("RN26", "--load-previous-on-corruption with no earlier checkpoint (only iter 1, its sampler.pt garbage)")
def rn26():
    ck = copy_ckpt(ref("sync1", "megatron_training.train_iters=1"), "RN26")
    (ck / "iter_0000001/sampler.pt").write_text("garbage")
    show(*resume("RN26", ck, "megatron_training.train_iters=2", flags=("--load-previous-on-corruption",)))


@case("RN27", "megatron: common.pt with an os.system payload")
def rn27():
    ck = _mg_damaged("RN27", lambda d: None)
    _plant(ck / "iter_0000003/common.pt", "PWNED_common", key="_probe")
    show(*resume("RN27", ck, *MG, "megatron_training.train_iters=4", "megatron_training.save_interval=1"))
    payload_ran("PWNED_common")


@case("RN28", "megatron: the shard __0_0.distcp deleted")
def rn28():
    ck = _mg_damaged("RN28", lambda d: (d / "__0_0.distcp").unlink())
    show(*resume("RN28", ck, *MG, "megatron_training.train_iters=4", "megatron_training.save_interval=1"))


@case("RN29", "megatron: .metadata cut to 50 bytes")
def rn29():
    ck = _mg_damaged("RN29", lambda d: truncate(d / ".metadata", 50))
    show(*resume("RN29", ck, *MG, "megatron_training.train_iters=4", "megatron_training.save_interval=1"))


@case("RN30", "megatron: the tracker names iteration 9 (missing), with --load-previous-on-corruption")
def rn30():
    ck = _mg_damaged("RN30", lambda d: (d.parent / "latest_checkpointed_iteration.txt").write_text("9\n"))
    show(*resume("RN30", ck, *MG, "megatron_training.train_iters=4", "megatron_training.save_interval=1",
                 flags=("--load-previous-on-corruption",)))


@case("RN31", "megatron: the TP 2 checkpoint resumed at TP 1 (2 data-parallel workers)")
def rn31():
    ck = copy_ckpt(mg_ref(), "RN31")
    show(*resume("RN31", ck, "rl_config.actor_resource.num_npus=2", "actor_config.backend=megatron",
                 "actor_config.micro_batch_size=8",
                 "megatron_training.train_iters=4", "megatron_training.save_interval=1"))


@case("RN32", "megatron: the TP 2 checkpoint resumed at PP 2")
def rn32():
    ck = copy_ckpt(mg_ref(), "RN32")
    show(*resume("RN32", ck, "rl_config.actor_resource.num_npus=2", "actor_config.pipeline_model_parallel_size=2",
                 "megatron_training.train_iters=4", "megatron_training.save_interval=1"))


@case("RN33", "megatron: a save on a full disk (tmpfs, 2nd iteration)")
def rn33():
    mount_full("64m")
    rc, out = run(train_argv("RN33", *MG, "megatron_training.train_iters=3", "megatron_training.save_interval=1",
                             root=FULL))
    show(rc, out)
    ck = FULL / "RN33/ckpt"
    print("tracker", tracker(ck), "entries", sorted(p.name for p in ck.iterdir()) if ck.is_dir() else "-")


@case("RN34", "eval.jsonl and metrics.jsonl fill the disk (held-out eval every iteration, 20 KB free)")
def rn34():
    mount_full()
    fill_full(leave_kb=20)
    shutil.rmtree(K / "RN34", ignore_errors=True)
    rc, out = G("RN34", "megatron_training.train_iters=6", f"rl_config.output_dir={FULL / 'out'}",
                "rl_config.eval_data_path=probe/data/rl/data", "rl_config.eval_interval=1", "rl_config.eval_limit=4")
    show(rc, out)
    for name in ("metrics.jsonl", "eval.jsonl"):
        f = FULL / "out" / name
        if f.exists():
            b = f.read_bytes()
            print(name, len(b), "bytes; ends with newline:", b.endswith(b"\n"))


@case("RN35", "the output dir's lock file is a symlink to a file elsewhere")
def rn35():
    d = K / "RN35"
    shutil.rmtree(d, ignore_errors=True)
    (d / "out").mkdir(parents=True)
    (d / "victim.txt").write_text("precious\n")
    (d / "out/.posttrain.lock").symlink_to(d / "victim.txt")
    show(*G("RN35", "megatron_training.train_iters=1"))
    print("victim:", (d / "victim.txt").read_text().strip())


@case("RN36", "resume into an output dir whose metrics.jsonl ends in a cut line (kill while writing)")
def rn36():
    base = ref("sync2", "megatron_training.train_iters=2")
    ck = copy_ckpt(base, "RN36")
    shutil.copytree(base / "out", K / "RN36/out", ignore=shutil.ignore_patterns(".posttrain.lock"))
    with open(K / "RN36/out/metrics.jsonl", "a") as f:
        f.write('{"iteration": 3, "actor/pg_l')
    show(*resume("RN36", ck, "megatron_training.train_iters=3"))
    print("iterations:", sorted(metrics(K / "RN36/out")))


@case("RN37", "SIGTERM mid-run (async), then resume: same as uninterrupted?")
def rn37():
    base = ref("fullRN2", "megatron_training.train_iters=6", "megatron_training.save_interval=2", *ASYNC)
    rc = killed_run("RN37", 3, "megatron_training.train_iters=6", "megatron_training.save_interval=2", *ASYNC,
                    sig=signal.SIGTERM)
    print(f"terminated rc={rc}; tracker {tracker(K / 'RN37/ckpt')}")
    show(*resume("RN37", K / "RN37/ckpt", "megatron_training.train_iters=6", "megatron_training.save_interval=2",
                 *ASYNC))
    print(same_run(base / "out", K / "RN37/out", base / "ckpt/iter_0000006", K / "RN37/ckpt/iter_0000006"))


@case("RN38", "trainer_state.json deleted in the latest iteration (tracker 2)")
def rn38():
    ck = copy_ckpt(ref("sync2", "megatron_training.train_iters=2"), "RN38")
    (ck / "iter_0000002/trainer_state.json").unlink()
    show(*resume("RN38", ck, "megatron_training.train_iters=3"))
    show(*resume("RN38b", ck, "megatron_training.train_iters=3", flags=("--load-previous-on-corruption",)))


@case("RN39", "megatron: .metadata (read by torch with plain pickle) with an os.system payload")
def rn39():
    import pickle
    ck = _mg_damaged("RN39", lambda d: None)
    marker = f"PWNED_metadata-{TAG}"
    (WORLD / marker).unlink(missing_ok=True)

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {WORLD / marker}",))
    f = ck / "iter_0000003/.metadata"
    with open(f, "rb") as fh:
        md = pickle.load(fh)
    md.storage_meta = Evil()
    with open(f, "wb") as fh:
        pickle.dump(md, fh)
    show(*resume("RN39", ck, *MG, "megatron_training.train_iters=4", "megatron_training.save_interval=1"))
    payload_ran("PWNED_metadata")


@case("RN40", "megatron: the rng_state object in a shard replaced by an os.system payload (metadata re-pointed)")
def rn40():
    import io
    import pickle

    import torch
    ck = _mg_damaged("RN40", lambda d: None)
    marker = f"PWNED_shard-{TAG}"
    (WORLD / marker).unlink(missing_ok=True)

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {WORLD / marker}",))
    d = ck / "iter_0000003"
    with open(d / ".metadata", "rb") as fh:
        md = pickle.load(fh)
    blob = io.BytesIO()
    torch.save([Evil()], blob)
    for index, info in md.storage_data.items():
        if index.fqn.startswith("rng_state/"):
            shard = d / info.relative_path
            offset = shard.stat().st_size
            with open(shard, "ab") as fh:
                fh.write(blob.getvalue())
            info.offset, info.length = offset, len(blob.getvalue())
    with open(d / ".metadata", "wb") as fh:
        pickle.dump(md, fh)
    show(*resume("RN40", ck, *MG, "megatron_training.train_iters=4", "megatron_training.save_interval=1"))
    payload_ran("PWNED_shard")


if __name__ == "__main__":
    wanted = sys.argv[1] if len(sys.argv) > 1 else "list"
    if wanted == "list":
        for cid, (what, _) in CASES.items():
            print(f"{cid}: {what}")
    else:
        what, fn = CASES[wanted]
        print(f"== {wanted} ({TAG}): {what}")
        K.mkdir(parents=True, exist_ok=True)
        try:
            fn()
        finally:
            umount_full()
