"""The GPU device check is ready to run: its script parses, and its dry run (the same steps on the
CPU with a tiny model) produces every section's numbers."""

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu" / "device_check.sh"


def test_device_check_script_parses():
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    assert subprocess.run([bash, "-n", str(SCRIPT)], capture_output=True).returncode == 0
    out = subprocess.run([bash, str(SCRIPT), "--bogus"], capture_output=True, text=True)
    assert out.returncode == 2 and "unknown argument --bogus" in out.stderr


def test_device_check_dry_run_measures_every_section(tmp_path):
    spec = importlib.util.spec_from_file_location("device_check", ROOT / "benchmarks" / "gpu" / "device_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    assert check.main(["--dry-run", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "device_check.json").read_text())
    assert not [k for k, v in results.items() if "error" in v]
    assert results["rollout"]["hf_generate_tps"] > 0 and results["rollout"]["native_eager_tps"] > 0
    # fp32 on the CPU: the rollout's log-probs are the trainer's, and "CPU vs device" is CPU vs CPU
    assert results["logprobs"]["rollout_vs_trainer_max"] < 1e-4
    assert results["logprobs"]["cpu_vs_device_fp32_max"] == 0.0
    grpo = results["grpo"]
    assert grpo["iters"] == 3 and grpo["rollout_tps"] > 0 and grpo["update_tps"] > 0
    assert 0 < grpo["mfu_update"] < 1 and grpo["peak_memory_mib"] > 0
    table = (tmp_path / "device_check.md").read_text()
    assert "| grpo | mfu_update |" in table and "Targets:" in table
