"""Where a multimodal dataset keeps its images: two Megatron indexed datasets beside the text.

``{prefix}_packed_images_document.{bin,idx}``  uint8: one sequence per image (the encoded file's
                                               bytes, PNG/JPEG/... as given), one document per prompt
``{prefix}_packed_image_meta_document.{bin,idx}`` int32: one sequence ``(video, height, width)`` per
                                               image, the same documents; ``video`` is -1 for an
                                               image, else the index of the video the frame is in

Document ``i`` belongs to text row ``i`` of the written files (a prompt without media has an empty
document; rows that preprocessing skipped have neither). A training dataset that filters or splits
rows (``PromptDataset.rows``) must index this one with the stored row number, not its own index.
:class:`ImageDataset` maps both files (``np.memmap``) and decodes a prompt's images only when asked,
so that a batch costs the bytes of its own images; :meth:`ImageDataset.sizes` gives the sizes (and
so the processor's token counts) without decoding anything.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from posttrain.data.indexed import IndexedDataset
from posttrain.data.media import NO_VIDEO
from posttrain.errors import DataError

IMAGES_FIELD = "images"
META_FIELD = "image_meta"
MEDIA_DTYPES = {IMAGES_FIELD: np.uint8, META_FIELD: np.int32}


def field_prefix(data_prefix: str | Path, name: str) -> str:
    return f"{data_prefix}_packed_{name}_document"


def has_media(data_prefix: str | Path) -> bool:
    return Path(field_prefix(data_prefix, IMAGES_FIELD) + ".idx").is_file()


class ImageDataset:
    """A dataset's images, lazily: ``ds[i] = {"images": [PIL], "videos": [[PIL frames]]}`` of prompt ``i``."""

    def __init__(self, data_prefix: str | Path):
        self.data_prefix = str(data_prefix)
        self.blobs = IndexedDataset(field_prefix(data_prefix, IMAGES_FIELD))
        self.meta = IndexedDataset(field_prefix(data_prefix, META_FIELD))
        if self.blobs.dtype != np.uint8 or self.meta.dtype != np.int32:
            raise DataError(f"{self.blobs.path_prefix}: expected uint8 image bytes and int32 meta, got "
                            f"{self.blobs.dtype} and {self.meta.dtype}; re-run posttrain preprocess")
        if (len(self.meta) != len(self.blobs) or np.any(self.meta.sequence_lengths != 3)
                or not np.array_equal(self.blobs.document_indices, self.meta.document_indices)):
            raise DataError(f"{self.meta.path_prefix}.idx does not describe the images of {self.blobs.path_prefix}"
                            f".bin (the files come from different runs); re-run posttrain preprocess")

    def __len__(self) -> int:
        return len(self.blobs.document_indices) - 1

    def _range(self, i: int) -> range:
        if not 0 <= i < len(self):
            raise IndexError(f"prompt {i} out of range for {len(self)} prompts in {self.data_prefix}")
        docs = self.blobs.document_indices
        return range(int(docs[i]), int(docs[i + 1]))

    def encoded(self, i: int) -> list[bytes]:
        """The encoded files of prompt ``i`` (images, then video frames)."""
        return [self.blobs[j].tobytes() for j in self._range(i)]

    def sizes(self, i: int) -> np.ndarray:
        """``int32[n, 3]``: (video or -1, height, width) per image of prompt ``i``, without decoding."""
        rows = [np.asarray(self.meta[j]) for j in self._range(i)]
        return np.stack(rows) if rows else np.zeros((0, 3), dtype=np.int32)

    def __getitem__(self, i: int) -> dict[str, list]:
        from PIL import Image

        images: list = []
        videos: dict[int, list] = {}
        for j in self._range(i):
            img = Image.open(io.BytesIO(self.blobs[j].tobytes()))
            img.load()
            video = int(self.meta[j][0])
            (images if video == NO_VIDEO else videos.setdefault(video, [])).append(img)
        return {"images": images, "videos": [videos[v] for v in sorted(videos)]}
