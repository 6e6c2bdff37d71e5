"""Batches from an in-memory uint8 image set: seeded per-epoch order, device-side augmentation, resumable."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from vitrain.data.augment import BatchAugment
from vitrain.data.sources import ImageSet


class BatchLoader:
    """Yields (images, labels) on `device`; the order depends only on (seed, epoch), so a resume replays it."""

    def __init__(
        self,
        data: ImageSet,
        batch_size: int,
        augment: BatchAugment,
        device: torch.device,
        shuffle: bool,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = True,
    ):
        self.data = data
        self.batch_size = batch_size
        self.augment = augment
        self.device = device
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self.pin = device.type == "cuda"

    def __len__(self) -> int:
        per_rank = len(self.data) // self.world_size if self.drop_last else -(-len(self.data) // self.world_size)
        if self.drop_last:
            return per_rank // self.batch_size
        return -(-per_rank // self.batch_size)

    def order(self, epoch: int) -> torch.Tensor:
        """This rank's sample indices for `epoch`: a disjoint share of one global permutation."""
        n = len(self.data)
        if self.shuffle:
            index = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 100003 + epoch))
        else:
            index = torch.arange(n)
        if self.drop_last:
            index = index[: n - n % self.world_size]
        return index[self.rank :: self.world_size]

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        index = self.order(epoch)
        for b in range(start_batch, len(self)):
            batch = index[b * self.batch_size : (b + 1) * self.batch_size]
            images, labels = self.data.images[batch], self.data.labels[batch]
            if self.pin:
                images, labels = images.pin_memory(), labels.pin_memory()
            images = images.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            # One generator per batch: augmentation after a resume matches the uninterrupted run.
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch * 10_007 + b)
            yield self.augment(images, gen), labels
