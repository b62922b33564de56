"""The ``search`` tool: BM25 retrieval over a local JSONL corpus.

A stand-in for the seed's retrieval service (a server holding a dense index of Wikipedia): the
same kind of answer, from a file, with no server and no GPU. The corpus has one JSON object per
line::

    {"id": "3", "title": "Rank-BM25", "contents": "BM25 ranks documents by ..."}

with the passage in ``contents`` or ``text`` and optional ``title`` and ``id``. As in the
FlashRAG / Search-R1 Wikipedia dump, a ``contents`` without a ``title`` whose first line is short
is read as ``"Title"\\npassage``. Words are lowercase ``\\w+`` runs; a passage is a hit when it
shares at least one word with the query.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.errors import ConfigError
from posttrain.tools.base import Tool, ToolError, register_tool

MAX_TOP_K = 20
"""The most passages one call may ask for (argument ``top_k``)."""
_WORD = re.compile(r"\w+")
_TITLE_LINE_CHARS = 200  # a first line up to this long may be a title (FlashRAG layout)


def tokenize(text: str) -> list[str]:
    """Lowercase ``\\w+`` words."""
    return _WORD.findall(text.lower())


@dataclass(frozen=True)
class Passage:
    """One corpus line."""

    text: str
    title: str | None = None
    id: str | None = None


def load_corpus(path: Path) -> list[Passage]:
    """The passages of a JSONL corpus; ConfigError naming the file and line for a bad line."""
    if not path.is_file():
        raise ConfigError(f"{path}: the search corpus does not exist; check corpus_path (a relative path "
                          f"is read from the tools file's folder)")
    passages = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            at = f"{path}: line {lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{at}: not valid JSON ({e.msg} at column {e.colno}); write one JSON "
                                  f"object per line") from e
            if not isinstance(row, dict):
                raise ConfigError(f"{at}: a JSON {type(row).__name__}, not an object with \"contents\" "
                                  f"or \"text\"")
            passages.append(_passage(row, at))
    if not passages:
        raise ConfigError(f"{path}: the search corpus is empty; write one JSON object per line")
    return passages


def _passage(row: dict[str, Any], at: str) -> Passage:
    key = "contents" if "contents" in row else "text"
    text, title, pid = row.get(key), row.get("title"), row.get("id")
    if not isinstance(text, str) or not text.strip():
        got = "has no \"contents\" or \"text\"" if key not in row else f"has an empty or non-string {key!r}"
        raise ConfigError(f"{at}: the passage {got}; give the passage as a string in \"contents\" or \"text\"")
    if title is not None and not isinstance(title, str):
        raise ConfigError(f"{at}: \"title\" must be a string, not {type(title).__name__}")
    if title is None and key == "contents" and "\n" in text:
        first, rest = text.split("\n", 1)
        if len(first) <= _TITLE_LINE_CHARS and rest.strip():
            title, text = first.strip().strip('"').strip(), rest
    return Passage(text=text.strip(), title=title or None, id=None if pid is None else str(pid))


@register_tool("search")
class LocalSearch(Tool):
    """Searches a local corpus with BM25 (Okapi) and returns the ``top_k`` best passages.

    Config: ``corpus_path`` (JSONL; relative paths are read from ``base_dir``, the tools file's
    folder when loaded from one), ``top_k`` (passages per call; the model may pass its own ``top_k``
    argument, up to :data:`MAX_TOP_K`, when the schema declares it).
    """

    def __init__(self, schema: dict, *, corpus_path: str, top_k: int = 3, base_dir: str | Path | None = None):
        super().__init__(schema)
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be a positive whole number, not {top_k!r}")
        path = Path(corpus_path)
        if not path.is_absolute() and base_dir is not None:
            path = Path(base_dir) / path
        self.corpus_path, self.top_k = path, top_k
        self.passages = load_corpus(path)
        self._words = [frozenset(tokenize(_indexed(p))) for p in self.passages]
        try:
            from rank_bm25 import BM25Okapi
        except ImportError as e:
            raise ConfigError("the search tool needs the rank-bm25 package: pip install rank-bm25") from e
        self._bm25 = BM25Okapi([tokenize(_indexed(p)) for p in self.passages])

    def search(self, query: str, top_k: int | None = None) -> list[tuple[Passage, float]]:
        """The best passages for ``query`` with their BM25 scores, best first (ties: corpus order)."""
        words = tokenize(query)
        if not words:
            return []
        scores = self._bm25.get_scores(words)
        hits = [i for i, doc in enumerate(self._words) if not doc.isdisjoint(words)]
        hits.sort(key=lambda i: -scores[i])  # stable: equal scores keep corpus order
        return [(self.passages[i], float(scores[i])) for i in hits[: top_k or self.top_k]]

    def execute(self, arguments: dict[str, Any]) -> str:
        query, top_k = arguments.get("query"), arguments.get("top_k", self.top_k)
        if not isinstance(query, str) or not tokenize(query):
            raise ToolError(f'{self.name} needs "query": a string with at least one word to search for')
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= MAX_TOP_K:
            raise ToolError(f"top_k must be a whole number from 1 to {MAX_TOP_K}, not {top_k!r}")
        found = self.search(query, top_k)
        if not found:
            return f"No passage matches the query {query!r}; try other words."
        return "\n".join(_format(n, p) for n, (p, _) in enumerate(found, 1))


def _indexed(p: Passage) -> str:
    return f"{p.title}\n{p.text}" if p.title else p.text


def _format(n: int, p: Passage) -> str:
    return f"Doc {n} (Title: {p.title}): {p.text}" if p.title else f"Doc {n}: {p.text}"
