"""``posttrain preprocess``: raw rows -> chat template -> token ids -> Megatron indexed datasets.

Output: ``{output_prefix}_packed_{key}_document.{bin,idx}`` per key of the handler (and nothing
else; :func:`output_files` lists them); an input with image/video columns adds the ``images`` and
``image_meta`` datasets of :mod:`posttrain.data.media_store`. Files are written under hidden temporary names
(``.{name}_packed_{key}_document.tmp{pid}.{bin,idx}`` next to them) and renamed only when every key
is complete, so an interrupted run never leaves a dataset that looks valid; the next run at the
same prefix removes such leftovers of a run that is no longer alive.

Rows that are skipped are counted per reason; ``strict`` stops at the first (malformed line,
skipped row or line with invalid UTF-8), naming its file and line. Bytes that are not UTF-8 are
replaced by U+FFFD and counted (``rows with invalid UTF-8 (replaced)``), with one warning per file.

Filtering (the seed's): without ``pack``, a sample is skipped when any of its keys has
``>= seq_length`` tokens; with ``pack`` likewise (the seed drops only ``> seq_length`` there, but a
sample of exactly ``seq_length`` tokens cannot fit the ``seq_length - 1`` knapsack).
"""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from itertools import chain
from pathlib import Path

import numpy as np
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from transformers import AutoTokenizer

from posttrain.data.align import RowError
from posttrain.data.config import DataHandlerConfig, make_config, resolve_path, warn_inert
from posttrain.data.handlers import HANDLERS
from posttrain.data.indexed import IndexedDatasetBuilder
from posttrain.data.media import RowMedia
from posttrain.data.media_store import IMAGES_FIELD, MEDIA_DTYPES, META_FIELD
from posttrain.data.multimodal import MultimodalRows
from posttrain.data.packing import pack_samples
from posttrain.data.readers import RowReader
from posttrain.data.templates import get_template
from posttrain.errors import ConfigError, DataError
from posttrain.data.tokenizer_files import build_tokenizer, tokenizer_files

BATCH_ROWS = 1000
SKIP_TOO_LONG = "exceeds seq_length"
SKIP_MALFORMED = "malformed row"
MAX_LOGGED_PER_REASON = 5


@dataclass
class PreprocessSummary:
    """What a run did: rows read / written, rows skipped per reason, and the output prefixes."""

    rows_read: int = 0
    rows_written: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    outputs: dict[str, str] = field(default_factory=dict)  # key -> path prefix (no .bin/.idx)
    packed_rows: int | None = None
    invalid_utf8: int = 0  # rows kept with undecodable bytes replaced by U+FFFD
    seconds: float = 0.0  # reading, tokenising and writing (not imports and tokenizer loading)
    setup_seconds: float = 0.0

    @property
    def rows_skipped(self) -> int:
        return sum(self.skipped.values())

    def format(self) -> str:
        rate = self.rows_read / self.seconds if self.seconds > 0 else 0.0
        lines = [f"rows read: {self.rows_read}, rows written: {self.rows_written}, "
                 f"rows skipped: {self.rows_skipped} ({self.seconds:.1f} s, {rate:.0f} rows/s; "
                 f"setup {self.setup_seconds:.1f} s)"]
        for reason, n in sorted(self.skipped.items()):
            lines.append(f"  skipped ({reason}): {n}")
        if self.invalid_utf8:
            lines.append(f"  rows with invalid UTF-8 (replaced): {self.invalid_utf8}")
        if self.packed_rows is not None:
            lines.append(f"packed into {self.packed_rows} rows")
        lines += [f"wrote {p}.{{bin,idx}}" for p in self.outputs.values()]
        return "\n".join(lines)


@dataclass
class BatchResult:
    rows: int
    keys: dict[str, tuple[np.ndarray, np.ndarray]]  # key -> (flat int32 tokens, lengths)
    skipped: list[tuple[str, str]]  # (where, reason)
    media: list[RowMedia] | None = None  # per kept row, when the input has image/video columns


# --- the per-process work ---------------------------------------------------------------
_STATE: dict = {}


