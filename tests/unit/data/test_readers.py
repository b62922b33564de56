"""The one JSON Lines reader: strict (errors name file and line) and lenient (bad lines skipped)."""

from __future__ import annotations

import pytest

from posttrain.data.readers import iter_jsonl, read_jsonl
from posttrain.errors import DataError


@pytest.fixture
def lines(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\n[3]\n{"a": 4, "b"\n', encoding="utf-8")
    return path


def test_strict_names_the_first_bad_line(lines):
    with pytest.raises(DataError, match=r"in\.jsonl:4: expected a JSON object, got list"):
        read_jsonl(lines, strict=True)
    lines.write_text('{"a": 1}\n{"a": 2', encoding="utf-8")  # a truncated last line
    with pytest.raises(DataError, match=r"in\.jsonl:2: malformed JSON"):
        read_jsonl(lines, strict=True)
    with pytest.raises(DataError, match="nope.jsonl: no such file"):
        read_jsonl(lines.with_name("nope.jsonl"), strict=True)


def test_lenient_skips_bad_lines_and_where_counts_blank_lines(lines):
    assert read_jsonl(lines, strict=False) == [{"a": 1}, {"a": 2}]
    bad = []
    rows = list(iter_jsonl(lines, lambda where, why: bad.append(where)))
    assert [where for _, where in rows] == [f"{lines}:1", f"{lines}:3"]
    assert bad == [f"{lines}:4", f"{lines}:5"]


def test_a_duplicate_key_and_a_json_array_are_named(tmp_path):
    """Probes CM5, CM21, CM31 (a key written twice in one row: JSON keeps the last silently) and
    CM2, CM18 (a JSON array where JSON Lines are read)."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"a": 1}\n{"a": 1, "b": {"c": 1, "c": 2}}\n')
    with pytest.raises(DataError, match=r"d.jsonl:2: duplicate key 'c' in one object"):
        list(iter_jsonl(path))
    path.write_text('[\n {"a": 1}\n]\n')
    with pytest.raises(DataError, match=r"d.jsonl:1: the file is a JSON array, not JSON Lines"):
        list(iter_jsonl(path))
