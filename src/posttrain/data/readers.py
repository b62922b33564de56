"""Raw input: a file, or a directory of json/jsonl/parquet/csv/arrow files (most frequent extension).

Rows come out in batches of ``(row_dict, where)`` pairs, ``where`` being ``file:line`` (JSON Lines) or
``file:row N``, so that later errors can name the row. JSON Lines are parsed line by line with the
``json`` module, so that one malformed line is reported (file and line number) and skipped instead
of failing the whole file; Parquet, CSV and Arrow are read with pyarrow, a JSON array with ``json``.

:func:`read_jsonl` (and :func:`iter_jsonl`, which also gives each row's ``file:line``) is the one
JSON Lines reader of the package: datasets, ``posttrain score`` / ``eval`` inputs, metrics files.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from posttrain.errors import DataError

FORMATS = {"json": "json", "jsonl": "jsonl", "parquet": "parquet", "arrow": "arrow", "csv": "csv"}
Row = tuple[dict, str]


@dataclass
class InputFiles:
    fmt: str
    paths: list[Path] = field(default_factory=list)


def find_input_files(input_path: str | Path) -> InputFiles:
    """The files to read and their format; a directory uses its most frequent supported extension."""
    path = Path(input_path)
    if path.is_file():
        ext = path.suffix.lstrip(".").lower()
        if ext not in FORMATS:
            raise DataError(f"input {path}: unsupported file type '.{ext}'; supported: "
                            f"{', '.join('.' + e for e in FORMATS)}")
        return InputFiles(FORMATS[ext], [path])
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lstrip(".").lower() in FORMATS)
        if not files:
            raise DataError(f"input {path}: the directory has no {'/'.join(FORMATS)} files")
        counts = Counter(p.suffix.lstrip(".").lower() for p in files)
        ext = max(counts, key=lambda e: (counts[e], e))  # ties broken by name, deterministically
        return InputFiles(FORMATS[ext], [p for p in files if p.suffix.lstrip(".").lower() == ext])
    raise DataError(f"input {path}: no such file or directory (relative paths are relative to {os.getcwd()})")


class DuplicateKey(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _object_without_duplicates(pairs: list[tuple[str, object]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        raise DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return obj


def iter_jsonl(path: str | Path, on_malformed: Callable[[str, str], None] | None = None,
               on_invalid_utf8: Callable[[str], None] | None = None) -> Iterator[Row]:
    """``(object, "file:line")`` for each non-blank line of a JSON Lines file.

    A line that is not JSON, not a JSON object, or an object with a key written twice goes to
    ``on_malformed(where, why)`` and is skipped; the default raises :class:`DataError` naming the file and line. A UTF-8 byte order
    mark is accepted. Bytes that are not UTF-8 become U+FFFD; ``on_invalid_utf8(where)`` hears of
    each such line (it may raise to stop).
    """
    on_malformed = on_malformed or _raise_malformed
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    with open(path, encoding="utf-8-sig", errors="surrogateescape") as f:
        first = True
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            if first and line.lstrip().startswith("["):
                raise DataError(f"{where}: the file is a JSON array, not JSON Lines (one JSON object per line); "
                                f"write one object per line (e.g. python -c \"import json,sys; [print(json.dumps(r)) "
                                f"for r in json.load(sys.stdin)]\" < in.json > out.jsonl)")
            first = False
            line = _valid_utf8(line, where, on_invalid_utf8)
            try:
                obj = json.loads(line, object_pairs_hook=_object_without_duplicates)
            except json.JSONDecodeError as err:
                on_malformed(where, f"malformed JSON ({err.msg} at column {err.colno})")
                continue
            except DuplicateKey as err:
                on_malformed(where, f"duplicate key {err.key!r} in one object (JSON would keep only the last "
                                    f"value, silently); keep one")
                continue
            if not isinstance(obj, dict):
                on_malformed(where, f"expected a JSON object, got {type(obj).__name__}")
                continue
            yield obj, where


def read_jsonl(path: str | Path, *, strict: bool) -> list[dict]:
    """The objects of a JSON Lines file, blank lines skipped.

    ``strict``: a malformed line raises :class:`DataError` naming the file and line. Otherwise it
    is skipped (for files a killed run may have left with a truncated last line, e.g. metrics.jsonl).
    """
    return [obj for obj, _ in iter_jsonl(path, None if strict else _skip_malformed)]


class RowReader:
    """Iterate over rows of the input in batches; malformed rows go to ``on_malformed(where, why)``."""

    def __init__(self, input_path: str | Path, batch_size: int = 1000,
                 on_malformed: Callable[[str, str], None] | None = None,
                 on_invalid_utf8: Callable[[str], None] | None = None, binary_columns: frozenset[str] = frozenset()):
        self.files = find_input_files(input_path)
        self.binary_columns = binary_columns  # their binary cells stay bytes (image columns)
        self.batch_size = batch_size
        self.on_malformed = on_malformed or _raise_malformed
        self.on_invalid_utf8 = on_invalid_utf8  # None: undecodable bytes become U+FFFD silently

    def __iter__(self) -> Iterator[list[Row]]:
        batch: list[Row] = []
        for path in self.files.paths:
            for row in _READERS[self.files.fmt](self, path):
                batch.append(row)
                if len(batch) >= self.batch_size:
                    yield batch
                    batch = []
        if batch:
            yield batch

    def _bad(self, where: str, why: str) -> None:
        self.on_malformed(where, why)

    # --- formats ---------------------------------------------------------------------
    def _jsonl(self, path: Path) -> Iterator[Row]:
        yield from iter_jsonl(path, self._bad, self.on_invalid_utf8)

    def _json(self, path: Path) -> Iterator[Row]:
        with open(path, encoding="utf-8-sig", errors="replace") as f:
            head = f.read(4096).lstrip()
        if not head.startswith("["):
            yield from self._jsonl(path)  # many ".json" files are JSON Lines
            return
        try:
            raw = path.read_text(encoding="utf-8-sig", errors="surrogateescape")
            dirty = _valid_utf8(raw, str(path), None) is not raw  # only then look at each item
            data = json.loads(raw)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{err.lineno}: malformed JSON array ({err.msg} at column {err.colno}); "
                            "a JSON array cannot be read past an error, fix the file or convert it to JSON Lines") from None
        for i, obj in enumerate(data):
            where = f"{path}:item {i}"
            if not isinstance(obj, dict):
                self._bad(where, f"expected a JSON object, got {type(obj).__name__}")
                continue
            if dirty:
                text = json.dumps(obj, ensure_ascii=False)
                if _valid_utf8(text, where, self.on_invalid_utf8) is not text:
                    obj = json.loads(text.encode("utf-8", "surrogateescape").decode("utf-8", "replace"))
            yield obj, where

    def _record_batches(self, path: Path):
        import pyarrow as pa  # lazy: Parquet/CSV/Arrow only; JSONL needs no pyarrow

        fmt = self.files.fmt
        try:
            if fmt == "parquet":
                import pyarrow.parquet as pq

                yield from pq.ParquetFile(path).iter_batches(batch_size=self.batch_size)
            elif fmt == "csv":
                import pyarrow.csv as pcsv

                yield from pcsv.open_csv(path)
            else:  # arrow: HF datasets writes the IPC stream format; also accept the file format
                with pa.memory_map(str(path)) as source:
                    try:
                        reader = pa.ipc.open_stream(source)
                    except pa.ArrowInvalid:
                        reader = pa.ipc.open_file(source)
                        for i in range(reader.num_record_batches):
                            yield reader.get_batch(i)
                        return
                    yield from reader
        except (pa.ArrowInvalid, OSError) as err:
            raise DataError(f"{path}: cannot read as {fmt}: {err}") from None

    def _columnar(self, path: Path) -> Iterator[Row]:
        import pyarrow as pa  # lazy: as in _record_batches

        n = 0
        for batch in self._record_batches(path):
            binary = [f.name for f in batch.schema if f.name not in self.binary_columns
                      and (pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type))]
            for row in batch.to_pylist():
                where = f"{path}:row {n}"
                for name in binary:  # e.g. a CSV column with bytes that are not UTF-8
                    if isinstance(row[name], bytes):
                        row[name] = _decode_cell(row[name], where, self.on_invalid_utf8)
                yield row, where
                n += 1


_READERS = {"json": RowReader._json, "jsonl": RowReader._jsonl, "parquet": RowReader._columnar,
            "csv": RowReader._columnar, "arrow": RowReader._columnar}


def _valid_utf8(line: str, where: str, on_invalid_utf8: Callable[[str], None] | None) -> str:
    """``line`` (decoded with surrogateescape) with its undecodable bytes replaced by U+FFFD."""
    try:
        line.encode("utf-8")
        return line
    except UnicodeEncodeError:
        if on_invalid_utf8 is not None:
            on_invalid_utf8(where)
        return line.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _decode_cell(value: bytes, where: str, on_invalid_utf8: Callable[[str], None] | None) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        if on_invalid_utf8 is not None:
            on_invalid_utf8(where)
        return value.decode("utf-8", "replace")


def _raise_malformed(where: str, why: str) -> None:
    raise DataError(f"{where}: {why}")


def _skip_malformed(where: str, why: str) -> None:
    pass
