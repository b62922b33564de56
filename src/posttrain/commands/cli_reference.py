"""The command-line reference, ``docs/cli.md``, generated from the argument parsers themselves.

    python -m posttrain.commands.cli_reference            # print it
    python -m posttrain.commands.cli_reference --write    # rewrite docs/cli.md

``tests/unit/commands/test_cli_reference.py`` fails when the file differs from what the parsers
print, so the reference cannot go stale.
"""

from __future__ import annotations

import argparse
import os
import sys

from posttrain.cli import build_parser
from posttrain.paths import PROJECT_ROOT

DOC_PATH = PROJECT_ROOT / "docs" / "cli.md"
WIDTH = "100"  # argparse wraps help to $COLUMNS: fixed, so the page is the same on every terminal


def render() -> str:
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        parser = build_parser()
        (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parts = ["# Command-line reference", "",
                 "Generated from the argument parsers (`python -m posttrain.commands.cli_reference --write`). "
                 "Every command also runs as `python -m posttrain ...`; the Python API is in the README.", "",
                 "```text", parser.format_help().rstrip(), "```"]
        for name, command in sub.choices.items():
            parts += ["", f"## posttrain {name}", "", "```text", command.format_help().rstrip(), "```"]
        return "\n".join(parts) + "\n"
    finally:
        if saved is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite {DOC_PATH}")
    if parser.parse_args(argv).write:
        DOC_PATH.write_text(render())
    else:
        print(render(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
