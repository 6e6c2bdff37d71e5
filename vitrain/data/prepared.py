"""Reading prepared data sets: checksum-verified, memory-mapped uint8 shards with labels and class names.

Layout written by `vitrain data prepare` (vitrain/data/prepare.py):

    manifest.json            format, size, channels, classes, splits (shards, counts), files (bytes, sha256)
    <split>-<k>.npy          uint8 (n, C, size, size), one shard per k, memory-mapped at load
    <split>.labels.npy       int64 (N,) labels of the whole split, in shard order
    failed.txt               files that did not decode: path <TAB> reason
    verified.json            stamp of files already hashed (see `verify_files`)

A face tree prepared with `--identities` has `layout: "identities"`, one split `all` whose classes are the
identities, and that split's `names`: each row's image name in the source tree, in row order.

Verification: every load checks each file's size against the manifest. The sha256 is computed when the file
is not in the stamp or its (size, mtime, ctime, inode) differ from the stamped ones; any write to a file
changes its ctime, which user space cannot set back, so a changed file is re-hashed and caught.
`data.verify=always` hashes every file on every load.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitrain.errors import DataError
from vitrain.files import atomic_write

FORMAT = "vitrain-prepared/1"
MANIFEST = "manifest.json"
IDENTITIES = "identities"  # the manifest's layout of a prepared face tree
IDENTITIES_SPLIT = "all"  # its one split
STAMP = "verified.json"
# A file changed within this long after it was hashed could keep the same coarse timestamps: do not stamp it.
RACY_WINDOW_NS = 2_000_000_000
AGAIN = "prepare the data again (vitrain data prepare SRC DST) into a new folder"


def is_prepared(root: Path) -> bool:
    return root.is_dir() and (root / MANIFEST).is_file()


def sha256_file(path: Path, chunk_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(root: Path, key: str = "data.root") -> dict[str, Any]:
    """The manifest of the prepared folder `root` (`key`: the config key or flag that named it, for the error)."""
    path = root / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except NotADirectoryError:
        raise DataError(
            f"{key}={root} is a file; prepared data is a folder made by `vitrain data prepare SRC DIR` (an image "
            "tree or .zip is read as it is by data.source=folder)"
        ) from None
    except FileNotFoundError:
        raise DataError(f"{root} is not prepared data (no {MANIFEST}); run `vitrain data prepare SRC {root}`") from None
    except json.JSONDecodeError as exc:
        raise DataError(f"{path} is not valid JSON ({exc}); prepare the data again into a new folder") from None
    if not isinstance(manifest, dict):
        raise DataError(
            f"{path} holds a JSON {type(manifest).__name__}, not the object `vitrain data prepare` writes; {AGAIN}"
        )
    if manifest.get("format") != FORMAT:
        raise DataError(f"{path} has format {manifest.get('format')!r}, expected {FORMAT!r}; prepare the data again")
    check_manifest(path, manifest)
    return manifest


def _is_plain_name(name: Any) -> bool:
    """A file name inside the prepared folder itself: no folder part, not `.` or `..`."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


