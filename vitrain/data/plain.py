"""The plain path, kept for comparison: per-sample PIL decoding and augmentation in DataLoader worker processes.

This is what torchvision's ImageFolder + transforms do; `vitrain bench loader` measures it against the fast
path with the same augmentations (crop, flip, normalization per sample here; mixup/cutmix per batch in both).
Selected with data.loader=plain on a folder source.
"""

from __future__ import annotations

import io
import math
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from vitrain.config import Config, DataConfig
from vitrain.data.augment import BatchAugment, _per_channel
from vitrain.data.loader import (
    PermutationPosition,
    Position,
    batch_generator,
    check_workers_can_start,
    from_workers,
    loader_generator,
    mask_padding,
    worker_start,
)
from vitrain.data.prepared import is_prepared
from vitrain.data.sources import ImageTree, held_out_split, list_split
from vitrain.errors import DataError


class PlainSamples(Dataset):
    """One image file per item, decoded and augmented on each access; items are keyed by (epoch, index)."""

    def __init__(
        self, tree: ImageTree, names: list[str], labels: list[int], classes: list[str], cfg: Config, train: bool
    ):
        self.root, self.is_zip = str(tree.root), tree.is_zip
        self.names, self.labels, self.classes = names, labels, classes
        self.mode = "L" if cfg.model.in_chans == 1 else "RGB"
        self.size = cfg.model.image_size
        self.seed = cfg.train.seed
        self.transform = SampleTransform(cfg.data, cfg.model.in_chans, self.size, train)
        self._archive: zipfile.ZipFile | None = None  # opened lazily, once per worker process

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, int]:
        from PIL import Image, UnidentifiedImageError

        epoch, i = key
        name = self.names[i]
        where = f"{self.root}:{name}" if self.is_zip else str(Path(self.root) / name)
        try:
            if self.is_zip:
                if self._archive is None:
                    self._archive = zipfile.ZipFile(self.root)
                raw = self._archive.read(name)
            else:
                raw = (Path(self.root) / name).read_bytes()
        except (OSError, EOFError, zipfile.BadZipFile) as exc:  # a damaged member (its CRC), a file gone
            raise DataError(f"cannot read image {where}: {exc}; fix or remove the file") from None
        try:
            img = Image.open(io.BytesIO(raw)).convert(self.mode)
        except UnidentifiedImageError:  # its text names the in-memory buffer, not the file
            raise DataError(f"cannot decode image {where}: not an image file PIL knows; fix or remove it") from None
        except Exception as exc:  # PIL raises many types for bad files
            raise DataError(f"cannot decode image {where}: {exc}; fix or remove the file") from None
        rng = np.random.default_rng((self.seed, epoch, i))
        return self.transform(img, rng), self.labels[i]


class SampleTransform:
    """torchvision-style per-sample augmentation of one PIL image: crop, flip, to float tensor, normalize."""

    def __init__(self, cfg: DataConfig, channels: int, size: int, train: bool):
        self.size = size
        self.random_resized_crop = cfg.random_resized_crop and train
        self.rrc_scale, self.rrc_ratio = cfg.rrc_scale, cfg.rrc_ratio
        self.crop_padding = cfg.crop_padding if train and not cfg.random_resized_crop else 0
        self.hflip = cfg.hflip if train else 0.0
        self.mean = np.array(_per_channel(cfg.mean, channels), dtype=np.float32)[:, None, None] * 255.0
        self.std = np.array(_per_channel(cfg.std, channels), dtype=np.float32)[:, None, None] * 255.0

    def __call__(self, img, rng: np.random.Generator) -> torch.Tensor:
        from PIL import Image

        if self.random_resized_crop:
            left, top, box_w, box_h = _rrc_box(rng, img.width, img.height, self.rrc_scale, self.rrc_ratio)
            img = img.resize((self.size, self.size), Image.BILINEAR, box=(left, top, left + box_w, top + box_h))
        elif img.size != (self.size, self.size):
            img = img.resize((self.size, self.size), Image.BICUBIC)
        if self.hflip and rng.random() < self.hflip:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        array = np.asarray(img, dtype=np.uint8)
        array = array[None] if array.ndim == 2 else array.transpose(2, 0, 1)
        if self.crop_padding:
            p = self.crop_padding
            mode = "reflect" if p < self.size else "constant"
            padded = np.pad(array, ((0, 0), (p, p), (p, p)), mode=mode)
            dy, dx = rng.integers(0, 2 * p + 1, size=2)
            array = padded[:, dy : dy + self.size, dx : dx + self.size]
        return torch.from_numpy((array.astype(np.float32) - self.mean) / self.std)


