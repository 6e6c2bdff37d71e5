"""`vitrain data pack`: an image folder or zip (classes, face identities, or videos) into tar shards or RecordIO files.

The encoded image bytes are copied unchanged (no decode, no re-encode), so a packed set gives the same images as
its source. Shards: each split's samples are shuffled once (seed 0: a window of consecutive samples then mixes
classes) and written as `<split>-NNNNNN.tar` with `<key>.<ext>` image, `<key>.cls` label and `<key>.json` (label and
source path) members, in parallel processes, one shard file each; a rerun skips the shards already complete, and
index.json (counts, classes) is written last, after every shard's count was read back from the tar. The folder's
pack.json, written first, records what it was packed from: a rerun from the same source continues (shards) or packs
again (RecordIO), one from another source, format or shard size is refused (a new folder holds that pack). RecordIO:
`<split>.rec/.idx/.lst` in im2rec's layout for classes, `train.rec/.idx/.lst` + `property` in insightface's layout
for identities (vitrain/data/recordio.py); a face set's other files (protocol and pair lists) are copied beside.
Videos (`--video`): one sample per clip, the video file's bytes unchanged as its `mp4`/`avi`/... member (shards only).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from vitrain.data.faces import open_face_tree
from vitrain.data.shards import FORMAT, INDEX, ShardIndex, ShardWriter, read_samples, write_index
from vitrain.data.sources import IMAGE_SUFFIXES, PLAN_WORDS, ImageTree, decode_pool, file_reader, find_splits
from vitrain.errors import DataError
from vitrain.files import atomic_write, folder_problem

PACK_SEED = 0
PACK_RECORD = "pack.json"  # what a pack folder was packed from


@dataclass
class Listing:
    """What to pack: per split, (relative name in the source, label); the class or identity names."""

    root: Path
    is_zip: bool
    splits: dict[str, list[tuple[str, int]]]
    classes: list[str]
    layout: str  # "classes" or "identities"


def list_source(src: Path, identities: bool) -> Listing:
    src = Path(src).expanduser()
    if not src.exists():
        raise DataError(f"{src} does not exist; give an image folder tree or a .zip of one")
    if identities:
        tree = open_face_tree(src)
        rows = [(name, label) for label, identity in enumerate(tree.identities) for name in tree.files[identity]]
        return Listing(tree.root, tree.is_zip, {"train": rows}, list(tree.identities), "identities")
    tree = ImageTree(src)
    found = find_splits(tree)  # as `vitrain data prepare` reads a tree
    classes = sorted({c for folders in found.values() for c in folders})
    splits = {
        split: [(name, classes.index(c)) for c, names in folders.items() for name in names]
        for split, folders in found.items()
    }
    return Listing(tree.root, tree.is_zip, splits, classes, "classes")


SPLIT_FOLDERS = ("train", "val", "test")  # video trees: folders that name a split (Kinetics' train/ and val/)


def list_videos(src: Path, val_match: str = "") -> Listing:
    """A video tree (<class>/<clip>.mp4|.avi|..., at any depth, or a .zip of one) as one sample per clip: clips whose
    path matches the regex `val_match` go to split `test` (the shard reader's default data.val_split), the rest to
    `train`; without it a clip under a folder named train, val or test goes to that split, others to `train`."""
    import re

    from vitrain.data.video import VIDEO_SUFFIXES, clip_class, list_clips

    src = Path(src).expanduser()
    if not src.exists():
        raise DataError(f"{src} does not exist; give a folder (or .zip) of <class>/<clip>.mp4 videos")
    tree = ImageTree(src)
    names = list(list_clips(tree, frames=False))
    if not names:
        raise DataError(f"{src} holds no video files ({', '.join(VIDEO_SUFFIXES)}) in <class>/<clip> folders")
    try:
        pattern = re.compile(val_match) if val_match else None
    except re.error as error:
        raise DataError(f"--val-match {val_match!r} is not a regular expression ({error})") from None

    def split_of(name: str) -> str:
        if pattern is not None:
            return "test" if pattern.search(name) else "train"
        return next((part for part in PurePosixPath(name).parts[:-2] if part in SPLIT_FOLDERS), "train")

    classes = sorted({clip_class(n) for n in names})
    splits: dict[str, list[tuple[str, int]]] = {}
    for name in names:
        splits.setdefault(split_of(name), []).append((name, classes.index(clip_class(name))))
    return Listing(tree.root, tree.is_zip, splits, classes, "classes")


def check_pack_folder(out: Path, src: Path, fmt: str, layout: str, **settings: object) -> None:
    """Refuse, in one line naming `out`, a folder that cannot take a pack of `src` (a file, a folder of other files,
    a pack of another source, format, layout or settings) before the source is listed: listing a large tree or zip
    takes minutes, and the refusal needs none of it. start_pack checks the listing's classes and files."""
    _check_folder(out, _record(src, fmt, layout, settings))


def start_pack(listing: Listing, out: Path, fmt: str, **settings: object) -> None:
    """Record in a new (or empty) `out` what it is packed from, or check that an existing pack there was packed from
    the same source the same way; refused in one line naming `out` before anything in it changes."""
    listed = "\n".join(f"{split}/{name}\t{label}" for split, rows in listing.splits.items() for name, label in rows)
    record = {
        **_record(listing.root, fmt, listing.layout, settings),
        "classes": listing.classes,
        "files_sha256": hashlib.sha256(listed.encode()).hexdigest(),
    }
    if not _check_folder(out, record):
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(out / PACK_RECORD, (json.dumps(record, indent=2) + "\n").encode())


def _record(src: Path, fmt: str, layout: str, settings: dict[str, object]) -> dict[str, object]:
    """pack.json's fields known before the source is listed."""
    return {"format": fmt, "source": str(Path(src).expanduser().resolve()), "layout": layout, **settings}


def _check_folder(out: Path, record: dict[str, object]) -> bool:
    """Whether `out` holds a pack.json agreeing with `record` (its keys); a folder that can hold no such pack is
    refused in one line."""
    problem = folder_problem(out)
    if problem is not None:
        raise DataError(f"data pack: {problem}; give a new folder for the pack")
    path = out / PACK_RECORD
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise DataError(f"{path} cannot be read ({error}); pack into a new folder or delete {out}") from None
        old = old if isinstance(old, dict) else {}
        changed = [key for key in record if old.get(key) != record[key]]
        if changed:
            raise DataError(
                f"{out} already holds a pack of {old.get('source', 'another source')} with different "
                f"{', '.join(PLAN_WORDS.get(k, k) for k in changed)}; pack into a new folder or delete {out}"
            )
        return True
    if out.is_dir() and any(out.iterdir()):
        raise DataError(
            f"{out} is not empty and holds no {PACK_RECORD} (a pack begun before vitrain wrote one, or other files); "
            f"pack into a new or empty folder, or delete {out} and pack again"
        )
    return False


def _write_shard(job: tuple[str, bool, str, list[tuple[int, str, int]]]) -> tuple[str, int]:
    root, is_zip, path, rows = job
    writer = ShardWriter(path, max_count=len(rows) + 1)
    with file_reader(root, is_zip) as read:
        for number, name, label in rows:
            ext = PurePosixPath(name).suffix.lower().lstrip(".") or "img"
            meta = json.dumps({"label": label, "path": name}).encode()
            writer.write(f"{number:09d}", {ext: read(name), "cls": str(label).encode(), "json": meta})
    writer.close()
    return path, len(rows)


def pack_shards(listing: Listing, out: Path, shard_samples: int, workers: int) -> dict[str, int]:
    """Write each split as shards of `shard_samples` (resumable); return samples per split, counts verified."""
    start_pack(listing, out, "shards", shard_samples=shard_samples)
    totals = {}
    for split, rows in listing.splits.items():
        order = list(range(len(rows)))
        random.Random(PACK_SEED).shuffle(order)
        jobs = []
        for k, first in enumerate(range(0, len(order), shard_samples)):
            path = out / f"{split}-{k:06d}.tar"
            chosen = [(i, rows[i][0], rows[i][1]) for i in order[first : first + shard_samples]]
            if path.is_file():  # written whole by an earlier run (shards appear under their name only when done)
                continue
            jobs.append((str(listing.root), listing.is_zip, str(path), chosen))
        if workers > 1 and len(jobs) > 1:
            with decode_pool(workers) as pool:
                list(pool.map(_write_shard, jobs))
        else:
            for job in jobs:
                _write_shard(job)
        urls = [str(out / f"{split}-{k:06d}.tar") for k in range(-(-len(order) // shard_samples))]
        counts = [sum(1 for _ in read_samples(u, labels_only=True)) for u in urls]
        expected = [min(shard_samples, len(order) - k * shard_samples) for k in range(len(urls))]
        if counts != expected:
            bad = next(u for u, c, e in zip(urls, counts, expected, strict=True) if c != e)
            raise DataError(f"shard {bad} holds a different number of samples than packed; delete it and pack again")
        write_index(out / INDEX, ShardIndex(urls, counts, listing.classes, listing.layout), {"format": FORMAT})
        totals[split] = sum(counts)
    return totals


def pack_recordio(listing: Listing, out: Path) -> dict[str, int]:
    """Write each split as RecordIO (im2rec layout, or insightface's for identities); face sets' text files too."""
    from vitrain.data import recordio

    start_pack(listing, out, "recordio")
    totals = {}
    with file_reader(listing.root, listing.is_zip) as read:
        if listing.layout == "identities":
            rows = listing.splits["train"]
            images = ((label, read(name), name) for name, label in rows)
            size = _image_size(read(rows[0][0]))
            recordio.write_insightface(out, images, len(listing.classes), size)
            (out / "identities.txt").write_text("\n".join(listing.classes) + "\n")
            _copy_side_files(listing, out, read)
            totals["train"] = len(rows)
        else:
            for split, rows in listing.splits.items():
                recordio.write_im2rec(out, split, ((label, read(name), name) for name, label in rows))
                totals[split] = len(rows)
            (out / "classes.txt").write_text("\n".join(listing.classes) + "\n")
    for split, n in totals.items():  # read every record's header back: the counts must match
        found = len(recordio.read_insightface(out / f"{split}.rec"))
        if found != n:
            raise DataError(f"{out / split}.rec holds {found} images but {n} were packed; delete it and pack again")
    return totals


def _image_size(raw: bytes) -> tuple[int, int]:
    import io

    from PIL import Image

    with Image.open(io.BytesIO(raw)) as img:
        return img.height, img.width


def _copy_side_files(listing: Listing, out: Path, read) -> None:
    """A face set's non-image files (protocols, pair lists, READMEs) keep their paths beside the records, so the
    task reads its verification pairs (e.g. CFP's Protocol folder) from the packed folder as from the source."""
    for name in ImageTree(listing.root).names:  # the tree's or zip's every name; folders end with "/"
        if name.endswith("/") or name.lower().endswith(IMAGE_SUFFIXES) or "__MACOSX" in name:
            continue
        target = out / name
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(target, read(name))