def load_tokenizer(path: str):
    try:
        tok = AutoTokenizer.from_pretrained(path, use_fast=True, trust_remote_code=False)
    except Exception as err:  # noqa: BLE001 (transformers raises many types; the user needs one message)
        raise ConfigError(f"tokenizer_name_or_path {path}: cannot load a tokenizer ({type(err).__name__}: "
                          f"{str(err).splitlines()[0] if str(err) else ''}). Give a local HF model or tokenizer directory.") from None
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    return tok


def handler_tokenizer(cfg: DataHandlerConfig):
    """The tokenizer of ``cfg``: ``tokenizer_name_or_path``'s, or one built from files (GPT-2 BPE from
    ``vocab_file`` and ``merge_file``, SentencePiece from ``tokenizer_model``;
    :mod:`posttrain.data.tokenizer_files`)."""
    files = tokenizer_files(cfg.tokenizer_type, cfg.vocab_file, cfg.merge_file, tokenizer_model=cfg.tokenizer_model)
    if files is None:
        return load_tokenizer(resolve_path(cfg.tokenizer_name_or_path))
    return build_tokenizer(replace(files, **{key: str(resolve_path(path)) for key, path in files.paths().items()}))


def build_handler(cfg: DataHandlerConfig, columns: list[str], tokenizer=None):
    cls = HANDLERS.get(cfg.handler_name)
    template = get_template(cfg.prompt_type or "empty", cfg.prompt_type_path, enable_thinking=cfg.enable_thinking)
    tokenizer = tokenizer or handler_tokenizer(cfg)
    handler = cls(cfg, tokenizer, template)
    handler.bind_columns(columns)
    image_col, video_col = handler.keys.get("images"), handler.keys.get("videos")
    handler.media = MultimodalRows(cfg, template, tokenizer, image_col, video_col) if image_col or video_col else None
    return handler


def _init_worker(cfg: DataHandlerConfig, columns: list[str]) -> None:
    _STATE["handler"] = build_handler(cfg, columns)
    _STATE["cfg"] = cfg


def _max_chars(handler, cfg) -> int | None:
    """The most characters a text can have and still be shorter than ``seq_length`` tokens (the
    tokenizer's longest token, times ``seq_length``): longer rows are skipped before they are
    tokenized, so that one huge row costs no tokenizer memory."""
    if cfg.seq_length is None:
        return None
    longest = getattr(handler, "_longest_token_chars", None)
    if longest is None:
        longest = max((len(t) for t in handler.tokenizer.get_vocab()), default=1)
        handler._longest_token_chars = longest
    return cfg.seq_length * max(longest, 1)


def _longest_text(item) -> int:
    """Characters of the prompt's turns with the system text, or of the longest response."""
    prompt = sum(len(m.get("content") or "") for m in item.prompt if isinstance(m, dict)) + len(item.system or "")
    return max(prompt, *(len(r) for r in item.responses)) if item.responses else prompt


def process_batch(rows: list[tuple[dict, str]], handler=None, cfg=None) -> BatchResult:
    """Align, encode (one batched tokenizer call) and filter one batch of rows."""
    handler = handler or _STATE["handler"]
    cfg = cfg or _STATE["cfg"]
    skipped, aligned, wheres, media = [], [], [], []  # skipped: (row number in the batch, where, reason)
    max_chars = _max_chars(handler, cfg)
    multimodal = getattr(handler, "media", None)
    for n, (row, where) in enumerate(rows):
        try:
            item = handler.align(row)
        except RowError as err:  # a row that must not be skipped (UnpairedPreferenceHandler's labels)
            raise DataError(f"{where}: {err}") from None
        if isinstance(item, str):
            skipped.append((n, where, item))
        elif max_chars is not None and _longest_text(item) > max_chars:  # cannot fit: not tokenized at all
            skipped.append((n, where, SKIP_TOO_LONG))
        else:
            media.append(multimodal.apply(row, item, where) if multimodal else None)  # bad media raises
            aligned.append(item)
            wheres.append((n, where))
    encoded = handler.encode_batch(aligned) if aligned else []
    keep, kept_media = [], []
    for enc, (n, where), row_media in zip(encoded, wheres, media):
        longest = max(len(v) for v in enc.values())
        if cfg.seq_length is not None and longest >= cfg.seq_length:
            skipped.append((n, where, SKIP_TOO_LONG))
        else:
            keep.append(enc)
            kept_media.append(row_media)
    skipped = [(where, reason) for _, where, reason in sorted(skipped, key=lambda s: s[0])]  # input order
    keys = {}
    for key in handler.output_keys():
        seqs = [enc[key] for enc in keep]
        lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
        flat = np.fromiter(chain.from_iterable(seqs), dtype=np.int32, count=int(lengths.sum()))
        keys[key] = (flat, lengths)
    return BatchResult(rows=len(rows), keys=keys, skipped=skipped, media=kept_media if multimodal else None)