def _rrc_box(
    rng: np.random.Generator, w: int, h: int, scale: tuple[float, float], ratio: tuple[float, float]
) -> tuple[int, int, int, int]:
    for _ in range(10):
        area = h * w * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
        box_w, box_h = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
        if 0 < box_w <= w and 0 < box_h <= h:
            return int(rng.integers(0, w - box_w + 1)), int(rng.integers(0, h - box_h + 1)), box_w, box_h
    return 0, 0, w, h


class PlainLoader(PermutationPosition):
    """Same interface and order as BatchLoader, but each sample goes through PIL in a worker process."""

    def __init__(
        self,
        data: PlainSamples,
        batch_size: int,
        mixer: BatchAugment | None,
        device: torch.device,
        shuffle: bool,
        workers: int,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = True,
    ):
        self.data = data
        self.batch_size = batch_size
        self.mixer = mixer
        self.device = device
        self.shuffle = shuffle
        self.workers = workers
        check_workers_can_start(workers)
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self.seed = data.seed

    def epoch(self, epoch: int, start: int | Position | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        n = len(self.data)
        index, start_batch, count = self.plan(epoch, start)
        keys = [(epoch, int(i)) for i in index[: count * self.batch_size]]
        loader = DataLoader(
            self.data,
            batch_size=self.batch_size,
            sampler=keys,
            num_workers=self.workers,
            pin_memory=self.device.type == "cuda",
            generator=loader_generator(self.seed, epoch, self.rank),
            **worker_start(self.workers),
        )
        for b, (images, labels) in enumerate(from_workers(loader), start=start_batch):
            labels = mask_padding(labels, b * self.batch_size, n, self.rank, self.world_size)
            images = images.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            if self.mixer is not None:
                images, labels = self.mixer.mix(images, labels, batch_generator(self.seed, epoch, b, self.rank))
            yield images, labels


def build_plain_loaders(
    cfg: Config, device: torch.device, rank: int = 0, world_size: int = 1
) -> tuple[PlainLoader, PlainLoader]:
    d, t = cfg.data, cfg.train
    root = Path(d.root).expanduser()
    if not root.exists():
        raise DataError(f"data.root={root} does not exist; point it at an ImageFolder tree or a .zip of one")
    if is_prepared(root):
        raise DataError(
            f"data.loader=plain decodes image files, but data.root={root} holds prepared data; "
            f"use data.loader=fast or point data.root at the image folder"
        )
    tree = ImageTree(root)
    listing = list_split(tree, d.train_split, required=True)
    assert listing is not None
    names, labels, classes = listing
    val_listing = list_split(tree, d.val_split, required=False, classes=classes)
    if val_listing is None:
        train_rows, val_rows = held_out_split(len(names), d.val_fraction)
        val_listing = ([names[i] for i in val_rows], [labels[i] for i in val_rows], classes)
        names, labels = [names[i] for i in train_rows], [labels[i] for i in train_rows]
    if len(classes) != cfg.model.num_classes:
        raise DataError(
            f"data.root={root} has {len(classes)} classes but model.num_classes={cfg.model.num_classes}; "
            f"set model.num_classes={len(classes)}"
        )
    train_set = PlainSamples(tree, names, labels, classes, cfg, train=True)
    val_set = PlainSamples(tree, val_listing[0], val_listing[1], classes, cfg, train=False)
    mixer = None
    if d.mixup_alpha or d.cutmix_alpha:
        mixer = BatchAugment(d, cfg.model.in_chans, True, cfg.model.image_size, cfg.model.num_classes)
    workers = d.loader_workers
    train = PlainLoader(train_set, t.batch_size, mixer, device, True, workers, rank, world_size)
    val = PlainLoader(val_set, t.batch_size, None, device, False, workers, rank, world_size, drop_last=False)
    return train, val
