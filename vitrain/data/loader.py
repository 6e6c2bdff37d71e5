"""The fast loader: seeded per-epoch order, batched uint8 reads, device-side augmentation, prefetch, resumable.

Works over any data with `read(index) -> (uint8 images, labels)`: an in-memory ImageSet or a memory-mapped
PreparedSet. A background thread reads, pins, copies and augments the next batches while the step runs.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from vitrain.data.augment import BatchAugment


class BatchSource(Protocol):
    classes: list[str]

    def __len__(self) -> int: ...

    def read(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


# The label of a sample that pads a rank's share (cross_entropy's default ignore_index: it adds no loss).
PAD_LABEL = -100


def epoch_order(
    n: int, epoch: int, seed: int, shuffle: bool, rank: int = 0, world_size: int = 1, drop_last: bool = True
) -> torch.Tensor:
    """This rank's sample indices for `epoch`: a disjoint share of one permutation fixed by (seed, epoch).

    Without drop_last the order is padded at its end, by repeating its first samples, to a multiple of
    world_size, so that every rank runs the same number of batches (FSDP's forward is collective); the padding
    sits after the real samples of each share and its labels become PAD_LABEL (`mask_padding`).
    """
    if shuffle:
        index = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
    else:
        index = torch.arange(n)
    if drop_last:
        index = index[: n - n % world_size]
    elif n:
        index = torch.cat([index, index.repeat(world_size)[: -n % world_size]])
    return index[rank::world_size]


def mask_padding(labels: torch.Tensor, first: int, n: int, rank: int, world_size: int) -> torch.Tensor:
    """Give PAD_LABEL to the padding in a batch that starts at position `first` of this rank's share of n samples."""
    real = len(range(rank, n, world_size))  # the share's leading real samples; padding follows them
    if first + labels.shape[0] <= real:
        return labels
    labels = labels.clone()
    labels[max(real - first, 0) :] = PAD_LABEL
    return labels


def batches_per_epoch(n: int, batch_size: int, world_size: int, drop_last: bool) -> int:
    per_rank = n // world_size if drop_last else -(-n // world_size)
    return per_rank // batch_size if drop_last else -(-per_rank // batch_size)


def batch_generator(seed: int, epoch: int, batch: int, rank: int = 0) -> torch.Generator:
    """One generator per batch (and rank), so augmentation after a resume matches the uninterrupted run."""
    return torch.Generator().manual_seed(seed * 1_000_003 + epoch * 10_007 + batch + rank * 1_000_000_007)


class BatchLoader:
    """Yields (images, targets) on `device`; the order depends only on (seed, epoch), so a resume replays it."""

    def __init__(
        self,
        data: BatchSource,
        batch_size: int,
        augment: BatchAugment,
        device: torch.device,
        shuffle: bool,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = True,
        prefetch: int = 2,
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
        self.prefetch = prefetch
        # Pinned host memory lets the copy to an accelerator run asynchronously (untested here: no GPU).
        self.pin = device.type == "cuda"

    def __len__(self) -> int:
        return batches_per_epoch(len(self.data), self.batch_size, self.world_size, self.drop_last)

    def order(self, epoch: int) -> torch.Tensor:
        n = len(self.data)
        return epoch_order(n, epoch, self.seed, self.shuffle, self.rank, self.world_size, self.drop_last)

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        index = self.order(epoch)
        batches = (self._batch(index, epoch, b) for b in range(start_batch, len(self)))
        return in_background(batches, self.prefetch) if self.prefetch else batches

    def _batch(self, index: torch.Tensor, epoch: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = self.data.read(index[b * self.batch_size : (b + 1) * self.batch_size])
        labels = mask_padding(labels, b * self.batch_size, len(self.data), self.rank, self.world_size)
        if self.pin:
            images, labels = images.pin_memory(), labels.pin_memory()
        images = images.to(self.device, non_blocking=True)
        labels = labels.to(self.device, non_blocking=True)
        return self.augment(images, labels, batch_generator(self.seed, epoch, b, self.rank))


_DONE = object()


class _Raised:
    def __init__(self, exc: BaseException):
        self.exc = exc


def in_background(items: Iterator[Any], depth: int) -> Iterator[Any]:
    """Run `items` in a thread, at most `depth` ahead; errors re-raise here; closing early stops the thread.

    A thread (not a process) is enough: reading a memory map, torch copies and augmentation release the GIL.
    On CUDA the thread enqueues on the same current stream as the step, so the order of work stays correct.
    """
    slots: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                slots.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(item):
                    return
        except BaseException as exc:
            put(_Raised(exc))
            return
        put(_DONE)

    thread = threading.Thread(target=produce, name="vitrain-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = slots.get()
            if item is _DONE:
                return
            if isinstance(item, _Raised):
                raise item.exc
            yield item
    finally:
        stop.set()
        thread.join()


class WaitTimer:
    """Wraps a batch iterator and adds up the seconds its consumer spends blocked waiting for the next batch."""

    def __init__(self, batches: Iterator[Any]):
        self.batches = batches
        self.waited_s = 0.0

    def __iter__(self) -> WaitTimer:
        return self

    def __next__(self) -> Any:
        start = time.perf_counter()
        try:
            return next(self.batches)
        finally:
            self.waited_s += time.perf_counter() - start

    def take(self) -> float:
        """Seconds waited since the last call."""
        waited, self.waited_s = self.waited_s, 0.0
        return waited


def endless(loader: Any) -> Iterator[Any]:
    """A loader's batches, epoch after epoch (epoch 0, 1, ...): what a benchmark or lr-find steps through."""
    epoch = 0
    while True:
        yield from loader.epoch(epoch)
        epoch += 1


def first_batch(loader: Any) -> Any:
    """The loader's first batch of epoch 0 (its prefetch thread stopped after)."""
    batches = loader.epoch(0)
    try:
        return next(iter(batches))
    finally:
        getattr(batches, "close", lambda: None)()
