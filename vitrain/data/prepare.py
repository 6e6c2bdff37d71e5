"""`vitrain data prepare`: decode an ImageFolder tree (or a .zip of one) once into memory-mappable uint8 shards.

With `identities=True` the source is a face tree (identity folders, found as `open_face_tree` finds them): it
becomes one split `all` whose classes are the identities and whose rows go identity by identity, each image's
name in the tree recorded beside its row, so face training can read it by name (vitrain/data/faces.py).

Shards are converted in parallel processes; each worker writes its shard file, then a small `.done.json`
record, both by rename, so an interrupted run leaves only whole shards behind and a rerun converts just the
missing ones. Files that do not decode are skipped and listed (path and reason) in failed.txt; the
manifest with counts and sha256 checksums is written last. The layout is described in prepared.py.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vitrain.data.faces import FaceTree, open_face_tree
from vitrain.data.prepared import FAILED, FORMAT, IDENTITIES, IDENTITIES_SPLIT, MANIFEST, sha256_file
from vitrain.data.sources import (
    PLAN_WORDS,
    ImageTree,
    decode_failure,
    decode_image,
    file_reader,
    find_splits,
    location,
)
from vitrain.errors import DataError
from vitrain.files import atomic_write, folder_problem

PLAN = "plan.json"
GREY_MODES = ("1", "L", "LA", "I", "I;16", "F")


@dataclass
class Shard:
    name: str  # e.g. train-00003; files <name>.npy and <name>.done.json
    split: str
    files: list[str]
    labels: list[int]


@dataclass
class PrepareResult:
    images: int  # images converted in total (all splits)
    failed: list[tuple[str, str]]  # (location, reason) of files that did not decode
    shards_done_before: int  # shards found finished from an earlier, interrupted run
    shards_converted: int
    manifest: Path


def prepare(
    src: Path,
    dst: Path,
    size: int | None = None,
    workers: int = 2,
    shard_size: int = 2048,
    channels: int | None = None,
    progress: Callable[[int], None] | None = None,
    on_plan: Callable[[int], None] | None = None,
    identities: bool = False,
) -> PrepareResult:
    """Convert `src` into `dst`.

    `on_plan(total)` is called once with the number of image files found; `progress(n)` with the number of
    files each finished shard covered (shards finished by an earlier run are reported first, together).
    """
    src, dst = Path(src).expanduser(), Path(dst).expanduser()
    if not src.exists():
        raise DataError(f"prepare source {src} does not exist; give an ImageFolder tree or a .zip of one")
    if shard_size <= 0 or workers <= 0:
        raise DataError(f"--shard-size={shard_size} and --workers={workers} must be positive")
    if size is not None and size <= 0:
        raise DataError(f"--size={size} must be >= 1; leave it out to keep the images' own size")
    problem = folder_problem(dst)
    if problem is not None:
        raise DataError(f"prepare output {problem}; give a new or empty folder (or the one to resume) as DST")
    if identities:
        tree = open_face_tree(src)
        splits, classes = {IDENTITIES_SPLIT: tree.files}, tree.identities
    else:
        tree = ImageTree(src)
        splits = find_splits(tree)
        classes = sorted({c for folders in splits.values() for c in folders})
    probed_channels, sizes = _probe(tree, splits)
    channels = channels or probed_channels
    if channels not in (1, 3):
        raise DataError(f"--channels={channels} must be 1 (grey) or 3 (RGB)")
    if size is None:
        if len(sizes) != 1 or sizes[0][0] != sizes[0][1]:
            seen = ", ".join(f"{w}x{h}" for w, h in sizes[:3])
            raise DataError(f"images in {src} are not all one square size ({seen}); pass --size S to resize to S x S")
        size = sizes[0][0]
    shards = _plan_shards(splits, classes, shard_size)
    plan = {
        "format": FORMAT,
        "source": str(src.resolve()),
        "size": size,
        "channels": channels,
        "shard_size": shard_size,
        "classes": classes,
        "files_sha256": hashlib.sha256("\n".join(f for s in shards for f in s.files).encode()).hexdigest(),
    }
    if identities:
        plan["layout"] = IDENTITIES
    _start_or_resume(dst, plan)
    if on_plan is not None:
        on_plan(sum(len(s.files) for s in shards))

    done = {s.name for s in shards if _is_done(dst, s)}
    todo = [s for s in shards if s.name not in done]
    if progress is not None and done:
        progress(sum(len(s.files) for s in shards if s.name in done))
    mode = "L" if channels == 1 else "RGB"
    jobs = [(str(src), tree.is_zip, s.name, s.files, s.labels, mode, size, str(dst)) for s in todo]
    _run(jobs, workers, progress)
    return _finish(dst, plan, shards, splits, len(done), len(todo))


def _probe(tree: ImageTree | FaceTree, splits: dict[str, dict[str, list[str]]]) -> tuple[int, list[tuple[int, int]]]:
    """(channels, sizes seen) from the first image of every class; 1 channel only if all of them are grey."""
    import io

    from PIL import Image

    firsts = [files[0] for folders in splits.values() for files in folders.values()]
    grey, sizes = True, set()
    with file_reader(tree.root, tree.is_zip) as read:
        for name in firsts:
            try:
                with Image.open(io.BytesIO(read(name))) as img:
                    grey = grey and img.mode in GREY_MODES
                    sizes.add(img.size)
            except Exception:  # a bad first file is reported by the conversion itself
                continue
    return (1 if grey else 3), sorted(sizes)


def _plan_shards(splits: dict[str, dict[str, list[str]]], classes: list[str], shard_size: int) -> list[Shard]:
    shards = []
    label_of = {c: label for label, c in enumerate(classes)}
    for split, folders in sorted(splits.items()):
        files = [(f, label_of[c]) for c, fs in folders.items() for f in fs]
        for k, start in enumerate(range(0, len(files), shard_size)):
            chunk = files[start : start + shard_size]
            shards.append(Shard(f"{split}-{k:05d}", split, [f for f, _ in chunk], [label for _, label in chunk]))
    return shards


def _start_or_resume(dst: Path, plan: dict[str, Any]) -> None:
    """Write the plan into a new `dst`, or check that an existing `dst` was started with the same plan."""
    plan_path = dst / PLAN
    if plan_path.exists():
        old = json.loads(plan_path.read_text())
        changed = [k for k in plan if old.get(k) != plan[k]]
        if changed:
            raise DataError(
                f"{dst} holds a preparation with different {', '.join(PLAN_WORDS.get(k, k) for k in changed)}; "
                f"prepare into a new folder or delete {dst}"
            )
        for tmp in dst.glob("*.tmp"):
            tmp.unlink()  # half-written files of an interrupted run
        return
    if dst.exists() and any(dst.iterdir()):
        raise DataError(f"{dst} is not empty and holds no {PLAN}; prepare into a new or empty folder")
    dst.mkdir(parents=True, exist_ok=True)
    _write_json(plan_path, plan)


def _is_done(dst: Path, shard: Shard) -> bool:
    record = dst / f"{shard.name}.done.json"
    if not record.exists():
        return False
    info = json.loads(record.read_text())
    images = dst / f"{shard.name}.npy"
    return images.exists() and images.stat().st_size == info["bytes"]


def _run(jobs: list[tuple], workers: int, progress: Callable[[int], None] | None) -> None:
    if workers == 1 or len(jobs) <= 1:
        for job in jobs:
            count = _convert_shard(job)
            if progress is not None:
                progress(count)
        return
    pool = ProcessPoolExecutor(max_workers=workers)
    try:
        pending = {pool.submit(_convert_shard, job) for job in jobs}
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                count = future.result()
                if progress is not None:
                    progress(count)
    except BaseException:
        # Interrupted: drop queued shards; shards already running finish and are kept for the rerun.
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def _convert_shard(job: tuple) -> int:
    """Decode one shard's files and write <name>.npy then <name>.done.json; return the number of files."""
    root, is_zip, name, files, labels, mode, size, dst = job
    dst = Path(dst)
    out = np.empty((len(files), 1 if mode == "L" else 3, size, size), dtype=np.uint8)
    kept, kept_names, failed = [], [], []
    with file_reader(root, is_zip) as read:
        for f, label in zip(files, labels, strict=True):
            try:
                out[len(kept)] = decode_image(read(f), mode, size)
            except Exception as exc:  # PIL raises many types for bad files; report and keep going
                failed.append((location(root, is_zip, f), decode_failure(exc)))
                continue
            kept.append(label)
            kept_names.append(f)
    images = dst / f"{name}.npy"
    tmp = dst / f"{name}.npy.tmp"
    with open(tmp, "wb") as fh:
        np.save(fh, out[: len(kept)])
    os.replace(tmp, images)
    record = {"count": len(kept), "labels": kept, "names": kept_names, "failed": failed}
    record["bytes"] = images.stat().st_size
    record["sha256"] = sha256_file(images)
    _write_json(dst / f"{name}.done.json", record)
    return len(files)


