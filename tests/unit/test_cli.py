"""The ``posttrain`` command line (cli.py): where its global flags go."""

from __future__ import annotations

import pytest

from tests.helpers.runs import run_cli


def test_debug_is_accepted_after_the_subcommand(capsys, tmp_path):
    """Probe X5: ``posttrain train ... --debug``, the flag after the subcommand, as a user writes it."""
    from posttrain.cli import build_parser, main
    from posttrain.errors import ConfigError

    assert build_parser().parse_args(["train", "--config-name", "x", "--debug"]).debug is True
    assert build_parser().parse_args(["--debug", "train", "--config-name", "x"]).debug is True
    assert build_parser().parse_args(["train", "--config-name", "x"]).debug is False
    argv = ["plan", "--config-path", str(tmp_path), "--config-name", "nonexistent"]
    assert run_cli(argv, capsys)[0] == 2
    with pytest.raises(ConfigError, match="nonexistent"):  # --debug: the traceback, as documented
        main(argv + ["--debug"])


def test_a_closed_stdout_is_not_a_traceback():
    """Probe CM50: ``posttrain plan ... | head -1``: the reader goes away; no BrokenPipeError traceback."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "posttrain", "plan", "--config-only", "--config-name",
                             "grpo_tiny_qwen2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().startswith(b"config ")
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait() in (0, 141) and "Traceback" not in err and "BrokenPipe" not in err
