"""Multimodal preprocessing: image columns (JSONL paths / base64, Parquet bytes, video frames) stored
beside the text and read back lazily with the same pixels; bad media refused by row and file."""

from __future__ import annotations

import base64
import io
import json
import os

import numpy as np
import pytest

from posttrain.data import preprocess as pp
from posttrain.data.datasets import PromptDataset
from posttrain.data.media_store import ImageDataset
from posttrain.errors import DataError

MAP = {"prompt": "problem", "query": "", "response": "answer", "system": ""}
VISION = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def vl_tok_dir(tok_dir, tmp_path_factory) -> str:
    """The tiny test tokenizer plus Qwen2.5-VL's vision tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    tok.add_tokens(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"], special_tokens=True)
    out = tmp_path_factory.mktemp("vl_tok")
    tok.save_pretrained(str(out))
    return str(out)


def _png(seed: int, size=(12, 9)) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _pixels(data_or_img) -> np.ndarray:
    from PIL import Image

    img = Image.open(io.BytesIO(data_or_img)) if isinstance(data_or_img, bytes) else data_or_img
    return np.asarray(img.convert("RGB"))


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _run(tmp_path, tok, input_path, **kw):
    cfg = dict(input=str(input_path), handler_name="R1AlpacaStyleInstructionHandler", prompt_type="qwen2_vl",
               tokenizer_name_or_path=tok, output_prefix=str(tmp_path / "out" / "data"), map_keys=MAP,
               dataset_additional_keys=["labels"], limit_mm_image_per_prompt=2, limit_mm_video_per_prompt=1)
    cfg.update(kw)
    pp.preprocess(cfg, progress=False)
    return str(tmp_path / "out" / "data")


def test_jsonl_paths_round_trip_lazily(tmp_path, vl_tok_dir):
    from transformers import AutoTokenizer

    (tmp_path / "img").mkdir()
    blobs = [_png(i, (12 + i, 9)) for i in range(3)]
    for i, b in enumerate(blobs):
        (tmp_path / "img" / f"{i}.png").write_bytes(b)
    rows = [{"problem": "<image> how many?", "answer": "1", "images": ["img/0.png"]},
            {"problem": "text only", "answer": "0", "images": []},
            {"problem": "<image> too long " + "x y " * 2000, "answer": "3", "images": ["img/0.png"]},  # skipped
            {"problem": "<image> and <image>?", "answer": "2", "images": ["img/1.png", "img/2.png"]}]
    prefix = _run(tmp_path, vl_tok_dir, _jsonl(tmp_path / "in.jsonl", rows), seq_length=300)
    ds = ImageDataset(prefix)
    assert isinstance(ds.blobs._bin, np.memmap)  # mapped, not read whole
    assert len(ds) == len(PromptDataset(prefix)) == 3
    assert ds.encoded(0) == [blobs[0]]  # the file's bytes as they were
    assert [np.array_equal(_pixels(a), _pixels(b)) for a, b in zip(ds[2]["images"], blobs[1:])] == [True, True]
    assert ds[1] == {"images": [], "videos": []}
    assert ds.sizes(2).tolist() == [[-1, 9, 13], [-1, 9, 14]]  # (video, height, width)
    tok = AutoTokenizer.from_pretrained(vl_tok_dir)
    prompts = PromptDataset(prefix)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    assert [int((prompts[i]["prompts"] == pad).sum()) for i in range(3)] == [1, 0, 2]  # unexpanded
    assert VISION + " how many?" in tok.decode(prompts[0]["prompts"])


def test_jsonl_base64_bytes_and_video_frames(tmp_path, vl_tok_dir):
    image, frames = _png(7), [_png(10 + i) for i in range(3)]
    (tmp_path / "f0.png").write_bytes(frames[0])
    rows = [{"problem": "<image> then <video>", "answer": "x",
             "images": [{"bytes": base64.b64encode(image).decode(), "path": "ignored.png"}],
             "videos": [["f0.png", {"bytes": base64.b64encode(frames[1]).decode()},
                         {"path": str(tmp_path / "f2.png")}]]}]
    (tmp_path / "f2.png").write_bytes(frames[2])
    ds = ImageDataset(_run(tmp_path, vl_tok_dir, _jsonl(tmp_path / "in.jsonl", rows)))
    item = ds[0]
    assert np.array_equal(_pixels(item["images"][0]), _pixels(image))
    assert [np.array_equal(_pixels(a), _pixels(b)) for a, b in zip(item["videos"][0], frames)] == [True] * 3
    assert ds.sizes(0)[:, 0].tolist() == [-1, 0, 0, 0]


@pytest.mark.parametrize("layout", ["struct_list", "binary"])
def test_parquet_bytes_round_trip(tmp_path, vl_tok_dir, layout):
    import pyarrow as pa
    import pyarrow.parquet as pq

    blobs = [_png(20), _png(21)]
    # the HF Image feature's list of {bytes, path} structs, or one raw image per row in a binary column
    cells = [[{"bytes": b, "path": None}] for b in blobs] if layout == "struct_list" else pa.array(blobs, pa.binary())
    table = pa.table({"problem": ["<image> a", "<image> b"], "answer": ["1", "2"], "images": cells})
    pq.write_table(table, tmp_path / "in.parquet")
    ds = ImageDataset(_run(tmp_path, vl_tok_dir, tmp_path / "in.parquet"))
    assert [np.array_equal(_pixels(ds[i]["images"][0]), _pixels(blobs[i])) for i in range(2)] == [True, True]


def _bad_case(tmp_path, case):
    (tmp_path / "ok.png").write_bytes(_png(1))
    (tmp_path / "bad.png").write_bytes(_png(2)[:40])  # truncated: PIL cannot decode it
    row = {"problem": "<image> q", "answer": "1", "images": ["ok.png"]}
    kw = {}
    if case == "missing":
        row["images"] = ["gone.png"]
    elif case == "corrupt":
        row["images"] = ["bad.png"]
    elif case == "too_many":
        row.update(problem="<image><image><image> q", images=["ok.png"] * 3)
    elif case == "marks":
        row["problem"] = "no mark"
    elif case == "text_template":
        kw["prompt_type"] = "qwen"
    elif case == "text_tokenizer":
        kw["text_tokenizer"] = True
    return [{"problem": "fine", "answer": "0"}, row], kw


@pytest.mark.parametrize("case,expect", [
    ("missing", "gone.png not found"), ("corrupt", "bad.png cannot be decoded"),
    ("too_many", "more than limit_mm_image_per_prompt=2"), ("marks", "0 <image> mark(s)"),
    ("text_template", "template 'qwen' has no image placeholder"), ("text_tokenizer", "text-only model")])
def test_bad_media_refused_with_row_and_file(tmp_path, tok_dir, vl_tok_dir, case, expect):
    rows, kw = _bad_case(tmp_path, case)
    tok = tok_dir if kw.pop("text_tokenizer", False) else vl_tok_dir
    data = _jsonl(tmp_path / "in.jsonl", rows)
    with pytest.raises(DataError) as err:
        _run(tmp_path, tok, data, **kw)
    msg = str(err.value)
    assert f"{data}:2" in msg and expect in msg, msg
    if case in ("too_many", "text_template", "text_tokenizer"):
        assert "ok.png" in msg
    assert os.listdir(tmp_path / "out") == []  # nothing half-written, no temporaries


def test_pack_refused_for_multimodal_input(tmp_path, vl_tok_dir):
    from posttrain.errors import ConfigError

    (tmp_path / "ok.png").write_bytes(_png(1))
    data = _jsonl(tmp_path / "in.jsonl", [{"problem": "<image> q", "answer": "1", "images": ["ok.png"]}])
    with pytest.raises(ConfigError, match="pack: true cannot pack multimodal rows"):
        _run(tmp_path, vl_tok_dir, data, handler_name="AlpacaStyleInstructionHandler", prompt_type="qwen2_vl",
             dataset_additional_keys=[], pack=True, seq_length=64)
