"""Tiny detection data sets written on the fly: a Pascal VOC tree or COCO-format JSON over drawn rectangles."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

CLASSES = ("cell", "dot")  # VOC names; sorted, so class 0 is cell and class 1 is dot


# The suite's tiny ViTDet: 64 px in 8 px patches, 2 blocks of width 32 (the second global), windows of 4 patches.
TINY_VITDET = [
    "model.image_size=64",
    "model.patch_size=8",
    "model.width=32",
    "model.depth=2",
    "model.heads=2",
    "model.window_size=4",
    "model.global_blocks=[1]",
]


def drawn_image(path: Path, width: int, height: int, boxes: list[tuple[str, float, float, float, float]]) -> None:
    """A grey image with each box filled: cells bright, dots dark (something a detector can learn)."""
    pixels = np.full((height, width, 3), 128, dtype=np.uint8)
    for name, x1, y1, x2, y2 in boxes:
        pixels[int(y1) : int(y2), int(x1) : int(x2)] = 230 if name == "cell" else 20
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)


def random_boxes(rng: np.random.Generator, width: int, height: int, count: int) -> list[tuple[str, int, int, int, int]]:
    boxes = []
    for _ in range(count):
        w, h = int(rng.integers(8, 24)), int(rng.integers(8, 24))
        x1, y1 = int(rng.integers(0, width - w)), int(rng.integers(0, height - h))
        boxes.append((CLASSES[int(rng.integers(0, 2))], x1, y1, x1 + w, y1 + h))
    return boxes


def voc_xml(filename: str, width: int, height: int, boxes: list[tuple[str, Any, Any, Any, Any]]) -> str:
    """A VOC annotation; the boxes' corners are written as given (VOC numbers pixels from 1)."""
    objects = "".join(
        f"<object><name>{n}</name><bndbox><xmin>{a}</xmin><ymin>{b}</ymin><xmax>{c}</xmax><ymax>{d}</ymax>"
        "</bndbox></object>"
        for n, a, b, c, d in boxes
    )
    return (
        f"<annotation><filename>{filename}</filename><size><width>{width}</width><height>{height}</height>"
        f"<depth>3</depth></size>{objects}</annotation>"
    )


def write_voc(root: Path, splits: dict[str, int], size: tuple[int, int] = (80, 60), seed: int = 0) -> Path:
    """A VOC tree under root/voc: `splits` maps a split name to its image count; boxes drawn in each image."""
    rng = np.random.default_rng(seed)
    top = root / "voc"
    width, height = size
    number = 0
    for split, count in splits.items():
        stems = []
        for _ in range(count):
            stem = f"img_{number:03d}"
            number += 1
            boxes = random_boxes(rng, width, height, 3)
            drawn_image(top / "JPEGImages" / f"{stem}.png", width, height, boxes)
            voc = [(n, a + 1, b + 1, c, d) for n, a, b, c, d in boxes]
            (top / "Annotations").mkdir(parents=True, exist_ok=True)
            (top / "Annotations" / f"{stem}.xml").write_text(voc_xml(f"{stem}.png", width, height, voc))
            stems.append(stem)
        (top / "ImageSets" / "Main").mkdir(parents=True, exist_ok=True)
        (top / "ImageSets" / "Main" / f"{split}.txt").write_text("\n".join(stems) + "\n")
    return top


def write_coco(
    root: Path,
    split: str,
    images: list[dict[str, Any]],
    annotations: list[dict[str, Any]],
    categories: list[dict[str, Any]] | None = None,
) -> Path:
    """root/annotations/instances_<split>.json, with a drawn image root/<split>/<file_name> for each image."""
    for image in images:
        drawn_image(root / split / image["file_name"], image["width"], image["height"], [])
    data = {"images": images, "annotations": annotations,
            "categories": categories or [{"id": 1, "name": "cell"}, {"id": 7, "name": "dot"}]}  # fmt: skip
    path = root / "annotations" / f"instances_{split}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path
