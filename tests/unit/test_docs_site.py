"""The docs site (mkdocs.yml, MkDocs Material) builds in strict mode: a broken link between pages, a
link out of docs/ to a missing file (docs/hooks/repo_links.py), a missing anchor or a page left out of
the navigation fails; and the generated CLI reference is what the parsers print."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from posttrain.commands import cli_reference
from posttrain.paths import PROJECT_ROOT


def test_the_cli_reference_is_current():
    assert cli_reference.DOC_PATH.read_text() == cli_reference.render(), \
        "docs/cli.md is stale: python -m posttrain.commands.cli_reference --write"


def test_the_site_builds_in_strict_mode(tmp_path):
    mkdocs = Path(sys.executable).parent / "mkdocs"
    out = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=PROJECT_ROOT,
                         capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (tmp_path / "site" / "cli" / "index.html").is_file() and (tmp_path / "site" / "search").is_dir()
