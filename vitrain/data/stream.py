"""The streaming loader: shard samples planned per epoch over ranks and workers, window-shuffled, exactly resumable.

Each epoch orders the split's runs (stretches of shards) by (seed, epoch) and lays the resulting sample sequence out:

- ranks: each takes one contiguous, equal share (whole batches; the leftover, under one batch per rank, waits for
  another epoch), so every rank runs the same number of steps whatever the shard sizes;
- loader workers: batch b of a rank comes from worker b mod W, which reads one contiguous part of the rank's share
  sequentially, so each shard is read front to back (seeking past others' samples in local shards);
- shuffling: each worker permutes windows of data.shuffle_buffer consecutive samples, seeded by the window's place;
  pack shuffles the samples once when it writes the shards, so windows mix classes.

Nothing about this needs saving beyond the batch count: the loader's Position lists the layouts (world size,
workers, batch size) that ran in the epoch and how many batches each consumed. The same layout continues where it
stopped (each worker re-reads only the raw bytes of its current window); another layout first works out, from the
seed, every sample the earlier ones consumed and shares out only the rest.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from vitrain.config import Config
from vitrain.data.augment import BatchAugment
from vitrain.data.decode import decode_image
from vitrain.data.loader import (
    PAD_LABEL,
    Position,
    batch_generator,
    check_workers_can_start,
    from_workers,
    in_background,
    loader_generator,
    trace,
    worker_start,
)
from vitrain.data.shards import (
    IMAGE_EXTS,
    BadSample,
    Sample,
    ShardIndex,
    describe,
    load_index,
    read_index,
    read_samples,
    shard_urls,
)
from vitrain.device import trim_heap
from vitrain.errors import DataError
from vitrain.shard_names import PIPE


@dataclass
class Run:
    """`count` consecutive samples of shard `shard`, from its sample `start`."""

    shard: int
    start: int
    count: int


@dataclass
class StreamSet:
    """One split of a shard set, read as a stream: its runs of shard samples, class names and decoded image shape.

    `clip_decoder`: a model that takes clips reads each sample as one clip (data/video.py's ShardClips: the video or
    frames, temporal sampling); evaluation then reads `clips` rows per sample, clip k of them for row k (`video_of`).
    """

    index: ShardIndex
    runs: list[Run]
    channels: int
    size: int
    reduce: bool = True  # data.decode_reduce
    skip_bad: int = 0
    clip_decoder: Any = None
    clips: int = 1
    streamed = True  # what build_loaders looks for

    @property
    def classes(self) -> list[str]:
        return self.index.classes

    @property
    def num_frames(self) -> int:
        return self.clip_decoder.num_frames if self.clip_decoder is not None else 1

    @property
    def videos(self) -> int:
        """Samples (a video each, for clips) of the split; len() counts rows, `clips` per sample."""
        return sum(r.count for r in self.runs)

    def __len__(self) -> int:
        return self.videos * self.clips

    def video_of(self, rows: torch.Tensor) -> torch.Tensor:
        return rows // self.clips

    def decode(self, sample: Sample, k: int, seed: int, epoch: int) -> np.ndarray:
        """The sample's (num_frames * channels, size, size) uint8 input: clip k of a clip sample, else its image; a
        BadSample says why it cannot be."""
        if self.clip_decoder is not None:
            return self.clip_decoder.decode(sample, k, seed, epoch)
        if sample.image is None:
            raise BadSample(f"has no image (no member ending in {', '.join(IMAGE_EXTS)})")
        try:
            return decode_image(sample.image, "L" if self.channels == 1 else "RGB", self.size, self.reduce)
        except Exception as exc:  # PIL and simplejpeg raise many types for bad files
            raise BadSample(f"has an image that does not decode ({type(exc).__name__}: {exc})") from None


def take(runs: list[Run], start: int, length: int) -> list[Run]:
    """The runs covering positions [start, start + length) of the sample sequence `runs` describes."""
    out, pos = [], 0
    for r in runs:
        low, high = max(start, pos), min(start + length, pos + r.count)
        if low < high:
            out.append(Run(r.shard, r.start + low - pos, high - low))
        pos += r.count
        if pos >= start + length:
            break
    return out


def without(runs: list[Run], gone: np.ndarray) -> list[Run]:
    """`runs` minus the positions `gone` (of the sequence they describe), as runs again."""
    keep = np.ones(sum(r.count for r in runs), dtype=bool)
    keep[gone] = False
    out, pos = [], 0
    for r in runs:
        mask = keep[pos : pos + r.count]
        edges = np.flatnonzero(np.diff(np.concatenate([[False], mask, [False]]).astype(np.int8)))
        out += [Run(r.shard, r.start + int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2], strict=True)]
        pos += r.count
    return out


@dataclass
class Layout:
    """One rank's share of a segment (a layout over the samples still to see): its batch sizes and, per worker,
    the positions (in the segment's sequence) it reads."""

    rank_start: int
    sizes: list[int]
    real: int  # samples of the share that are real; the rest pad the last rank (evaluation only)
    workers: int

    def worker_batches(self, w: int) -> list[int]:
        return self.sizes[w :: self.workers]

    def worker_start(self, w: int) -> int:
        return self.rank_start + sum(sum(self.sizes[v :: self.workers]) for v in range(w))


def lay_out(n: int, rank: int, world_size: int, batch_size: int, workers: int, drop_last: bool) -> Layout:
    if drop_last:
        share = n // world_size
        steps = share // batch_size
        return Layout(rank * share, [batch_size] * steps, steps * batch_size, workers)
    share = -(-n // world_size)
    sizes = [batch_size] * (share // batch_size) + ([share % batch_size] if share % batch_size else [])
    real = max(0, min(share, n - rank * share))
    return Layout(rank * share, sizes, real, workers)


def window_order(length: int, seed: int, epoch: int, segment: int, rank: int, worker: int, window: int) -> np.ndarray:
    """The order in which a worker emits the `length` samples of one of its shuffle windows."""
    key = [seed, epoch, segment, rank, worker, window]
    return np.random.default_rng(key).permutation(length)


class StreamLoader:
    """BatchLoader's interface over a StreamSet: (images, targets) on `device`, decoded by `workers` processes."""

    def __init__(
        self,
        data: StreamSet,
        batch_size: int,
        augment: BatchAugment,
        device: torch.device,
        shuffle: bool,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = True,
        prefetch: int = 2,
        workers: int = 2,
        window: int = 1000,
    ):
        self.data, self.batch_size, self.augment, self.device = data, batch_size, augment, device
        self.shuffle, self.seed, self.rank, self.world_size = shuffle, seed, rank, world_size
        self.drop_last, self.prefetch, self.workers = drop_last, prefetch, workers
        check_workers_can_start(workers)
        self.window = window if shuffle else 0
        self.skipped: dict[str, str] = {}  # bad samples replaced so far (data.skip_bad): where -> why

    @property
    def layout_key(self) -> dict[str, int]:
        return {"world_size": self.world_size, "workers": max(1, self.workers), "batch_size": self.batch_size}

    def _continues(self, segments: list[dict[str, int]]) -> bool:
        """Whether this loader's layout is the last one that ran (it then continues where that one stopped)."""
        return bool(segments) and {k: segments[-1][k] for k in self.layout_key} == self.layout_key

    def epoch_runs(self, epoch: int) -> list[Run]:
        runs = list(self.data.runs)
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(runs))
            runs = [runs[i] for i in order]
        return runs

    def _rows(self, runs: list[Run]) -> int:
        """Rows of the sequence `runs` describe: `clips` per sample (more than one only for evaluation's clips, which
        are never shuffled or resumed mid-epoch)."""
        return sum(r.count for r in runs) * self.data.clips

    def _rank_layout(self, n: int, rank: int, seg: dict[str, int]) -> Layout:
        return lay_out(n, rank, seg["world_size"], seg["batch_size"], seg["workers"], self.drop_last)

    def resume(self, epoch: int, start: Position | None) -> tuple[list[Run], int, int, int]:
        """(the runs the current segment lays out, its number, batches it already consumed, this rank's first batch
        number in the epoch) at `start`."""
        runs, segments = self.epoch_runs(epoch), list(start.segments) if start is not None else []
        before = 0
        if self._continues(segments):
            current = segments.pop()
        else:
            current = {**self.layout_key, "batches": 0}
        for number, seg in enumerate(segments):
            runs = without(runs, self._consumed(runs, epoch, number, seg))
            before += seg["batches"]
        return runs, len(segments), current["batches"], before + current["batches"]

    def _consumed(self, runs: list[Run], epoch: int, number: int, seg: dict[str, int]) -> np.ndarray:
        """Positions of `runs`' sequence that segment `number` (a layout and its batch count) consumed, all ranks."""
        n, gone = sum(r.count for r in runs), []
        for rank in range(seg["world_size"]):
            lay = self._rank_layout(n, rank, seg)
            for w in range(lay.workers):
                done = len(range(w, seg["batches"], lay.workers))
                emitted = sum(lay.worker_batches(w)[:done])
                full = emitted // self.window * self.window if self.window else emitted
                gone.append(lay.worker_start(w) + np.arange(full))
                if emitted > full:
                    length = min(self.window, sum(lay.worker_batches(w)) - full)
                    order = window_order(length, self.seed, epoch, number, rank, w, full // self.window)
                    gone.append(lay.worker_start(w) + full + order[: emitted - full])
        return np.concatenate(gone) if gone else np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._rank_layout(len(self.data), self.rank, {**self.layout_key}).sizes)

    def order(self, epoch: int) -> torch.Tensor:
        """This rank's rows of an unshuffled epoch (evaluation) in the order its batches come, padding included:
        batch b from worker b mod W, which reads its part of the share front to back."""
        if self.shuffle:
            raise ValueError("StreamLoader.order gives the rows of an unshuffled (evaluation) loader only")
        lay = self._rank_layout(len(self.data), self.rank, self.layout_key)
        rows = []
        for b, size in enumerate(lay.sizes):
            w = b % lay.workers
            first = lay.worker_start(w) + sum(lay.worker_batches(w)[: b // lay.workers])
            rows.append(torch.arange(first, first + size))
        return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)

    def batches_left(self, start: Position | None = None) -> int:
        runs, _, done, _ = self.resume(start.epoch if start else 0, start)
        return len(self._rank_layout(self._rows(runs), self.rank, self.layout_key).sizes) - done

    def position(self, epoch: int, start: Position | None, batches: int) -> Position:
        segments = [dict(s) for s in start.segments] if start is not None else []
        if self._continues(segments):
            segments[-1]["batches"] += batches
        else:
            segments.append({**self.layout_key, "batches": batches})
        return Position(epoch, 0, segments)

    def epoch(self, epoch: int, start: Position | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        runs, number, done, first = self.resume(epoch, start)
        lay = self._rank_layout(self._rows(runs), self.rank, self.layout_key)
        plan = _WorkerPlan(self.data, runs, lay, done, self.window, (self.seed, epoch, number, self.rank))
        workers = self.workers if len(lay.sizes) > done else 0  # nothing left: no processes to start
        loader = DataLoader(
            plan,
            batch_size=None,
            num_workers=workers,
            prefetch_factor=2 if workers else None,
            generator=loader_generator(self.seed, epoch, self.rank),
            **worker_start(workers),
        )
        batches = (self._finish(batch, epoch, first + b) for b, batch in enumerate(from_workers(loader)))
        batches = in_background(batches, self.prefetch) if self.prefetch else batches
        return trace(self._taken(batches), "train" if self.shuffle else "val")

    def _taken(self, batches: Iterator[tuple]) -> Iterator[tuple[torch.Tensor, torch.Tensor, list]]:
        """The batches as the consumer takes them: their bad samples count as skipped then, not when prefetched."""
        try:
            for images, labels, keys, bad in batches:
                if bad:
                    self.skipped.update(bad)
                    if len(self.skipped) > self.data.skip_bad:
                        where, reason = bad[-1]
                        raise DataError(
                            f"sample {where} {reason}; fix the shard, or let the run skip bad samples: data.skip_bad="
                            f"{self.data.skip_bad} allows {self.data.skip_bad}, this is number {len(self.skipped)}"
                        )
                yield images, labels, keys
        finally:  # stop the prefetch thread now when the consumer stops early
            getattr(batches, "close", lambda: None)()

    def _finish(self, batch: tuple, epoch: int, number: int) -> tuple[torch.Tensor, torch.Tensor, list, list]:
        images, labels, keys, bad = batch
        if number % TRIM_EVERY == TRIM_EVERY - 1:
            trim_heap()
        if self.device.type == "cuda":
            images, labels = images.pin_memory(), labels.pin_memory()
        images = images.to(self.device, non_blocking=True)
        labels = labels.to(self.device, non_blocking=True)
        images, labels = self.augment(images, labels, batch_generator(self.seed, epoch, number, self.rank))
        return images, labels, keys, bad


# A stream's batches are made in the loader's thread and freed in the training thread. glibc's malloc keeps freed
# chunks in the arena of the thread that made them, so over a long epoch the process holds hundreds of MB it no
# longer uses (results/loader-sources/stream_rss*.json); every TRIM_EVERY batches the loader hands them back.
TRIM_EVERY = 16


@dataclass
class _WorkerPlan(IterableDataset):
    """What the loader's workers read: worker process i plays worker (i + done) mod W of the layout, so that the
    DataLoader's round robin, which starts at process 0, yields the batches in order from batch `done` on."""

    data: StreamSet
    runs: list[Run]
    layout: Layout
    done: int
    window: int
    seeds: tuple[int, int, int, int]  # seed, epoch, segment, rank

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, list[str], list[tuple[str, str]]]]:
        info = get_worker_info()
        if info is None:  # no worker processes: the main process plays the layout's one worker, or nothing is left
            if self.layout.workers == 1:
                yield from self._worker(0)
            return
        yield from self._worker((info.id + self.done) % self.layout.workers)

    def _worker(self, w: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, list[str], list[tuple[str, str]]]]:
        lay, seed, epoch, segment, rank = self.layout, *self.seeds
        sizes = lay.worker_batches(w)
        done = len(range(w, self.done, lay.workers))
        emitted = sum(sizes[:done])
        total = sum(sizes)
        if emitted >= total:
            return
        step = self.window or total
        window = emitted // step
        samples = self._samples(lay.worker_start(w) + window * step, total - window * step, lay)
        pending: list = []
        skip = emitted - window * step
        for b in range(done, len(sizes)):
            while len(pending) < sizes[b]:
                raw = [next(samples) for _ in range(min(step, total - window * step))]
                order = (
                    window_order(len(raw), seed, epoch, segment, rank, w, window) if self.window else range(len(raw))
                )
                pending += [raw[i] for i in order][skip:]
                skip, window = 0, window + 1
            batch, pending = pending[: sizes[b]], pending[sizes[b] :]
            yield self._decode(batch)

    def _samples(self, start: int, length: int, lay: Layout) -> Iterator:
        """(raw sample, padding?, clip number) at positions [start, start + length) of the segment's sequence; past
        the rank's real samples (evaluation's padding) the share's first samples repeat."""
        real = max(0, min(length, lay.rank_start + lay.real - start))
        yield from ((sample, False, k) for sample, k in self._rows(start, real))
        padding = length - real
        pad_from = lay.rank_start if lay.real else 0  # a rank with no real sample left pads with the split's first
        while padding > 0:
            for sample, k in self._rows(pad_from, min(padding, max(lay.real, 1))):
                padding -= 1
                yield sample, True, k

    def _rows(self, start: int, length: int) -> Iterator[tuple[Sample, int]]:
        """(sample, clip number) of rows [start, start + length): row r is clip r % clips of sample r // clips."""
        clips = self.data.clips
        first = start // clips
        row = first * clips
        for run in take(self.runs, first, -(-(start + length) // clips) - first):
            url = self.data.index.urls[run.shard]
            got = 0
            for sample in read_samples(url, run.start, run.count):
                got += 1
                for k in range(clips):
                    if start <= row < start + length:
                        yield sample, k
                    row += 1
            if got != run.count:
                raise DataError(
                    f"shard {url} ended after sample {run.start + got} but its index counts "
                    f"{self.data.index.counts[run.shard]}: it is truncated or the index is stale; write the shard "
                    "again or run `vitrain data index` on the shards"
                )

    def _decode(self, batch: list) -> tuple[torch.Tensor, torch.Tensor, list[str], list[tuple[str, str]]]:
        data, (seed, epoch) = self.data, self.seeds[:2]
        out = np.zeros((len(batch), data.channels * data.num_frames, data.size, data.size), np.uint8)
        labels, keys, bad, good = [], [], [], None
        classes = len(data.classes)
        for i, (sample, pad, k) in enumerate(batch):
            problem = sample.problem
            if not problem and classes and sample.label >= classes:
                problem = (
                    f"has label {sample.label}, outside the data's {classes} classes (labels 0 to {classes - 1}, one "
                    "name each in the shards' index.json classes)"
                )
            if not problem:
                try:
                    out[i] = data.decode(sample, k, seed, epoch)
                except BadSample as exc:
                    problem = str(exc)
            name = Path(sample.where.split(" byte ")[0]).name if not sample.where.startswith(PIPE) else "pipe"
            keys.append(f"{name}/{sample.key}" + (f"#{k}" if data.clips > 1 else ""))
            if problem:
                bad.append((f"{sample.key} ({sample.where})", problem))
                labels.append(None)
                continue
            labels.append(PAD_LABEL if pad else sample.label)
            good = i
        if good is None:
            where, reason = bad[0]
            raise DataError(f"sample {where} {reason}: a whole batch of bad samples; fix the shards")
        for i, label in enumerate(labels):  # a bad sample's place goes to a good one of its batch: the size stays
            if label is None:
                source = good if i > good else next(j for j, v in enumerate(labels) if v is not None)
                out[i], labels[i] = out[source], labels[source]
        return torch.from_numpy(out), torch.tensor(labels, dtype=torch.long), keys, bad


# ---------------------------------------------------------------------------------------------- the source


def shards_source(cfg: Config) -> tuple[StreamSet, StreamSet]:
    """data.source=shards: the training shards of data.root and the validation shards of data.val_root, of a
    packed folder's `<val_split>-*.tar`, or else data.val_fraction of each training shard's last samples."""
    d, m = cfg.data, cfg.model
    train_urls, val_urls = split_urls(d.root, d.train_split, d.val_split, "data.root")
    if d.val_root:
        val_urls = shard_urls(d.val_root, "data.val_root")
    train_index = shard_index(train_urls, d.shard_index, "data.root")
    train_clips = val_clips = None
    if m.num_frames > 1:  # a model that takes clips: each sample is one clip (docs/video.md)
        from vitrain.data.video import ShardClips

        train_clips = ShardClips(m.num_frames, d.frame_stride, m.in_chans, m.image_size, random=True)
        val_clips = ShardClips(m.num_frames, d.frame_stride, m.in_chans, m.image_size, clips=cfg.task.eval_clips)

    def make(index: ShardIndex, runs: list[Run], clips: Any) -> StreamSet:
        return StreamSet(index, runs, m.in_chans, m.image_size, d.decode_reduce, d.skip_bad, clips,
                         clips.clips if clips is not None else 1)  # fmt: skip

    if val_urls:
        val_index = shard_index(val_urls, d.shard_index, "data.val_root")
        val_index.classes = train_index.classes
        train_runs = [Run(i, 0, c) for i, c in enumerate(train_index.counts) if c]
        val = make(val_index, [Run(i, 0, c) for i, c in enumerate(val_index.counts) if c], val_clips)
    else:
        held = [round(c * d.val_fraction) for c in train_index.counts]
        train_runs = [Run(i, 0, c - v) for i, (c, v) in enumerate(zip(train_index.counts, held, strict=True)) if c > v]
        val_runs = [Run(i, c - v, v) for i, (c, v) in enumerate(zip(train_index.counts, held, strict=True)) if v]
        val = make(train_index, val_runs, val_clips)
    train = make(train_index, train_runs, train_clips)
    if not len(train):
        raise DataError(f"data.root={d.root}: its shards hold no training samples; pack data into them first")
    return train, val


def split_urls(root: str, train_split: str, val_split: str, what: str) -> tuple[list[str], list[str]]:
    """A folder packed by `vitrain data pack` holds `<split>-NNNNNN.tar` per split; anything else is one split."""
    path = Path(root).expanduser()
    if not root.startswith(PIPE) and path.is_dir():
        train = sorted(str(p) for p in path.glob(f"{train_split}-*.tar"))
        if train:
            return train, sorted(str(p) for p in path.glob(f"{val_split}-*.tar"))
    return shard_urls(root, what), []


def shard_index(urls: list[str], given: str, what: str) -> ShardIndex:
    if given:
        index = read_index(Path(given).expanduser(), urls)
        if index is None:
            raise DataError(
                f"data.shard_index={given} does not count every shard of {what} ({describe(urls)}); write it again "
                "with `vitrain data index`"
            )
        return index
    return load_index(urls, what)
