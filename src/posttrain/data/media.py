"""Images and video frames of multimodal rows: read from the input's cells, checked, counted.

A row's ``images`` column (``map_keys.images`` names another) holds one image or a list of them;
its ``videos`` column (``map_keys.videos``) a list of videos, each a list of frame images (video
files are not decoded: give the frames). An image cell is any of:

* a path string, relative to the data file's folder (the common JSONL form);
* ``{"bytes": ..., "path": ...}`` (the Hugging Face ``Image`` feature, also Parquet's struct):
  ``bytes`` as raw bytes (Parquet) or base64 text (JSONL) win over ``path``;
* raw bytes (a Parquet binary column);
* a PIL image (rows built in Python), stored as PNG.

The encoded bytes are kept as they are (a JPEG stays a JPEG): they are decoded once here, to
refuse a corrupt file and to record the image's height and width, and again only when a batch
needs the pixels. The prompt text marks where each goes with ``<image>`` / ``<video>``; their
count must equal the row's images / videos, and each is replaced by the chat template's
placeholder (``image_placeholder`` / ``video_placeholder`` of templates.json, e.g.
``<|vision_start|><|image_pad|><|vision_end|>`` for ``qwen2_vl``). The one ``<|image_pad|>`` is
not expanded to the image's token count here: that is the processor's job at batch time.

Bad input is refused (a :class:`DataError` naming the row and the file), never skipped: a missing
or undecodable image, images for a template or tokenizer without image tokens, more images than
``limit_mm_image_per_prompt`` (videos: ``limit_mm_video_per_prompt``), placeholders that do not
match the images.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.errors import DataError

IMAGE_MARK = "<image>"
VIDEO_MARK = "<video>"
NO_VIDEO = -1  # the meta of an image that is not a video frame


@dataclass
class RowMedia:
    """One prompt's media: encoded images then video frames, and per item (video, height, width)."""

    blobs: list[bytes] = field(default_factory=list)
    meta: list[tuple[int, int, int]] = field(default_factory=list)  # video index or NO_VIDEO, height, width
    names: list[str] = field(default_factory=list)  # file path or cell name, for messages


def source_file(where: str) -> Path:
    """The data file of a ``file:line`` / ``file:row N`` location."""
    return Path(where.rsplit(":", 1)[0])


def encode_cell(value: Any, where: str, what: str) -> tuple[bytes, str]:
    """One image cell as (encoded bytes, a name for messages: its path or ``what``)."""
    base = source_file(where).parent
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
        if data:
            return _bytes_of(data, where, what), str(path or what)
        if path:
            return _read_file(str(path), base, where, what)
        raise DataError(f"{where}: {what} is a dict without 'bytes' or 'path'; give one of them")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value), what
    if isinstance(value, str):
        return _read_file(value, base, where, what)
    if hasattr(value, "save") and hasattr(value, "size"):  # a PIL image
        buf = io.BytesIO()
        value.save(buf, format="PNG")
        return buf.getvalue(), what
    raise DataError(f"{where}: {what} is a {type(value).__name__}; give a path, bytes, "
                    f"{{\"bytes\": ..., \"path\": ...}} or a PIL image")


def _bytes_of(data: Any, where: str, what: str) -> bytes:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    if isinstance(data, str):
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise DataError(f"{where}: {what} 'bytes' is text but not base64; give base64 text or a path") from None
    raise DataError(f"{where}: {what} 'bytes' is a {type(data).__name__}; give bytes or base64 text")


def _read_file(path: str, base: Path, where: str, what: str) -> tuple[bytes, str]:
    full = Path(path).expanduser()
    if not full.is_absolute():
        full = base / full
    try:
        return full.read_bytes(), str(full)
    except FileNotFoundError:
        raise DataError(f"{where}: {what}: image file {full} not found (relative paths are relative to the data "
                        f"file's folder {base})") from None
    except (OSError, ValueError) as err:  # ValueError: a path with a NUL byte (bytes given as text?)
        raise DataError(f"{where}: {what}: cannot read image file {str(full)[:200]!r}: "
                        f"{getattr(err, 'strerror', None) or err}; give a path, or the bytes as {{\"bytes\": ...}}") from None


def image_size(data: bytes, where: str, name: str) -> tuple[int, int]:
    """(height, width) of encoded image bytes, decoding them fully once to refuse corrupt files."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            width, height = img.size
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise DataError(f"{where}: image {name} cannot be decoded ({type(err).__name__}: {err}); fix or remove "
                        f"the file") from None
    return height, width


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def read_row_media(row: dict, where: str, image_col: str | None, video_col: str | None) -> RowMedia:
    """The images and video frames of one row, encoded bytes with their sizes (videos after images)."""
    media = RowMedia()
    for i, cell in enumerate(_as_list(row.get(image_col)) if image_col else []):
        data, name = encode_cell(cell, where, f"{image_col}[{i}]")
        media.blobs.append(data)
        media.meta.append((NO_VIDEO, *image_size(data, where, name)))
        media.names.append(name)
    for v, video in enumerate(_as_list(row.get(video_col)) if video_col else []):
        if not isinstance(video, (list, tuple)) or not video:
            raise DataError(f"{where}: {video_col}[{v}] is not a list of frame images (video files are not "
                            f"decoded); give each video as a non-empty list of frames")
        for f, cell in enumerate(video):
            data, name = encode_cell(cell, where, f"{video_col}[{v}][{f}]")
            media.blobs.append(data)
            media.meta.append((v, *image_size(data, where, name)))
            media.names.append(name)
    return media


def count_media(media: RowMedia) -> tuple[int, int]:
    """(images, videos) of a row."""
    images = sum(1 for m in media.meta if m[0] == NO_VIDEO)
    videos = len({m[0] for m in media.meta if m[0] != NO_VIDEO})
    return images, videos
