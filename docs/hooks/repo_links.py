"""MkDocs hook: links from a docs page to files of the repository outside ``docs/`` (``../README.md``,
``../benchmarks/README.md``) become the file's path in code, since the site holds only ``docs/``; a
link to a file that does not exist is a warning, which ``mkdocs build --strict`` turns into a
failure, as it does for broken links between pages."""

from __future__ import annotations

import logging
import re
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.repo_links")
LINK = re.compile(r"(?<!!)\[([^\]]+)\]\((\.\./[^)#\s]+)(#[^)]*)?\)")


def on_page_markdown(markdown: str, page, config, files) -> str:
    docs = Path(config["docs_dir"]).resolve()
    here = (docs / page.file.src_path).parent

    def replace(match: re.Match) -> str:
        text, target = match.group(1), match.group(2)
        path = (here / target).resolve()
        try:
            path.relative_to(docs)
            return match.group(0)  # inside docs/: MkDocs checks it
        except ValueError:
            pass
        repo = docs.parent
        if not path.exists():
            log.warning("%s: link to %s, which does not exist", page.file.src_path, target)
            return match.group(0)
        shown = path.relative_to(repo).as_posix() + ("/" if path.is_dir() else "")
        plain = text.strip("`")
        return f"`{shown}`" if plain in (target, shown, target.lstrip("./")) else f"{text} (`{shown}`)"

    return LINK.sub(replace, markdown)
