"""Small real image trees written by the tests themselves (PNG is lossless, so pixels can be compared)."""

from __future__ import annotations

import dataclasses
import io
import zipfile
from pathlib import Path

import numpy as np
from PIL import Image

from tests.conftest import TINY_MODEL, model_overrides
from vitrain.data.shards import ShardWriter

# The suite's tiny ViT cut to one block for 8x8 RGB test images, two classes: as model.* overrides.
TREE_MODEL = model_overrides(dataclasses.replace(TINY_MODEL, image_size=8, in_chans=3, num_classes=2, depth=1))


def make_tree(
    root: Path,
    splits: dict[str, int] | None = None,
    classes: tuple[str, ...] = ("cat", "dog"),
    size: int = 8,
    mode: str = "RGB",
    suffix: str = ".png",
) -> dict[str, np.ndarray]:
    """Write root/<split>/<class>/<i><suffix>; return {relative path: (C, H, W) uint8 pixels}."""
    splits = splits if splits is not None else {"train": 6, "test": 2}
    rng = np.random.default_rng(0)
    pixels = {}
    for split, per_class in splits.items():
        for c in classes:
            folder = root / split / c
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                shape = (size, size) if mode == "L" else (size, size, 3)
                array = rng.integers(0, 256, shape, dtype=np.uint8)
                path = folder / f"{i:03d}{suffix}"
                Image.fromarray(array).save(path)
                pixels[path.relative_to(root).as_posix()] = array[None] if mode == "L" else array.transpose(2, 0, 1)
    return pixels


def zip_tree(root: Path, archive: Path, top: str = "data") -> Path:
    """Zip a tree under one top folder, as downloaded archives usually are."""
    with zipfile.ZipFile(archive, "w") as z:
        for path in sorted(root.rglob("*")):
            z.write(path, f"{top}/{path.relative_to(root).as_posix()}")
    return archive


def zip_with_bad_images(path: Path, bad: int) -> Path:
    """A zip of train/test splits of 8x8 grey PNGs in classes a and b, `bad` files named .png that are not
    images (train/a/broken<i>.png), one file without an image suffix (train/b/notes.txt) and one image below its
    class folder (train/b/more/deep.png)."""
    draw = np.random.default_rng(0)
    with zipfile.ZipFile(path, "w") as archive:
        for split in ("train", "test"):
            for label in ("a", "b"):
                for i in range(12):
                    buffer = io.BytesIO()
                    Image.fromarray(draw.integers(0, 255, (8, 8), dtype=np.uint8)).save(buffer, "PNG")
                    archive.writestr(f"{split}/{label}/{i}.png", buffer.getvalue())
        for i in range(bad):
            archive.writestr(f"train/a/broken{i}.png", b"this is not a png")
        archive.writestr("train/b/notes.txt", b"a stray file")
        archive.writestr("train/b/more/deep.png", buffer.getvalue())  # below its class folder: not read
    return path


def jpeg_bytes(value: int, fmt: str = "JPEG") -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), value, np.uint8)).save(out, format=fmt)
    return out.getvalue()


def write_shards(folder: Path, counts: list[int], classes: int = 2) -> list[str]:
    """Shards of 8x8 JPEGs with .cls labels, `counts[k]` samples in shard k; sample keys number them all."""
    folder.mkdir(parents=True, exist_ok=True)
    n = 0
    for k, count in enumerate(counts):
        writer = ShardWriter(str(folder / f"s-{k:02d}.tar"), max_count=count + 1)
        for _ in range(count):
            writer.write(f"{n:05d}", {"jpg": jpeg_bytes(n % 250), "cls": str(n % classes).encode()})
            n += 1
        writer.close()
    return [str(folder / f"s-{k:02d}.tar") for k in range(len(counts))]