# --- the job ----------------------------------------------------------------------------
class _Outputs:
    """One IndexedDatasetBuilder per key, writing to hidden temporaries until commit(); ``dtypes``
    gives a key another dtype than int32 (the images' uint8)."""

    def __init__(self, prefix: str, keys: list[str], dtypes: dict | None = None):
        self.final = {k: f"{prefix}_packed_{k}_document" for k in keys}
        remove_stale_temporaries(prefix)
        tag = f"tmp{os.getpid()}"
        self.tmp = {k: str(Path(p).parent / f".{Path(p).name}.{tag}") for k, p in self.final.items()}
        self.builders = {k: IndexedDatasetBuilder(f"{self.tmp[k]}.bin", (dtypes or {}).get(k, np.int32))
                         for k in keys}

    def add(self, key: str, flat: np.ndarray, lengths: np.ndarray) -> None:
        self.builders[key].add_items(flat, lengths)

    def add_media(self, rows: list[RowMedia]) -> None:
        """One document per row in the image and meta datasets, one sequence per image."""
        blobs, meta = self.builders[IMAGES_FIELD], self.builders[META_FIELD]
        for row in rows:
            for data, item in zip(row.blobs, row.meta):
                blobs.add_item(np.frombuffer(data, dtype=np.uint8))
                meta.add_item(item)
            blobs.end_document()
            meta.end_document()

    def commit(self) -> dict[str, str]:
        for k, b in self.builders.items():
            b.finalize(f"{self.tmp[k]}.idx")
        # every key is complete: rename all .bin files, then all .idx files (a field is visible to
        # readers only once its .idx exists, so the window with a partial set is a few renames)
        for ext in (".bin", ".idx"):
            for k in self.builders:
                os.replace(f"{self.tmp[k]}{ext}", f"{self.final[k]}{ext}")
        return dict(self.final)

    def discard(self) -> None:
        for k, b in self.builders.items():
            b.close()
            for ext in (".bin", ".idx"):
                try:
                    os.remove(self.tmp[k] + ext)
                except FileNotFoundError:
                    pass


