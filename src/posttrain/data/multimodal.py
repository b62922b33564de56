"""The multimodal side of a preprocessing row: its media checked against the limits, the template
and the tokenizer, and the prompt's ``<image>`` / ``<video>`` marks replaced by the template's
placeholders (:mod:`posttrain.data.media` reads the cells)."""

from __future__ import annotations

from posttrain.data.media import IMAGE_MARK, VIDEO_MARK, RowMedia, count_media, read_row_media
from posttrain.errors import DataError


class MultimodalRows:
    """Built once per handler when the input has an image or video column."""

    def __init__(self, cfg, template, tokenizer, image_col: str | None, video_col: str | None):
        self.image_col, self.video_col = image_col, video_col
        self.limits = {"image": cfg.limit_mm_image_per_prompt, "video": cfg.limit_mm_video_per_prompt}
        extra = getattr(template, "extra", {}) or {}
        self.template_name = getattr(template, "name", "hf_chat_template")
        self.placeholders = {"image": extra.get("image_placeholder"), "video": extra.get("video_placeholder")}
        self.tokens = {"image": extra.get("image_token"), "video": extra.get("video_token")}
        self.tokenizer = tokenizer
        self._checked: dict[str, str | None] = {}

    def _unsupported(self, kind: str) -> str | None:
        """Why this template/tokenizer cannot hold ``kind`` tokens, or None (checked once per kind)."""
        if kind not in self._checked:
            placeholder, token = self.placeholders[kind], self.tokens[kind]
            why = None
            if not placeholder or not token:
                why = (f"the template {self.template_name!r} has no {kind} placeholder ({kind}_placeholder and "
                       f"{kind}_token in templates.json); use prompt_type qwen2_vl or a template that has them")
            else:
                ids = self.tokenizer.encode(token, add_special_tokens=False)
                unk = getattr(self.tokenizer, "unk_token_id", None)
                if len(ids) != 1 or ids[0] == unk:
                    why = (f"the tokenizer has no {kind} token {token!r} (it encodes to {len(ids)} tokens): it is "
                           f"a text-only model's; give the vision-language model's tokenizer")
            self._checked[kind] = why
        return self._checked[kind]

    def apply(self, row: dict, item, where: str) -> RowMedia:
        """The row's media; ``item.prompt``'s marks are replaced by the template's placeholders."""
        media = read_row_media(row, where, self.image_col, self.video_col)
        counts = dict(zip(("image", "video"), count_media(media)))
        marks = {"image": IMAGE_MARK, "video": VIDEO_MARK}
        texts = [m.get("content") or "" for m in item.prompt if isinstance(m, dict)]
        files = ", ".join(media.names[:8]) + (", ..." if len(media.names) > 8 else "")
        for kind, n in counts.items():
            col = self.image_col if kind == "image" else self.video_col
            if n > self.limits[kind]:
                raise DataError(f"{where}: {n} {kind}s in column {col!r} ({files}), more than limit_mm_{kind}_per_prompt="
                                f"{self.limits[kind]}; raise limit_mm_{kind}_per_prompt in the dataset config or "
                                f"give fewer {kind}s")
            found = sum(t.count(marks[kind]) for t in texts)
            if found != n:
                raise DataError(f"{where}: the prompt has {found} {marks[kind]} mark(s) but column {col!r} holds {n} "
                                f"{kind}(s); put one {marks[kind]} in the prompt text where each {kind} goes")
            if n and (why := self._unsupported(kind)):
                raise DataError(f"{where}: the row has {n} {kind}(s) in column {col!r} ({files}), but {why}")
        for message in item.prompt:
            if isinstance(message, dict) and message.get("content"):
                for kind, mark in marks.items():
                    if counts[kind]:
                        message["content"] = message["content"].replace(mark, self.placeholders[kind])
        return media