def _is_count(value: Any, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """Refuse a manifest whose structure is not the one `vitrain data prepare` writes, naming the entry."""

    def bad(where: str, what: str) -> DataError:
        if where in ("size", "channels", "classes", "files", "splits") and where not in manifest:
            what = "is missing" + what[what.index(",") :]
        return DataError(f"{path}: {where} {what}; {AGAIN}")

    for key in ("size", "channels"):
        if not _is_count(manifest.get(key), 1):
            raise bad(key, f"is {_shown(manifest.get(key))}, expected a whole number >= 1")
    classes = manifest.get("classes")
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise bad("classes", f"is {_shown(classes)}, expected a list of class names")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise bad("files", f"is {_shown(files)}, expected an object of file name -> bytes and sha256")
    for name, entry in files.items():
        if not _is_plain_name(name):
            raise bad(f"files[{_shown(name)}]", "is not a plain file name inside the prepared folder")
        if not isinstance(entry, dict) or not _is_count(entry.get("bytes")) or not isinstance(entry.get("sha256"), str):
            raise bad(f"files[{_shown(name)}]", f"is {_shown(entry)}, expected bytes (a whole number) and sha256")
    splits = manifest.get("splits")
    if not isinstance(splits, dict) or not splits:
        raise bad("splits", f"is {_shown(splits)}, expected an object of split name -> labels and shards")
    if manifest.get("layout") == IDENTITIES and IDENTITIES_SPLIT not in splits:
        raise bad("splits", f"has no split {IDENTITIES_SPLIT!r}, which layout {IDENTITIES!r} keeps its images in")
    for split, info in splits.items():
        where = f"splits.{split}"
        if not isinstance(info, dict):
            raise bad(where, f"is {_shown(info)}, expected an object with labels and shards")
        names = [("labels", info.get("labels"))]
        shards = info.get("shards")
        if not isinstance(shards, list):
            raise bad(f"{where}.shards", f"is {_shown(shards)}, expected a list of shards")
        for k, shard in enumerate(shards):
            if not isinstance(shard, dict):
                raise bad(f"{where}.shards[{k}]", f"is {_shown(shard)}, expected an object with images and count")
            if not _is_count(shard.get("count")):
                raise bad(
                    f"{where}.shards[{k}].count", f"is {_shown(shard.get('count'))}, expected a whole number >= 0"
                )
            names.append((f"shards[{k}].images", shard.get("images")))
        for key, name in names:
            if not _is_plain_name(name):
                raise bad(f"{where}.{key}", f"is {_shown(name)}, expected a plain file name inside the prepared folder")
            if name not in files:
                raise bad(f"{where}.{key}", f"names {_shown(name)}, which files does not list (so it has no checksum)")
        total = sum(shard["count"] for shard in shards)
        if "count" in info and info["count"] != total:
            raise bad(f"{where}.count", f"is {_shown(info['count'])} but its shards' counts add up to {total}")
        if manifest.get("layout") == IDENTITIES:
            listed = info.get("names")
            if not isinstance(listed, list) or len(listed) != total or not all(isinstance(n, str) for n in listed):
                raise bad(f"{where}.names", f"is not a list of {total} image names, one per row")


def verify_files(root: Path, files: dict[str, dict[str, Any]], always_hash: bool = False) -> int:
    """Check every file against the manifest's size and sha256; return how many files were hashed."""
    stamp_path = root / STAMP
    try:
        stamp = json.loads(stamp_path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        stamp = {}
    fix = AGAIN
    hashed, fresh = 0, {}
    for name, expected in files.items():
        path = root / name
        try:
            st = path.stat()
        except FileNotFoundError:
            raise DataError(f"prepared file {path} is missing; {fix}") from None
        if st.st_size != expected["bytes"]:
            raise DataError(
                f"prepared file {path} is {st.st_size} bytes but {MANIFEST} records {expected['bytes']}: "
                f"it was truncated or changed; {fix}"
            )
        identity = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, expected["sha256"]]
        if not always_hash and stamp.get(name) == identity:
            fresh[name] = identity
            continue
        started_ns = time.time_ns()
        actual = sha256_file(path)
        hashed += 1
        if actual != expected["sha256"]:
            raise DataError(
                f"prepared file {path} fails its sha256 checksum (got {actual[:12]}..., {MANIFEST} records "
                f"{expected['sha256'][:12]}...): it was changed or corrupted; {fix}"
            )
        if st.st_ctime_ns < started_ns - RACY_WINDOW_NS:
            fresh[name] = identity
    if fresh != stamp:
        try:
            atomic_write(stamp_path, json.dumps(fresh).encode())
        except OSError:
            pass  # a read-only copy of the data still loads; it is just hashed again next time
    return hashed


FAILED = "failed.txt"  # files that did not decode when the data was prepared: path <TAB> reason, one a line


def failed_files(root: Path) -> list[tuple[str, str]]:
    """(path, reason) of each file `vitrain data prepare` could not decode into the prepared folder `root`."""
    listing = Path(root) / FAILED
    if not listing.is_file():
        return []
    rows = [line.partition("\t") for line in listing.read_text().splitlines() if line.strip()]
    return [(where, reason) for where, _, reason in rows]


class PreparedSet:
    """One split of prepared data: uint8 shards memory-mapped, labels in memory; `read` gathers a batch."""

    def __init__(self, root: Path, manifest: dict[str, Any], split: str, rows: np.ndarray | None = None):
        info = manifest["splits"][split]
        self.root = root
        self.split = split
        self.classes: list[str] = list(manifest["classes"])
        self.size: int = manifest["size"]
        self.channels: int = manifest["channels"]
        self.shards = [self._open_shard(s["images"], s["count"]) for s in info["shards"]]
        counts = [s["count"] for s in info["shards"]]
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.all_labels = torch.from_numpy(self._open_labels(info["labels"], int(self.starts[-1])))
        self.rows = rows  # None: every row of the split; else the rows of a subset (e.g. a held-out share)

    def _load(self, name: str, mmap_mode: str | None = None) -> np.ndarray:
        path = self.root / name
        try:
            return np.load(path, mmap_mode=mmap_mode, allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise DataError(f"prepared file {path} is not a numeric .npy array ({exc}); {AGAIN}") from None

    def _open_shard(self, name: str, count: int) -> np.ndarray:
        """The shard `name`, memory-mapped, after checking it holds `count` uint8 images of the manifest's shape."""
        images = self._load(name, mmap_mode="r")
        expected = (count, self.channels, self.size, self.size)
        if images.dtype != np.uint8 or images.shape != expected:
            raise DataError(
                f"prepared file {self.root / name} holds {images.dtype} {tuple(images.shape)} but {MANIFEST} "
                f"records uint8 {expected} (count, channels, size, size); {AGAIN}"
            )
        return images

    def _open_labels(self, name: str, count: int) -> np.ndarray:
        labels = self._load(name)
        if labels.dtype.kind not in "iu" or labels.shape != (count,):
            raise DataError(
                f"prepared file {self.root / name} holds {labels.dtype} {tuple(labels.shape)} but {MANIFEST} records "
                f"{count} integer labels for split {self.split}'s shards; {AGAIN}"
            )
        return labels.astype(np.int64)

    def __len__(self) -> int:
        return len(self.rows) if self.rows is not None else int(self.starts[-1])

    @property
    def labels(self) -> torch.Tensor:
        return self.all_labels if self.rows is None else self.all_labels[torch.from_numpy(self.rows)]

    def subset(self, index: torch.Tensor) -> PreparedSet:
        chosen = index.numpy() if self.rows is None else self.rows[index.numpy()]
        view = PreparedSet.__new__(PreparedSet)
        view.__dict__.update(self.__dict__)
        view.rows = np.asarray(chosen, dtype=np.int64)
        return view

    def relabeled(self, labels: torch.Tensor, classes: list[str]) -> PreparedSet:
        """The same rows with new `labels` (one per row, in this set's order) and class names `classes`."""
        rows = torch.arange(len(self)) if self.rows is None else torch.from_numpy(self.rows)
        view = PreparedSet.__new__(PreparedSet)
        view.__dict__.update(self.__dict__)
        view.all_labels = torch.full((int(self.starts[-1]),), -1, dtype=torch.int64)
        view.all_labels[rows] = labels.to(torch.int64)
        view.classes = list(classes)
        return view

    def read(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch of uint8 images (B, C, S, S) and labels (B,), in the order of `index`."""
        rows = index.numpy() if self.rows is None else self.rows[index.numpy()]
        shard = np.searchsorted(self.starts, rows, side="right") - 1
        out = np.empty((len(rows), self.channels, self.size, self.size), dtype=np.uint8)
        for k in np.unique(shard):
            sel = np.flatnonzero(shard == k)
            out[sel] = self.shards[k][rows[sel] - self.starts[k]]
        return torch.from_numpy(out), self.all_labels[torch.from_numpy(rows)]


def open_prepared(root: Path, verify: str = "once") -> dict[str, PreparedSet]:
    """All splits of a prepared folder, after checking every file's size and checksum (see module docstring)."""
    manifest = read_manifest(root)
    verify_files(root, manifest["files"], always_hash=verify == "always")
    return {split: PreparedSet(root, manifest, split) for split in manifest["splits"]}