def _finish(
    dst: Path,
    plan: dict[str, Any],
    shards: list[Shard],
    splits: dict[str, dict[str, list[str]]],
    done_before: int,
    converted: int,
) -> PrepareResult:
    """Gather shard records into labels files, failed.txt and the manifest (written last)."""
    records = {s.name: json.loads((dst / f"{s.name}.done.json").read_text()) for s in shards}
    files: dict[str, dict[str, Any]] = {}
    manifest_splits: dict[str, Any] = {}
    failed: list[tuple[str, str]] = []
    for split in sorted(splits):
        names = [s.name for s in shards if s.split == split]
        labels = np.array([label for n in names for label in records[n]["labels"]], dtype=np.int64)
        labels_name = f"{split}.labels.npy"
        tmp = dst / f"{labels_name}.tmp"
        with open(tmp, "wb") as fh:
            np.save(fh, labels)
        os.replace(tmp, dst / labels_name)
        files[labels_name] = {"bytes": (dst / labels_name).stat().st_size, "sha256": sha256_file(dst / labels_name)}
        for n in names:
            files[f"{n}.npy"] = {"bytes": records[n]["bytes"], "sha256": records[n]["sha256"]}
            failed += [tuple(x) for x in records[n]["failed"]]
        manifest_splits[split] = {
            "count": int(len(labels)),
            "labels": labels_name,
            "shards": [{"images": f"{n}.npy", "count": records[n]["count"]} for n in names],
        }
        if plan.get("layout") == IDENTITIES:
            manifest_splits[split]["names"] = [name for n in names for name in records[n]["names"]]
    (dst / FAILED).write_text("".join(f"{where}\t{reason}\n" for where, reason in failed))
    manifest = {
        **{k: plan[k] for k in ("format", "source", "size", "channels", "classes", "layout") if k in plan},
        "count": sum(s["count"] for s in manifest_splits.values()),
        "failed": len(failed),
        "splits": manifest_splits,
        "files": files,
    }
    _write_json(dst / MANIFEST, manifest)
    return PrepareResult(manifest["count"], failed, done_before, converted, dst / MANIFEST)


def _write_json(path: Path, data: Any) -> None:
    atomic_write(path, (json.dumps(data, indent=1) + "\n").encode())
