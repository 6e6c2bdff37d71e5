"""The RecordIO source: MXNet / insightface .rec sets read by key and decoded batch by batch (classes and faces).

data.root is a folder holding `<split>.rec` (+ `.idx`, `.lst`, `property`) or one .rec file. Nothing is decoded up
front: a batch's records are read with pread and decoded by data.decode_workers threads (libjpeg-turbo and Pillow
release the GIL while decoding), so a set far larger than memory trains, with the random access, seeded order and
exact resume of the in-memory sources (vitrain/data/loader.py).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from vitrain.config import Config
from vitrain.data.decode import decode_image
from vitrain.data.names import index_names
from vitrain.data.recordio import InsightfaceSet, read_insightface
from vitrain.data.sources import decode_failure, held_out_split
from vitrain.errors import DataError


class RecordSet:
    """Rows of a RecordIO set as a dataset: `read(index)` decodes those records to (B, C, S, S) uint8."""

    def __init__(self, records: InsightfaceSet, classes: list[str], channels: int, size: int, reduce: bool,
                 workers: int, skip_bad: int = 0):  # fmt: skip
        self.records, self.classes, self.channels, self.size = records, classes, channels, size
        self.reduce, self.workers, self.skip_bad = reduce, max(1, workers), skip_bad
        self.rows = np.arange(len(records), dtype=np.int64)
        self.all_labels = torch.from_numpy(np.asarray(records.labels, dtype=np.int64))
        self.bad: dict[str, str] = {}  # records that did not decode, replaced within their batch (data.skip_bad)
        self._pool: ThreadPoolExecutor | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_pool": None}

    @property
    def labels(self) -> torch.Tensor:
        return self.all_labels[torch.from_numpy(self.rows)]

    def subset(self, index: torch.Tensor) -> RecordSet:
        view = RecordSet.__new__(RecordSet)
        view.__dict__.update(self.__dict__)
        view.rows, view._pool = self.rows[index.numpy()], None
        return view

    def relabeled(self, labels: torch.Tensor, classes: list[str]) -> RecordSet:
        """The same rows with new `labels` (one per row, in this set's order) and class names `classes`."""
        view = self.subset(torch.arange(len(self)))
        view.all_labels = torch.full((len(self.records),), -1, dtype=torch.int64)
        view.all_labels[torch.from_numpy(self.rows)] = labels.to(torch.int64)
        view.classes = list(classes)
        return view

    def location(self, row: int) -> str:
        key = self.records.keys[row]
        return f"{self.records.file.path} key {key} (byte {self.records.file.offset(key)})"

    def _decode(self, row: int) -> np.ndarray | str:
        try:
            return decode_image(self.records.image(row), "L" if self.channels == 1 else "RGB", self.size, self.reduce)
        except DataError:
            raise
        except Exception as exc:  # PIL and simplejpeg raise many types for bad images
            return decode_failure(exc)

    def read(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.rows[index.numpy()]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="vitrain-decode")
        decoded = list(self._pool.map(self._decode, rows.tolist()))
        out = np.zeros((len(rows), self.channels, self.size, self.size), dtype=np.uint8)
        labels = self.all_labels[torch.from_numpy(rows)].clone()
        good = [i for i, d in enumerate(decoded) if not isinstance(d, str)]
        for i, d in enumerate(decoded):
            if isinstance(d, str):
                self.bad[self.location(int(rows[i]))] = d
                if len(self.bad) > self.skip_bad or not good:
                    raise DataError(
                        f"cannot decode the image of {self.location(int(rows[i]))} ({d}); pack the set again, or "
                        f"let the run skip bad records: data.skip_bad={self.skip_bad} allows {self.skip_bad}, this is "
                        f"number {len(self.bad)}"
                    )
                decoded[i], labels[i] = decoded[good[0]], labels[good[0]]  # its place goes to the batch's first good
            out[i] = decoded[i]
        return torch.from_numpy(out), labels


def open_records(root: str | Path, split: str | None = None) -> InsightfaceSet | None:
    """The set of `root` (a .rec, or a folder's `<split>.rec`), or None when the folder has no such split."""
    path = Path(root).expanduser()
    if not path.exists():
        raise DataError(f"data.root={root} does not exist; point it at a folder with train.rec or a .rec file")
    if path.is_dir() and split is not None:
        if not (path / f"{split}.rec").is_file():
            return None
        path = path / f"{split}.rec"
    return read_insightface(path)


def class_listing(root: Path) -> Path | None:
    """classes.txt or identities.txt beside the .rec (vitrain data pack writes them), if there is one."""
    folder = root if root.is_dir() else root.parent
    return next((folder / n for n in ("classes.txt", "identities.txt") if (folder / n).is_file()), None)


def check_labels(records: InsightfaceSet, names: list[str], listing: Path) -> None:
    """Refuse a label that `listing`'s class names do not cover: the set was packed with other classes."""
    outside = np.flatnonzero(records.labels >= len(names))
    if outside.size:
        row = int(outside[0])
        raise DataError(
            f"{records.file.path}: key {records.keys[row]} has label {int(records.labels[row])}, but {listing} names "
            f"{len(names)} classes (labels 0 to {len(names) - 1}); fix the label or {listing.name} (one class name a "
            "line, in label order), or pack the set again"
        )


def class_names(root: Path, records: InsightfaceSet) -> list[str]:
    """classes.txt or identities.txt beside the .rec (vitrain data pack writes them), else 0..num_classes-1. A label
    the listing does not name is an error: the names would not be the classes the labels mean."""
    listing = class_listing(root)
    if listing is None:
        return index_names(records.num_classes)
    names = [line for line in listing.read_text().splitlines() if line]
    check_labels(records, names, listing)
    if records.num_classes > len(names):
        raise DataError(
            f"{listing} names {len(names)} classes but {Path(records.file.path).parent / 'property'} says "
            f"num_classes {records.num_classes}; fix one of them, or pack the set again"
        )
    return names


def recordio_source(cfg: Config) -> tuple[RecordSet, RecordSet]:
    """data.source=recordio: `<train_split>.rec` (or the one .rec) and `<val_split>.rec`, else a held-out share."""
    d, m = cfg.data, cfg.model
    root = Path(d.root).expanduser()
    train_records = open_records(root, d.train_split)
    if train_records is None and (root / f"{d.val_split}.rec").is_file():  # the one .rec would train and validate
        raise DataError(
            f"data.root={d.root} has {d.val_split}.rec (data.val_split) but no {d.train_split}.rec (data.train_split), "
            f"and would train on the validation images; restore {root / d.train_split}.rec or pack the set again"
        )
    train_records = train_records or open_records(root)
    classes = class_names(root, train_records)
    make = lambda r: RecordSet(r, classes, m.in_chans, m.image_size, d.decode_reduce, d.decode_workers, d.skip_bad)  # noqa: E731
    train = make(train_records)
    val_records = open_records(root, d.val_split) if root.is_dir() else None
    if val_records is None:
        train_rows, val_rows = held_out_split(len(train), d.val_fraction)
        return train.subset(train_rows), train.subset(val_rows)
    listing = class_listing(root)
    if listing is not None:
        check_labels(val_records, classes, listing)
    return train, make(val_records)
