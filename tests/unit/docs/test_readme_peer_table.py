"""The README's peer table claims only what a test runs: every test path its posttrain column names exists."""

from __future__ import annotations

import re

from posttrain.paths import PROJECT_ROOT


def test_every_test_the_peer_table_names_exists():
    text = (PROJECT_ROOT / "README.md").read_text()
    table = text[text.index("## Compared with the peers"):]
    table = table[:table.index("\n## ")]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| feature")]
    assert len(rows) >= 15
    for row in rows:
        cell = row.rstrip(" |").rsplit("|", 1)[-1]
        paths = re.findall(r"`(tests/[^`]+)`", cell)
        assert paths or "make test" in cell, row  # each posttrain claim names its test
        for path in paths:
            assert (PROJECT_ROOT / path).exists(), f"README peer table names {path}, which does not exist"