def write_token_rows(prefix: str | Path, columns: dict[str, list[list[int]]]) -> dict[str, str]:
    """Write rows that are already token ids (one list per row and key, e.g. ``input_ids``,
    ``labels``, ``attention_mask``) as ``{prefix}_packed_{key}_document.{bin,idx}``, atomically;
    for data built in token space, such as tool-use traces whose tool outputs must keep the exact
    tokens the rollout appends."""
    prefix = str(prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    out = _Outputs(prefix, list(columns))
    try:
        for key, rows in columns.items():
            lengths = np.array([len(r) for r in rows], dtype=np.int64)
            flat = np.array([t for r in rows for t in r], dtype=np.int64)
            out.add(key, flat, lengths)
        return out.commit()
    except BaseException:
        out.discard()
        raise


def output_files(prefix: str, keys: list[str]) -> list[str]:
    """Every file a run writes at ``prefix`` for a handler with output ``keys`` (and nothing else)."""
    return [f"{prefix}_packed_{k}_document{ext}" for k in keys for ext in (".bin", ".idx")]


def remove_stale_temporaries(prefix: str) -> list[str]:
    """Remove the ``.{name}_packed_*_document.tmp<pid>.{bin,idx}`` files that a killed run at
    ``prefix`` left (those of a process still alive are kept); returns the removed paths."""
    folder, name = os.path.split(prefix)
    pattern = re.compile(re.escape(f".{name}_packed_") + r"(.+?)_document\.tmp(\d+)\.(?:bin|idx)$")
    removed = []
    try:
        entries = os.listdir(folder or ".")
    except OSError:
        return removed
    for entry in sorted(entries):
        m = pattern.match(entry)
        if not m or "_packed_" in m.group(1) or _alive(int(m.group(2))):
            continue
        path = os.path.join(folder, entry)
        try:
            os.remove(path)
            removed.append(path)
        except OSError:
            pass
    if removed:
        print(f"removed {len(removed)} temporary file(s) left by an interrupted run: "
              f"{', '.join(os.path.basename(p) for p in removed)}", file=sys.stderr)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. PermissionError: it exists
        return True
    return True


class _Progress:
    """A rich progress line on a terminal, else a log line every ``log_interval`` rows."""

    def __init__(self, enabled: bool, log_interval: int):
        self.enabled, self.log_interval, self.start = enabled, max(1, log_interval), time.perf_counter()
        self.done, self._next_log, self._bar = 0, max(1, log_interval), None
        if enabled and sys.stderr.isatty():
            self._bar = Progress(SpinnerColumn(), TextColumn("preprocess: {task.completed} rows"),
                                 TextColumn("{task.fields[rate]:.0f} rows/s"), TimeElapsedColumn(), transient=True)
            self._bar.start()
            self._task = self._bar.add_task("rows", total=None, rate=0.0)

    def update(self, n: int) -> None:
        self.done += n
        rate = self.done / max(time.perf_counter() - self.start, 1e-9)
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, rate=rate)
        elif self.enabled and self.done >= self._next_log:
            print(f"preprocess: {self.done} rows ({rate:.0f} rows/s)", file=sys.stderr)
            while self._next_log <= self.done:
                self._next_log += self.log_interval

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def _columns(first_batch: list[tuple[dict, str]]) -> list[str]:
    return list(dict.fromkeys(k for row, _ in first_batch for k in row))


def preprocess(config: dict | DataHandlerConfig, strict: bool = False, progress: bool = True) -> PreprocessSummary:
    """Run the whole job for one dataset config; returns the summary (also for the tests and the demo)."""
    cfg = make_config(config)
    warn_inert(cfg)
    start = time.perf_counter()
    summary = PreprocessSummary()
    skip_counts: Counter = Counter()
    logged: Counter = Counter()

    def note_skip(where: str, reason: str, detail: str = "") -> None:
        if strict:
            raise DataError(f"{where}: {detail or reason} (stopping because of --strict)")
        skip_counts[reason] += 1
        if logged[reason] < MAX_LOGGED_PER_REASON:
            logged[reason] += 1
            print(f"skip {where}: {detail or reason}", file=sys.stderr)

    def on_malformed(where: str, why: str) -> None:
        note_skip(where, SKIP_MALFORMED, why)

    utf8_files: set[str] = set()

    def on_invalid_utf8(where: str) -> None:
        if strict:
            raise DataError(f"{where}: invalid UTF-8 bytes (stopping because of --strict)")
        summary.invalid_utf8 += 1
        file = where.rsplit(":", 1)[0]
        if file not in utf8_files:
            utf8_files.add(file)
            print(f"warning {where}: invalid UTF-8 bytes, replaced by U+FFFD (further rows of this file with "
                  "invalid UTF-8 are only counted)", file=sys.stderr)

    media_columns = frozenset((cfg.map_keys or {}).get(k) or k for k in ("images", "videos"))
    reader = iter(RowReader(resolve_path(cfg.input), BATCH_ROWS, on_malformed, on_invalid_utf8, media_columns))
    first = next(reader, None)
    if first is None:
        raise DataError(f"input {cfg.input}: no rows to read")
    columns = _columns(first)
    tokenizer = handler_tokenizer(cfg)
    handler = build_handler(cfg, columns, tokenizer)
    prefix = _output_prefix(cfg)
    outputs = _open_outputs(prefix, cfg, handler)
    bar = _Progress(progress, cfg.log_interval)
    summary.setup_seconds = time.perf_counter() - start
    start = time.perf_counter()
    packed: dict[str, list[np.ndarray]] = {"input_ids": [], "labels": []}
    try:
        for result in _results(cfg, columns, chain([first], reader), handler):
            summary.rows_read += result.rows
            for where, reason in result.skipped:
                note_skip(where, reason)
            n_kept = len(next(iter(result.keys.values()))[1]) if result.keys else 0
            summary.rows_written += n_kept
            if cfg.pack:
                for key in packed:
                    flat, lengths = result.keys[key]
                    packed[key].extend(np.split(flat, np.cumsum(lengths)[:-1]) if len(lengths) else [])
            else:
                for key, (flat, lengths) in result.keys.items():
                    outputs.add(key, flat, lengths)
            if result.media is not None:
                outputs.add_media(result.media)
            bar.update(result.rows)
        if cfg.pack:
            summary.packed_rows = _write_packed(outputs, packed, cfg, tokenizer)
        if summary.rows_written == 0:
            raise DataError(f"input {cfg.input}: every row was skipped ({dict(skip_counts)}); nothing written")
        summary.outputs = outputs.commit()
    except OSError as err:
        outputs.discard()
        raise _write_failed(prefix, err) from None
    except BaseException:
        outputs.discard()
        raise
    finally:
        bar.close()
    summary.skipped = dict(skip_counts)
    summary.rows_read += skip_counts[SKIP_MALFORMED]  # lines that never became rows
    summary.seconds = time.perf_counter() - start
    return summary


