"""Builds the train and val loaders the config asks for: the fast batched path, a stream of shards, or the plain one."""

from __future__ import annotations

from typing import Any

import torch

from vitrain.config import Config
from vitrain.data.augment import BatchAugment
from vitrain.data.loader import BatchLoader
from vitrain.data.plain import build_plain_loaders
from vitrain.data.sources import build_datasets
from vitrain.data.stream import StreamLoader
from vitrain.errors import ConfigError


def build_loaders(
    cfg: Config, device: torch.device, rank: int = 0, world_size: int = 1, source: Any = None
) -> tuple[Any, Any]:
    """(train, val) loaders, each yielding this rank's disjoint share (validation's padded to equal shares).
    `source`: datasets (or a function of the config making them) instead of data.source's (build_datasets)."""
    if cfg.data.loader == "plain":
        return build_plain_loaders(cfg, device, rank, world_size)
    train_set, val_set = build_datasets(cfg, source)
    d, m, t = cfg.data, cfg.model, cfg.train
    # Shards are read front to back by worker processes (data/stream.py); the rest by index (data/loader.py).
    streamed = getattr(train_set, "streamed", False)
    if streamed and d.repeated_aug > 1:
        # Repeats deal copies of an image to other ranks, which a stream cannot: each rank reads its own shards.
        raise ConfigError(
            f"data.repeated_aug={d.repeated_aug} repeats images by index across ranks; data.source={d.source} streams "
            "each rank its own part of the shards: set data.repeated_aug=1, or train from a random-access source "
            "(data.source=folder or prepared)"
        )
    make, extra = (
        (StreamLoader, {"workers": d.loader_workers, "window": d.shuffle_buffer})
        if streamed
        else (BatchLoader, {"repeats": d.repeated_aug})  # repeats only the shuffled (training) order
    )
    return tuple(
        make(
            data,
            t.batch_size,
            BatchAugment(d, m.in_chans, train, m.image_size, m.num_classes, frames=m.num_frames),
            device,
            shuffle=train,
            seed=t.seed if train else 0,
            rank=rank,
            world_size=world_size,
            drop_last=train,
            prefetch=d.prefetch,
            **extra,
        )  # fmt: skip
        for data, train in ((train_set, True), (val_set, False))
    )
