"""A synthetic visual task drawn locally with PIL: "how many shapes are in the picture?" (1-4).

Each picture is a white square with 1 to :data:`MAX_COUNT` filled shapes (circle, square,
triangle) of random colours, sizes and places, each in its own cell of a grid of :data:`CELL`-pixel
squares (one merged image token each); the shapes never touch (a gap of at least :data:`GAP`
pixels), so a connected-component count of the non-white pixels gives the answer back
(the unit test's independent check). A picture is a :class:`Layout`: the list of its shapes; two
layouts with the same shapes are the same problem.

:func:`make_vision_splits` draws the test split first, then the train split from layouts not in it,
so the splits are disjoint by picture, and both are a pure function of the seed. The rows are the
public multimodal format ``posttrain preprocess`` reads (docs/data.md, "Images and video frames"):
``{"prompt": "<image>How many ...", "answer": "3", "images": ["images/train_00000.png"]}`` with
the image path relative to the JSONL file.

The answer formats: the strict reward is the seed's ``acc`` verifier at full marks (the reply's
``\\boxed{}`` holds the count; the demo's GRPO reward is ``acc``); the lenient one is
``last_number`` (the last number of the reply is the count), the two accuracies the demo reports.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from posttrain.errors import ConfigError
from posttrain.files import write_text_atomic

MAX_COUNT = 4
IMAGE_SIZE = 56  # pixels; with patch 14 and 2x2 merge a 56x56 picture is 4 image tokens
GAP = 3  # the least number of white pixels between two shapes
SHAPES = ("circle", "square", "triangle")
COLOURS = ((220, 40, 40), (40, 140, 40), (40, 70, 220), (200, 150, 0), (150, 40, 170), (0, 0, 0))
QUESTION = "<image>How many shapes? Answer in \\boxed{}."


@dataclass(frozen=True)
class Shape:
    kind: str
    x: int  # the bounding box's left, top and side, in pixels
    y: int
    size: int
    colour: tuple[int, int, int]


Layout = tuple[Shape, ...]


CELL = 28  # pixels: one merged image token (patch 14, 2x2 merge) sees one cell of the grid


def draw_layout(rng: random.Random, count: int, image_size: int = IMAGE_SIZE) -> Layout:
    """``count`` shapes, each inside its own cell of the picture's grid of ``CELL``-pixel squares (at
    random cells, sizes and offsets), at least ``GAP`` pixels from the cell's border, so no two touch."""
    side = image_size // CELL
    if count > side * side:
        raise ConfigError(f"{count} shapes need {count} grid cells; a {image_size}-pixel picture has "
                          f"{side * side}: use a larger image_size")
    shapes = []
    for cell in sorted(rng.sample(range(side * side), count)):
        size = rng.randint(CELL // 3, CELL - 2 * GAP)
        x = (cell % side) * CELL + rng.randint(GAP, CELL - GAP - size)
        y = (cell // side) * CELL + rng.randint(GAP, CELL - GAP - size)
        shapes.append(Shape(rng.choice(SHAPES), x, y, size, rng.choice(COLOURS)))
    return tuple(shapes)


def render(layout: Layout, image_size: int = IMAGE_SIZE):
    """The layout drawn on a white RGB picture (a PIL image)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (image_size, image_size), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    for s in layout:
        box = (s.x, s.y, s.x + s.size - 1, s.y + s.size - 1)
        if s.kind == "circle":
            pen.ellipse(box, fill=s.colour)
        elif s.kind == "square":
            pen.rectangle(box, fill=s.colour)
        else:
            pen.polygon([(s.x + s.size // 2, s.y), (s.x, s.y + s.size - 1), (s.x + s.size - 1, s.y + s.size - 1)],
                        fill=s.colour)
    return image


def draw_problems(n: int, seed: int, *, exclude: set[Layout] = frozenset(),
                  image_size: int = IMAGE_SIZE) -> list[Layout]:
    """``n`` distinct layouts, the counts 1..MAX_COUNT in turn (balanced), none in ``exclude``."""
    rng = random.Random(seed)
    seen, layouts = set(exclude), []
    while len(layouts) < n:
        layout = draw_layout(rng, len(layouts) % MAX_COUNT + 1, image_size)
        if layout not in seen:
            seen.add(layout)
            layouts.append(layout)
    rng.shuffle(layouts)
    return layouts


def make_vision_splits(num_train: int, num_test: int, seed: int = 0,
                       image_size: int = IMAGE_SIZE) -> tuple[list[Layout], list[Layout]]:
    """(train, test) layouts: the test split drawn first, the train split from the layouts not in it."""
    if num_train < 1 or num_test < 1:
        raise ConfigError(f"the vision task needs num_train >= 1 and num_test >= 1 (got {num_train}, {num_test})")
    test = draw_problems(num_test, seed * 2 + 1, image_size=image_size)
    train = draw_problems(num_train, seed * 2, exclude=set(test), image_size=image_size)
    return train, test


def write_split(layouts: list[Layout], path: Path, name: str, image_size: int = IMAGE_SIZE) -> Path:
    """Draw each layout to ``images/{name}_NNNNN.png`` beside ``path`` and write the rows to ``path``."""
    folder = path.parent / "images"
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, layout in enumerate(layouts):
        image = f"images/{name}_{i:05d}.png"
        render(layout, image_size).save(path.parent / image)
        rows.append({"prompt": QUESTION, "answer": str(len(layout)), "images": [image]})
    write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_vision_data(out: Path, num_train: int, num_test: int, seed: int = 0,
                      image_size: int = IMAGE_SIZE) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``test.jsonl`` (and their images) under ``out``."""
    train, test = make_vision_splits(num_train, num_test, seed, image_size)
    out.mkdir(parents=True, exist_ok=True)
    return (write_split(train, out / "train.jsonl", "train", image_size),
            write_split(test, out / "test.jsonl", "test", image_size))


def sft_response(answer: str) -> str:
    """The warm start's target reply for a count: the strict format."""
    return f"\\boxed{{{answer}}}"


def strict_reward(response: str, answer: str) -> float:
    """The strict score: 1.0 when the seed's ``acc`` verifier (the GRPO reward of the demo) gives full
    marks, i.e. the reply's ``\\boxed{}`` holds the count; else 0.0."""
    from posttrain.reward.verifiers import VERIFIERS

    return 1.0 if VERIFIERS.get("acc").fn(response, answer) >= 1.0 else 0.0


def lenient_reward(response: str, answer: str) -> float:
    """The lenient score: the last number of the reply is the count (the ``last_number`` verifier)."""
    from posttrain.reward.verifiers.numbers import last_number_reward

    return float(last_number_reward(response, answer))
