"""Probe 3, the commands area (issue 35): run one case of docs/reliability/probe3_cmds.md by id.

    export PYTHONPATH=$PWD/src OMP_NUM_THREADS=1       # the code under test ("before": another src tree)
    python docs/reliability/probe3_cmds_cases.py setup # the world, under $PROBE_WORLD (default /tmp/cmds_probe)
    python docs/reliability/probe3_cmds_cases.py G9 CM3 # run cases: the command, its exit status, the first
                                                       # lines of its output and what is on disk afterwards
    python docs/reliability/probe3_cmds_cases.py all

Each case prepares its own input files under the world and removes what it wrote that is large.
Disk-full and read-only cases mount a small tmpfs at /tmp/full_cmds (root needed) and unmount it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml

REPO = Path(__file__).resolve().parents[2]
W = Path(os.environ.get("PROBE_WORLD", "/tmp/cmds_probe"))
FULL = Path("/tmp/full_cmds")
E = ["eval", "--model", "model", "--max-tokens", "4"]
PL = ["plan", "--config-path", "cfg", "--config-name", "grpo"]
LORA = ["megatron_training.lora_r=8", "megatron_training.lora_target_modules=[q_proj,v_proj]"]
PRE = ["preprocess", "--config-name", "tiny_add", "tokenizer_name_or_path=model"]
BENCH = ["bench", "--config-path", "cfg", "--config-name", "grpo", "--iters", "1", "--warmup", "0"]


def posttrain(*args: str) -> list[str]:
    return [sys.executable, "-m", "posttrain", *args]


def setup() -> None:
    """The probe's world: a tiny Qwen2 (init-model), the tiny additions data, its RL dataset and
    probe 2's grpo.yaml (paths in the world, 4 prompts x 4 samples, 3 iterations, no evaluation)."""
    W.mkdir(parents=True, exist_ok=True)
    if not (W / "configs").exists():
        shutil.copytree(REPO / "configs", W / "configs")
    if not (W / "model").exists():
        subprocess.run(posttrain("init-model", "--model", "tiny_qwen2", "--output", "model"), cwd=W, check=True)
    subprocess.run([sys.executable, str(REPO / "examples/tiny/make_data.py"), "raw"], cwd=W, check=True)
    if not (W / "data/rl").exists():
        subprocess.run(posttrain(*PRE, "input=raw/train.jsonl", "output_prefix=data/rl/data"), cwd=W, check=True)
    cfg = yaml.safe_load((REPO / "configs/grpo_tiny_qwen2.yaml").read_text())
    cfg["megatron_training"].update(tokenizer_name_or_path="model", data_path="data/rl/data", global_batch_size=4,
                                    train_iters=3, save_interval=1)
    cfg["actor_config"].update(micro_batch_size=16, load="model", finetune=True, save="run/ckpt")
    cfg["rl_config"].update(output_dir="run/out", n_samples_per_prompt=4, mini_batch_size=4, use_tensorboard=False)
    cfg["rl_config"].pop("eval_data_path")
    (W / "cfg").mkdir(exist_ok=True)
    (W / "cfg/grpo.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    (W / "ev").mkdir(exist_ok=True)
    ok = [{"problem": f"{a}+1", "answer": str(a + 1)} for a in range(3)]
    (W / "ev/ok.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ok))
    (W / "afile").write_text("a file\n")
    (W / "emptydir").mkdir(exist_ok=True)
    if not (W / "lora_run/ckpt").exists():  # a LoRA run of 2 iterations (r 8 on q_proj, v_proj): CM46-CM49
        subprocess.run(posttrain("train", "--config-path", "cfg", "--config-name", "grpo", *LORA,
                                 "megatron_training.train_iters=2", "actor_config.save=lora_run/ckpt",
                                 "rl_config.output_dir=lora_run/out"), cwd=W, check=True)
    print(f"world ready in {W}")


# ---- helpers the cases use -----------------------------------------------------------------------
def text(path: str, content: str | bytes) -> Callable[[], None]:
    def write() -> None:
        p = W / path
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content if isinstance(content, bytes) else content.encode())
    return write


def rows(path: str, *items: dict | str) -> Callable[[], None]:
    return text(path, "".join((i if isinstance(i, str) else json.dumps(i)) + "\n" for i in items))


def copy(src: str, dst: str) -> Callable[[], None]:
    def do() -> None:
        (W / dst).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(W / src, W / dst)
    return do


def rm(*paths: str) -> Callable[[], None]:
    """Remove what an earlier run of the case wrote."""
    def do() -> None:
        for path in paths:
            target = W / path
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
    return do


def same_file(a: str, b: str) -> Callable[[], str]:
    return lambda: f"{b} unchanged: {(W / a).read_bytes() == (W / b).read_bytes()}"


def listing(path: str) -> Callable[[], str]:
    def show() -> str:
        p = W / path
        if not p.exists():
            return f"{path}: absent"
        return f"{path}: " + (", ".join(sorted(x.name for x in p.iterdir())) if p.is_dir() else f"{p.stat().st_size} B")
    return show


def mount_full(free_kb: int = 0, size_mb: int = 64) -> Callable[[], None]:
    """A tmpfs at /tmp/full_cmds filled to ``free_kb`` KiB free (``dd``), linked as W/full."""
    def do() -> None:
        FULL.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(FULL)], check=True)
        subprocess.run(["dd", "if=/dev/zero", f"of={FULL}/filler", "bs=1M", f"count={size_mb}"], capture_output=True)
        subprocess.run(["dd", "if=/dev/zero", f"of={FULL}/filler2", "bs=4k"], capture_output=True)
        if free_kb:
            os.truncate(FULL / "filler", (FULL / "filler").stat().st_size - free_kb * 1024)
        (W / "full").unlink(missing_ok=True)
        (W / "full").symlink_to(FULL)
    return do


