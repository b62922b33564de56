"""The search tool (posttrain.tools.search.LocalSearch): BM25 puts the right passage first, the output
is numbered "Doc n (Title: ...): text", and a bad corpus line is a ConfigError naming file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.errors import ConfigError
from posttrain.tools.base import ToolError
from posttrain.tools.search import LocalSearch, load_corpus, tokenize

SCHEMA = {"type": "function", "function": {
    "name": "search", "description": "Searches.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "top_k": {"type": "integer"}},
                   "required": ["query"]}}}

ROWS = [
    {"id": "a", "title": "Volcano", "contents": "A volcano erupts lava, ash and gas from a magma chamber."},
    {"id": "b", "title": "Glacier", "contents": "A glacier is a slow river of ice that carves valleys."},
    {"id": "c", "title": "Desert", "text": "A desert receives very little rain; the Sahara is the largest hot desert."},
    {"id": "d", "contents": "\"Coral reef\"\nCoral reefs are built by tiny animals in warm, shallow seas."},
    {"id": "e", "title": "Rainforest", "contents": "A rainforest gets heavy rain all year and holds most land species."},
]


def _corpus(tmp_path: Path, rows=ROWS, extra: str = "") -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n" + extra, encoding="utf-8")
    return path


def test_tokenize_is_lowercase_words():
    assert tokenize("Hello, World! It's 42.") == ["hello", "world", "it", "s", "42"]


@pytest.mark.parametrize("query,first", [
    ("where does lava come from", "Volcano"),
    ("river of ice", "Glacier"),
    ("largest hot desert Sahara", "Desert"),
    ("animals building reefs in shallow seas", "Coral reef"),  # title from the first line of contents
    ("heavy RAIN all year", "Rainforest"),  # case-insensitive; "rain" is also in Desert
])
def test_the_right_passage_comes_first(tmp_path, query, first):
    tool = LocalSearch(SCHEMA, corpus_path=str(_corpus(tmp_path)))
    out = tool.execute({"query": query})
    assert out.splitlines()[0].startswith(f"Doc 1 (Title: {first}): ")


def test_output_is_numbered_and_limited_to_top_k(tmp_path):
    tool = LocalSearch(SCHEMA, corpus_path=str(_corpus(tmp_path)), top_k=2)
    out = tool.execute({"query": "a rain river volcano"})
    lines = out.splitlines()
    assert [line.split(" (")[0] for line in lines] == ["Doc 1", "Doc 2"]
    assert lines[0] == "Doc 1 (Title: Volcano): A volcano erupts lava, ash and gas from a magma chamber."
    assert len(tool.execute({"query": "a rain river volcano", "top_k": 4}).splitlines()) == 4
    # only passages that share a word with the query count as hits
    assert len(tool.execute({"query": "lava", "top_k": 5}).splitlines()) == 1


def test_no_hit_is_a_clear_sentence(tmp_path):
    tool = LocalSearch(SCHEMA, corpus_path=str(_corpus(tmp_path)))
    assert tool.execute({"query": "quantum chromodynamics"}) == (
        "No passage matches the query 'quantum chromodynamics'; try other words.")


def test_bad_queries_are_tool_errors(tmp_path):
    tool = LocalSearch(SCHEMA, corpus_path=str(_corpus(tmp_path)))
    with pytest.raises(ToolError, match="at least one word"):
        tool.execute({"query": "?!"})
    with pytest.raises(ToolError, match="top_k must be a whole number from 1 to 20"):
        tool.execute({"query": "lava", "top_k": 0})


def test_a_passage_without_title(tmp_path):
    path = _corpus(tmp_path, rows=[{"text": "Plain passage about owls."}])
    tool = LocalSearch(SCHEMA, corpus_path=path.name, base_dir=tmp_path)  # relative to base_dir
    assert tool.execute({"query": "owls"}) == "Doc 1: Plain passage about owls."


@pytest.mark.parametrize("extra,message", [
    ("{not json\n", r"corpus\.jsonl: line 7: not valid JSON"),
    ("[1, 2]\n", r"corpus\.jsonl: line 7: a JSON list, not an object"),
    ('{"title": "x"}\n', r"corpus\.jsonl: line 7: the passage has no \"contents\" or \"text\""),
    ('{"contents": "  "}\n', r"corpus\.jsonl: line 7: the passage has an empty or non-string 'contents'"),
    ('{"contents": "x", "title": 3}\n', r"corpus\.jsonl: line 7: \"title\" must be a string"),
], ids=["json", "list", "no-text", "empty", "title"])
def test_a_bad_corpus_line_names_file_and_line(tmp_path, extra, message):
    path = _corpus(tmp_path, extra="\n" + extra)  # 5 rows, a blank line 6 (skipped), the bad line 7
    with pytest.raises(ConfigError, match=message):
        load_corpus(path)


def test_a_missing_or_empty_corpus(tmp_path):
    with pytest.raises(ConfigError, match="does not exist; check corpus_path"):
        LocalSearch(SCHEMA, corpus_path="nope.jsonl", base_dir=tmp_path)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="empty.jsonl: the search corpus is empty"):
        LocalSearch(SCHEMA, corpus_path=str(tmp_path / "empty.jsonl"))