def _open_outputs(prefix: str, cfg: DataHandlerConfig, handler) -> _Outputs:
    """The handler's keys, and the image datasets when the input has image/video columns."""
    media_keys = list(MEDIA_DTYPES) if handler.media else []
    if media_keys and cfg.pack:
        raise ConfigError("pack: true cannot pack multimodal rows (the input has image/video columns); set pack: "
                          "false for multimodal data")
    return _Outputs(prefix, handler.output_keys() + media_keys, MEDIA_DTYPES)


def _write_failed(prefix: str, err: OSError) -> Exception:
    """A disk that fills while the dataset is written, as one message naming ``output_prefix``
    (other errors are raised as they are)."""
    if err.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return err
    return DataError(f"output_prefix {prefix}: writing the dataset failed: {err.strerror} (the disk is full or the "
                     f"file too large); nothing was written and the temporary files are removed. Free some space or "
                     f"give an output_prefix on another disk")


def _results(cfg, columns, batches, handler):
    if cfg.workers <= 1:
        for batch in batches:
            yield process_batch(batch, handler, cfg)
        return
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with mp.get_context("fork" if sys.platform == "linux" else "spawn").Pool(
            cfg.workers, initializer=_init_worker, initargs=(cfg, columns)) as pool:
        yield from pool.imap(process_batch, batches, chunksize=1)


def _write_packed(outputs: _Outputs, packed: dict, cfg: DataHandlerConfig, tokenizer) -> int:
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    try:
        rows = pack_samples(packed["input_ids"], packed["labels"], cfg.seq_length, pad_id or 0, cfg.neat_pack)
    except MemoryError:
        raise DataError(f"seq_length={cfg.seq_length}: packed rows of that length do not fit in memory; give a "
                        f"smaller seq_length") from None
    for key, seqs in rows.items():
        if seqs:
            outputs.add(key, np.concatenate(seqs), np.full(len(seqs), cfg.seq_length))
    return len(rows["input_ids"])


def _output_prefix(cfg: DataHandlerConfig) -> str:
    prefix = resolve_path(cfg.output_prefix)
    parent = Path(prefix).parent
    if not parent.is_dir():
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"output_prefix {prefix}: cannot create the directory {parent}: {err}") from None
        print(f"created output directory {parent}", file=sys.stderr)
    return prefix