def mount_readonly() -> None:
    FULL.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,ro", "tmpfs", str(FULL)], check=True)
    (W / "ro").unlink(missing_ok=True)
    (W / "ro").symlink_to(FULL)


def umount() -> None:
    subprocess.run(["umount", str(FULL)], check=False)
    for name in ("full", "ro"):
        (W / name).unlink(missing_ok=True)


def full_listing() -> str:
    found = sorted(str(p.relative_to(FULL)) for p in FULL.rglob("*") if not p.name.startswith("filler"))
    return f"left on the full disk: {found or 'nothing'}"


def huge_line(path: str, chars: int, answer: str = "1") -> Callable[[], None]:
    def write() -> None:
        with open(W / path, "w") as f:
            f.write('{"problem": "')
            block = "1+" * 512 * 1024
            for _ in range(chars // len(block)):
                f.write(block)
            f.write(f'1", "answer": "{answer}"}}\n')
            f.write(json.dumps({"problem": "2+1", "answer": "3"}) + "\n")
    return write


@dataclass
class Case:
    id: str
    what: str
    argv: list[str]
    prep: list[Callable[[], None]] = field(default_factory=list)
    after: list[Callable[[], str]] = field(default_factory=list)
    cleanup: list[Callable[[], None]] = field(default_factory=list)
    concurrent: list[str] | None = None  # a second command started at the same moment
    mem_gb: float = 8.0  # address-space cap of the command (prlimit --as), as probe 2 used
    head: bool = False  # stdout into a pipe that is closed after the first line (``| head -1``)


CASES: list[Case] = []


def case(id: str, what: str, *argv: str, **kw) -> None:
    CASES.append(Case(id, what, list(argv), **kw))


# ---- probe 2's cases of this area --------------------------------------------------------------------
case("L3p", "plan: a LoRA target that matches no layer", *PL, *LORA[:1], "megatron_training.lora_target_modules=[nosuch]")
case("PV1", "plan: actor_config.save is a file", *PL, "actor_config.save=afile")
case("PV3", "plan: unknown prompt_type", *PL, "megatron_training.prompt_type=nosuch")
case("PV4", "plan: eval_data_path with no files", *PL, "rl_config.eval_data_path=nosuch/data")
case("PV5", "plan: actor_config.load is a file", *PL, "actor_config.load=model/config.json")
case("PV6", "plan: tokenizer an empty dir, load null", *PL, "actor_config.load=null",
     "megatron_training.tokenizer_name_or_path=emptydir")
case("L4b", "plan: lora_target_modules [] with lora_r 8, alpha 16", *PL, "megatron_training.lora_r=8",
     "megatron_training.lora_alpha=16", "megatron_training.lora_target_modules=[]")
case("L16d", "plan: share_backbone with integrated_mode_config.ref_model_load_path", *PL, *LORA,
     "rl_config.share_backbone=true", "rl_config.init_kl_coef=0.1",
     "rl_config.integrated_mode_config.ref_model_load_path=model")
case("G5", "eval: an empty prompt", *E, "--data", "ev/emptyprompt.jsonl",
     prep=[rows("ev/emptyprompt.jsonl", {"problem": "", "answer": "1"}, {"problem": "2+1", "answer": "3"})])
case("G6", "eval: label null", *E, "--data", "ev/nulllabel.jsonl",
     prep=[rows("ev/nulllabel.jsonl", {"prompt": "1+1", "label": None})])
case("G9", "eval: --samples and --output the same path", *E, "--data", "ev/ok.jsonl", "--samples", "ev/same.json",
     "--output", "ev/same.json", prep=[lambda: (W / "ev/same.json").unlink(missing_ok=True)],
     after=[listing("ev/same.json")])
case("G11b", "eval: --samples = --data, --force", *E, "--data", "ev/ok_copy.jsonl", "--samples", "ev/ok_copy.jsonl",
     "--force", prep=[copy("ev/ok.jsonl", "ev/ok_copy.jsonl")], after=[same_file("ev/ok.jsonl", "ev/ok_copy.jsonl")])
case("G11c", "eval: --output = --data, --force", *E, "--data", "ev/ok_copy2.jsonl", "--output", "ev/ok_copy2.jsonl",
     "--force", prep=[copy("ev/ok.jsonl", "ev/ok_copy2.jsonl")], after=[same_file("ev/ok.jsonl", "ev/ok_copy2.jsonl")])
case("G14", "eval: a 100 MB prompt (2048-position model)", *E, "--data", "ev/huge_prompt.jsonl",
     prep=[huge_line("ev/huge_prompt.jsonl", 100 * 2**20)], cleanup=[lambda: (W / "ev/huge_prompt.jsonl").unlink()])
case("G14b", "eval: a 1 MB prompt", *E, "--data", "ev/mid_prompt.jsonl", prep=[huge_line("ev/mid_prompt.jsonl", 2**20)])
case("G14c", "eval: a ~5000-token prompt", *E, "--data", "ev/long_prompt.jsonl",
     prep=[rows("ev/long_prompt.jsonl", {"problem": "1+" * 2500 + "1", "answer": "1"}, {"problem": "2+1", "answer": "3"})])
case("B1", "bench: override max_tokens=1000000", *BENCH, "generate_config.sampling_config.max_tokens=1000000")
case("B4", "bench: override n_samples_per_prompt=0 (and mini_batch_size=8 > global_batch_size 4)", *BENCH,
     "rl_config.n_samples_per_prompt=0")
case("B4b", "bench: override mini_batch_size=8 > global_batch_size 4 (a check after loading)", *BENCH,
     "rl_config.mini_batch_size=8")
case("I4", "preprocess onto a full disk", *PRE, "input=raw/train.jsonl", "output_prefix=full/pp/data",
     prep=[mount_full()], after=[full_listing], cleanup=[umount])
case("I6", "score onto a full disk", "score", "--verifier", "last_number", "--input", "ev/scored_in.jsonl",
     "--output", "full/score_out.jsonl", prep=[rows("ev/scored_in.jsonl", *[{"response": "2", "label": "2"}] * 2000),
                                              mount_full()], after=[full_listing], cleanup=[umount])
case("I7", "eval --samples/--output onto a full disk", *E, "--data", "ev/ok.jsonl", "--samples", "full/s.jsonl",
     "--output", "full/o.json", prep=[mount_full()], after=[full_listing], cleanup=[umount])
case("Q3", "two init-model (seeds 1, 2) into the same new dir at once", "init-model", "--output", "im_race",
     "--seed", "1", concurrent=["init-model", "--output", "im_race", "--seed", "2"],
     prep=[lambda: shutil.rmtree(W / "im_race", ignore_errors=True)], after=[listing("im_race")])
case("Q4", "two preprocess (train / test rows) into the same prefix at once", *PRE, "input=raw/train.jsonl",
     "output_prefix=race/data", concurrent=[*PRE, "input=raw/test.jsonl", "output_prefix=race/data"],
     prep=[lambda: shutil.rmtree(W / "race", ignore_errors=True)], after=[listing("race")])

# ---- new cases (CM) ------------------------------------------------------------------------------------
OK_ROW = {"problem": "2+1", "answer": "3"}
case("CM1", "eval: an empty (0-byte) file", *E, "--data", "ev/empty.jsonl", prep=[text("ev/empty.jsonl", "")])
case("CM2", "eval: a JSON array, not JSON Lines (.json)", *E, "--data", "ev/array.json",
     prep=[text("ev/array.json", json.dumps([OK_ROW, OK_ROW], indent=1))])
case("CM3", "eval: a UTF-8 BOM", *E, "--data", "ev/bom.jsonl", prep=[text("ev/bom.jsonl", b"\xef\xbb\xbf" +
                                                                       json.dumps(OK_ROW).encode() + b"\n")])
case("CM4", "eval: CRLF line endings", *E, "--data", "ev/crlf.jsonl",
     prep=[text("ev/crlf.jsonl", (json.dumps(OK_ROW) + "\r\n") * 2)])
case("CM5", "eval: a row with a duplicate key (two prompts)", *E, "--data", "ev/dupkey.jsonl",
     prep=[rows("ev/dupkey.jsonl", '{"problem": "2+1", "problem": "5+1", "answer": "3"}')])
case("CM6", "eval: a label that is a list", *E, "--data", "ev/listlabel.jsonl",
     prep=[rows("ev/listlabel.jsonl", {"problem": "2+1", "answer": ["3"]})])
case("CM7", "eval: a label that is a number", *E, "--data", "ev/numlabel.jsonl",
     prep=[rows("ev/numlabel.jsonl", {"problem": "2+1", "answer": 3})])
case("CM8", "eval: a prompt that is null", *E, "--data", "ev/nullprompt.jsonl",
     prep=[rows("ev/nullprompt.jsonl", {"problem": None, "answer": "3"})])
case("CM9", "eval: --output in a read-only directory", *E, "--data", "ev/ok.jsonl", "--output", "ro/o.json",
     prep=[mount_readonly], cleanup=[umount])
case("CM10", "eval: --output under a path whose parent is a file", *E, "--data", "ev/ok.jsonl", "--output",
     "afile/o.json")
case("CM11", "eval: --output a symlink to the --data file, --force", *E, "--data", "ev/ok_copy3.jsonl", "--output",
     "ev/link.json", "--force", prep=[copy("ev/ok.jsonl", "ev/ok_copy3.jsonl"),
                                      lambda: (W / "ev/link.json").unlink(missing_ok=True),
                                      lambda: (W / "ev/link.json").symlink_to("ok_copy3.jsonl")],
     after=[same_file("ev/ok.jsonl", "ev/ok_copy3.jsonl")])
case("CM12", "eval: --output the model's config.json, --force", *E, "--data", "ev/ok.jsonl", "--output",
     "model_copy/config.json", "--force", prep=[lambda: shutil.rmtree(W / "model_copy", ignore_errors=True),
                                                lambda: shutil.copytree(W / "model", W / "model_copy")],
     after=[same_file("model/config.json", "model_copy/config.json")])
CASES[-1].argv[2] = "model_copy"
case("CM13", "eval: --max-tokens equal to the context (2048)", "eval", "--model", "model", "--max-tokens", "2048",
     "--data", "ev/ok.jsonl")
case("CM14", "eval: --data an indexed prefix with no files", *E, "--data", "nosuch/data")
case("CM15", "eval: a 1 GB prompt line", *E, "--data", "ev/gb_line.jsonl", prep=[huge_line("ev/gb_line.jsonl", 2**30)],
     cleanup=[lambda: (W / "ev/gb_line.jsonl").unlink()], mem_gb=8.0)
case("CM16", "eval: every row skipped (all prompts empty)", *E, "--data", "ev/allempty.jsonl",
     prep=[rows("ev/allempty.jsonl", {"problem": " ", "answer": "1"}, {"problem": "", "answer": "2"})])
case("CM17", "score: an empty (0-byte) file", "score", "--verifier", "last_number", "--input", "ev/empty.jsonl",
     "--output", "ev/score_empty_out.jsonl", "--force", prep=[text("ev/empty.jsonl", "")])
case("CM18", "score: a JSON array file", "score", "--verifier", "last_number", "--input", "ev/array_s.json",
     "--output", "ev/score_arr_out.jsonl", "--force",
     prep=[text("ev/array_s.json", json.dumps([{"response": "3", "label": "3"}]))])
case("CM19", "score: a label null", "score", "--verifier", "last_number", "--input", "ev/s_null.jsonl",
     "--output", "ev/s_null_out.jsonl", "--force", prep=[rows("ev/s_null.jsonl", {"response": "3", "label": None})],
     after=[listing("ev/s_null_out.jsonl")])
case("CM20", "score: a response that is a dict", "score", "--verifier", "last_number", "--input", "ev/s_dict.jsonl",
     "--output", "ev/s_dict_out.jsonl", "--force",
     prep=[rows("ev/s_dict.jsonl", {"response": {"text": "3"}, "label": "3"})])
case("CM21", "score: a row with a duplicate key", "score", "--verifier", "last_number", "--input", "ev/s_dup.jsonl",
     "--output", "ev/s_dup_out.jsonl", "--force", prep=[rows("ev/s_dup.jsonl", '{"response": "3", "response": "4", '
                                                                               '"label": "3"}')])
case("CM22", "score: CRLF and a BOM", "score", "--verifier", "last_number", "--input", "ev/s_crlf.jsonl",
     "--output", "ev/s_crlf_out.jsonl", "--force",
     prep=[text("ev/s_crlf.jsonl", b"\xef\xbb\xbf" + b'{"response": "3", "label": "3"}\r\n' * 2)])
case("CM23", "score: --output in a read-only directory", "score", "--verifier", "last_number", "--input",
     "ev/scored_in.jsonl", "--output", "ro/out.jsonl", prep=[rows("ev/scored_in.jsonl", {"response": "2", "label": "2"}),
                                                             mount_readonly], cleanup=[umount])
case("CM24", "score: --output a path under a file", "score", "--verifier", "last_number", "--input",
     "ev/scored_in.jsonl", "--output", "afile/out.jsonl", prep=[rows("ev/scored_in.jsonl", {"response": "2", "label": "2"})])
case("CM25", "bench: --output under a file", *BENCH, "--output", "afile/bench.json")
case("CM26", "bench: --iters 0", "bench", "--config-path", "cfg", "--config-name", "grpo", "--iters", "0")
case("CM27", "preprocess: an unknown handler_name", *PRE, "input=raw/train.jsonl", "output_prefix=pp27/data",
     "handler_name=NoSuchHandler", prep=[rm("pp27")])
case("CM28", "preprocess: seq_length 10^12 with pack: true", *PRE, "input=raw/train.jsonl", "output_prefix=pp28/data",
     "seq_length=1000000000000", "pack=true", prep=[rm("pp28")], after=[listing("pp28")])
case("CM29", "preprocess: output_prefix in a read-only directory", *PRE, "input=raw/train.jsonl",
     "output_prefix=ro/pp/data", prep=[mount_readonly], cleanup=[umount])
case("CM30", "preprocess: an empty input file", *PRE, "input=ev/empty.jsonl", "output_prefix=pp30/data",
     prep=[text("ev/empty.jsonl", ""), rm("pp30")], after=[listing("pp30")])
case("CM31", "preprocess: rows with duplicate keys", *PRE, "input=ev/pp_dup.jsonl", "output_prefix=pp31/data",
     prep=[rows("ev/pp_dup.jsonl", '{"problem": "2+1", "problem": "5+1", "answer": "3"}', OK_ROW), rm("pp31")])
case("CM32", "preprocess: a 100 MB line and a normal row (seq_length 64)", *PRE, "input=ev/big_line.jsonl",
     "output_prefix=pp32/data", "seq_length=64", prep=[huge_line("ev/big_line.jsonl", 100 * 2**20), rm("pp32")],
     cleanup=[lambda: (W / "ev/big_line.jsonl").unlink()], mem_gb=6.0)
case("CM33", "preprocess: output_prefix on a disk with 24 KiB free (the write fails mid-way)", *PRE, "input=raw/train.jsonl",
     "output_prefix=full/pp/data", prep=[mount_full(free_kb=24)], after=[full_listing], cleanup=[umount])
case("CM34", "init-model: --vocab-size -5", "init-model", "--output", "im34", "--vocab-size", "-5", prep=[rm("im34")])
case("CM35", "init-model: a model yaml whose heads do not divide hidden_size", "init-model", "--model",
     "cfg/odd_model.yaml", "--output", "im35",
     prep=[text("cfg/odd_model.yaml", "odd:\n  num_layers: 1\n  hidden_size: 100\n  ffn_hidden_size: 64\n"
                "  num_attention_heads: 3\n  group_query_attention: true\n  num_query_groups: 1\n"
                "  max_position_embeddings: 64\n"), rm("im35")], after=[listing("im35")])
case("CM36", "init-model: hidden_size 0", "init-model", "--model", "cfg/zero_model.yaml", "--output", "im36",
     prep=[text("cfg/zero_model.yaml", "zero:\n  num_layers: 1\n  hidden_size: 0\n  ffn_hidden_size: 64\n"
                "  num_attention_heads: 1\n  max_position_embeddings: 64\n"), rm("im36")])
case("CM37", "init-model: --output on a full disk", "init-model", "--output", "full/im37", prep=[mount_full()],
     after=[full_listing], cleanup=[umount])
case("CM38", "plan: the same key overridden twice with different values", *PL, "rl_config.n_samples_per_prompt=4",
     "rl_config.n_samples_per_prompt=8")
case("CM39", "plan: use_integrated_worker false with share_backbone", *PL, *LORA, "rl_config.share_backbone=true",
     "rl_config.use_integrated_worker=false")
case("CM40", "plan: lora_r 100000 (> hidden size 384)", *PL, *LORA[1:], "megatron_training.lora_r=100000")
case("CM41", "plan: lora_alpha .inf", *PL, *LORA, "megatron_training.lora_alpha=.inf")
case("CM42", "plan: lora_r 16 without lora_target_modules", *PL, "megatron_training.lora_r=16")
case("CM43", "plan: lora_target_modules [mlp] (a module, not a linear layer)", *PL, *LORA[:1],
     "megatron_training.lora_target_modules=[mlp]")
case("CM44", "plan: share_backbone with init_kl_coef 0", *PL, *LORA, "rl_config.share_backbone=true",
     "rl_config.init_kl_coef=0")
case("CM45", "plan: share_backbone with stage dpo", *PL, *LORA, "rl_config.share_backbone=true",
     "megatron_training.stage=dpo", "megatron_training.is_pairwise_dataset=true", "actor_config.micro_batch_size=4")
case("CM46", "plan: load a LoRA checkpoint with another rank", *PL, *LORA[1:], "megatron_training.lora_r=16",
     "actor_config.load=lora_run/ckpt", "actor_config.finetune=false", "actor_config.save=lora_run/ckpt",
     "rl_config.output_dir=lora_run/out")
case("CM47", "plan: load a LoRA checkpoint without the LoRA keys", *PL, "actor_config.load=lora_run/ckpt",
     "actor_config.finetune=false", "actor_config.save=lora_run/ckpt", "rl_config.output_dir=lora_run/out")
case("CM48", "plan: save holds another run's checkpoints (train refuses to overwrite them)", *PL,
     "actor_config.save=lora_run/ckpt", "rl_config.output_dir=run48/out")
case("CM49", "plan: output_dir holds an earlier run's metrics", *PL, "actor_config.save=run49/ckpt",
     "rl_config.output_dir=lora_run/out")
case("CM50", "plan piped into head (stdout closed early)", *PL, head=True)
case("CM51", "plan: data_path with no files", *PL, "megatron_training.data_path=nosuch/data")
case("CM52", "plan: output_dir under a file", *PL, "rl_config.output_dir=afile/out")

case("CM53", "score onto a disk with 8 KiB free: the probe block fits, the 100 KB output does not", "score",
     "--verifier", "last_number", "--input", "ev/scored_in.jsonl", "--output", "full/score_out.jsonl",
     prep=[rows("ev/scored_in.jsonl", *[{"response": "2", "label": "2"}] * 2000), mount_full(free_kb=8)],
     after=[full_listing], cleanup=[umount])


# ---- running ---------------------------------------------------------------------------------------
def _limited(mem_gb: float) -> list[str]:
    return ["prlimit", f"--as={int(mem_gb * 2**30)}", "--"]


def run_case(c: Case) -> None:
    print(f"== {c.id}: {c.what}")
    for prep in c.prep:
        prep()
    try:
        start = time.monotonic()
        cmd = _limited(c.mem_gb) + posttrain(*c.argv)
        print("$ posttrain " + " ".join(c.argv))
        if c.head:
            proc = subprocess.Popen(cmd, cwd=W, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            first = proc.stdout.readline().decode()
            proc.stdout.close()
            err = proc.stderr.read().decode()
            print(f"rc {proc.wait()}; first line: {first.strip()}\n{err.strip()[-1500:]}")
        elif c.concurrent is not None:
            procs = [subprocess.Popen(argv, cwd=W, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                     for argv in (cmd, _limited(c.mem_gb) + posttrain(*c.concurrent))]
            for name, proc in zip("AB", procs):
                out = proc.communicate()[0].decode().strip().splitlines()
                print(f"{name}: rc {proc.returncode}: {' | '.join(out[-3:])[:600]}")
        else:
            proc = subprocess.run(cmd, cwd=W, capture_output=True, text=True, errors="replace", timeout=900)
            out = (proc.stdout + proc.stderr).strip().splitlines()
            shown = [line[:400] for line in out if not line.startswith("skip ")][-6:]
            skips = [line[:200] for line in out if line.startswith("skip ")]
            print(f"rc {proc.returncode} ({time.monotonic() - start:.1f} s)")
            print("\n".join(skips[:3] + shown))
        for check in c.after:
            print(check())
    finally:
        for clean in c.cleanup:
            clean()


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    if argv == ["setup"]:
        setup()
        return 0
    by_id = {c.id: c for c in CASES}
    wanted = [c.id for c in CASES] if argv == ["all"] else argv
    unknown = [i for i in wanted if i not in by_id]
    if unknown:
        print(f"unknown case(s) {unknown}; known: {', '.join(by_id)}")
        return 2
    for i in wanted:
        run_case(by_id[i])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
