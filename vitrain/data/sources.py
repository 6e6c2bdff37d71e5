"""Data sources decoded once into uint8 tensors: scikit-learn digits, ImageFolder trees or zips, synthetic."""

from __future__ import annotations

import contextlib
import re
import zipfile
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from vitrain import registry
from vitrain.config import Config
from vitrain.data.decode import decode_image
from vitrain.data.names import index_names
from vitrain.data.prepared import PreparedSet, failed_files, is_prepared, open_prepared
from vitrain.errors import DataError


def decode_pool(workers: int) -> ProcessPoolExecutor:
    """The processes that decode a dataset's files ahead of training (data.decode_workers), each with one thread, as
    DataLoader's workers run: they are forked, and a fork of a process whose OpenMP pool has run (a second run in the
    process, or torch work before the first) hung in its first parallel op (F.interpolate, in video decoding)."""
    return ProcessPoolExecutor(max_workers=workers, initializer=torch.set_num_threads, initargs=(1,))


IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".pgm", ".ppm", ".bmp")
# The held-out split must not move when the training seed changes.
SPLIT_SEED = 0


@dataclass
class Skipped:
    """Files of a source that did not become samples: images that did not decode (location, reason), and files
    without an image suffix (locations)."""

    undecodable: list[tuple[str, str]] = field(default_factory=list)
    non_images: list[str] = field(default_factory=list)
    deeper: list[str] = field(default_factory=list)  # images in folders below a class folder (locations)
    held_out: str = ""  # where validation was held out of train for want of data.val_split: why, in one line

    def lines(self) -> list[str]:
        lines = [f"data: skipped {where}: {reason}" for where, reason in self.undecodable]
        if self.held_out:
            lines.append(self.held_out)
        if self.non_images:
            lines.append(
                f"data: {len(self.non_images)} file(s) without an image suffix not read: {_some(self.non_images)}"
            )
        if self.deeper:
            lines.append(
                f"data: {len(self.deeper)} image(s) in folders below a class folder not read (the tree is "
                f"<split>/<class>/<image>; move them up into their class folder): {_some(self.deeper)}"
            )
        return lines


def _some(locations: list[str]) -> str:
    return ", ".join(locations[:5]) + (", ..." if len(locations) > 5 else "")


@dataclass
class ImageSet:
    """A whole split in memory: images (N, C, H, W) uint8, labels (N,) int64, and class names."""

    images: torch.Tensor
    labels: torch.Tensor
    classes: list[str]
    skipped: Skipped = field(default_factory=Skipped)  # what the source passed over (the train set carries it)

    def __post_init__(self) -> None:
        # Class indices of another integer dtype (uint8, int32) are the same labels; the loss, mixup's one-hot and
        # padding take int64.
        if (
            isinstance(self.labels, torch.Tensor)
            and not self.labels.is_floating_point()
            and self.labels.dtype
            not in (
                torch.int64,
                torch.bool,
            )
        ):
            self.labels = self.labels.long()

    def __len__(self) -> int:
        return self.labels.shape[0]

    @property
    def channels(self) -> int:
        return self.images.shape[1]

    def read(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch of uint8 images and their labels, in the order of `index`."""
        return self.images[index], self.labels[index]

    def subset(self, index: torch.Tensor) -> ImageSet:
        return ImageSet(self.images[index], self.labels[index], self.classes, self.skipped)


def build_datasets(cfg: Config, source: Any = None) -> tuple[ImageSet | PreparedSet, ImageSet | PreparedSet]:
    """Return (train, val) for the configured source (the registry's `data.source`: digits, folder, prepared,
    synthetic, or a user's `mypkg.module:function` taking the config), checked against the model's input shape.

    A folder source whose root holds a manifest.json is read as prepared data (`vitrain data prepare`). `source`
    (the library's `data=`): a (train, val) pair of datasets with `classes`, `__len__`, `read(index)` and
    `channels` (ImageSet's), or a function of the config returning one, instead of `data.source`'s. What does not
    fit (the pair, a dataset's attributes, a handed-in set's first sample and labels, val against train) is one
    DataError line, before any loader or run folder is made.
    """
    handed_in = source is not None
    made = source if handed_in else registry.lookup("data", cfg.data.source)
    where = "data=" if handed_in else f"data.source={cfg.data.source}"
    if callable(made):
        _check_takes_config(made, where)
        made = made(cfg)
    train, val = _pair(made, where)
    for split, data in (("train", train), ("val", val)):  # a user's source (data=, an import path) as vitrain's
        _check_sample(data, split, where, cfg.model.in_chans)
    source = cfg.data.source if not handed_in else "(given)"
    m = cfg.model
    channels = train.channels
    if channels != m.in_chans:
        raise DataError(
            f"data.source={source} has {channels}-channel images but model.in_chans={m.in_chans}; "
            f"set model.in_chans={channels}"
        )
    if getattr(train, "num_frames", 1) != m.num_frames:
        raise DataError(
            f"model.num_frames={m.num_frames} takes clips; data.source={source} gives "
            f"{getattr(train, 'num_frames', 1)}-frame samples: set data.source=video (docs/video.md)"
        )
    if len(train.classes) != m.num_classes:
        raise DataError(
            f"data.source={source} has {len(train.classes)} classes but model.num_classes={m.num_classes}; "
            f"set model.num_classes={len(train.classes)}"
        )
    _check_val(train, val, where)
    return train, val


def _check_val(train: Any, val: Any, where: str) -> None:
    """The validation set is read by the same model as the training set: the same channels, frames and classes,
    and at least one sample (every run is evaluated)."""
    for what, of in (("-channel images", "channels"), ("-frame samples", "num_frames")):
        theirs, ours = getattr(train, of, 1), getattr(val, of, 1)
        if ours != theirs:
            raise DataError(
                f"{where}: the val set has {ours}{what} but the train set {theirs}{what} (model.{_MODEL_KEYS[of]}="
                f"{theirs}); give both the same"
            )
    if list(val.classes) != list(train.classes):
        raise DataError(
            f"{where}: the val set's {len(val.classes)} class names differ from the train set's {len(train.classes)} "
            "(a label is an index into them); give both the same class names in the same order"
        )
    if len(val) == 0:
        fix = (
            "give it samples" if where == "data=" else "give it samples (data.val_root, or a larger data.val_fraction)"
        )
        raise DataError(f"{where} gives an empty val set; every run is evaluated on it: {fix}")


_MODEL_KEYS = {"channels": "in_chans", "num_frames": "num_frames"}


# What build_datasets reads of a dataset (ImageSet's): a stream (data/stream.py) is read by its workers, not `read`.
DATASET_NEEDS = ("classes", "channels", "__len__", "read")


def _check_takes_config(made: Callable, where: str) -> None:
    """A data source function can be called with the config (one positional argument), else a DataError."""
    if not registry.takes(made, None):
        raise DataError(
            f"{where} is a function that cannot be called with the config alone; give a function of the config "
            "(data=lambda cfg: (train, val)) or the (train, val) pair itself"
        )


def _pair(made: Any, where: str) -> tuple[Any, Any]:
    """(train, val) from what a data source gave, each with DATASET_NEEDS, else a DataError naming what is missing."""
    expected = "a (train, val) pair of datasets with classes, channels, __len__ and read(index) (vitrain.data.ImageSet)"
    if not isinstance(made, tuple | list) or len(made) != 2:
        raise DataError(f"{where} gave {_what(made)}, not {expected}")
    for split, data in zip(("train", "val"), made, strict=True):
        needs = [n for n in DATASET_NEEDS if not (n == "read" and getattr(data, "streamed", False))]
        missing = [n for n in needs if not hasattr(data, n)]
        if missing:
            hint = (
                "; wrap tensors as vitrain.data.ImageSet(images, labels, classes)"
                if isinstance(data, torch.Tensor)
                else ""
            )
            raise DataError(
                f"{where}: the {split} set ({_what(data)}) has no {', '.join(missing)}; give {expected}{hint}"
            )
    return made[0], made[1]


def _what(obj: Any) -> str:
    """What a data source gave, for an error: a tuple of 3, an ImageSet, a NoneType."""
    name = type(obj).__name__
    size = f" of {len(obj)}" if isinstance(obj, tuple | list) else ""
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}{size}"


def _check_sample(data: Any, split: str, where: str, in_chans: int) -> None:
    """The first sample a dataset reads is a (1, C, H, W) image in 0-255 with a torch.long label, and its
    labels (all of them where it holds a `labels` tensor, as ImageSet does) are class indices: once, at set-up."""
    if getattr(data, "streamed", False) or len(data) == 0:
        return
    with torch.random.fork_rng(devices=[]):  # a set that draws as it reads (random clips) leaves the seed's draws be
        images, labels = data.read(torch.zeros(1, dtype=torch.long))
    shape = tuple(images.shape) if isinstance(images, torch.Tensor) else None
    if shape is None or len(shape) != 4:
        got = f"shape {shape[1:]}" if shape is not None else f"a {type(images).__name__}"
        raise DataError(f"{where}: the {split} set's images are {got} per sample; give a uint8 tensor (N, C, H, W)")
    if shape[1] != in_chans and shape[-1] in (in_chans, 1, 3) and shape[1] not in (1, 3):
        raise DataError(
            f"{where}: the {split} set's images are channels-last ({', '.join(map(str, shape[1:]))}) per sample; "
            "images must be channels-first (N, C, H, W): images.permute(0, 3, 1, 2)"
        )
    held = getattr(data, "images", None)  # the whole set where it holds one tensor (ImageSet), else the sample
    pixels = held if isinstance(held, torch.Tensor) else images
    if pixels.is_floating_point() and pixels.numel() and float(pixels.max()) <= 1.0:
        raise DataError(
            f"{where}: the {split} set's images are {images.dtype} in [0, 1]; vitrain reads images in 0-255 (data.mean "
            "and data.std are in that scale, so these would train near black): give uint8 images, e.g. "
            "(images * 255).round().to(torch.uint8)"
        )
    held = getattr(data, "labels", None)
    labels = held if isinstance(held, torch.Tensor) else labels
    if not isinstance(labels, torch.Tensor) or labels.dtype != torch.int64 or labels.ndim != 1:
        what = f"{labels.dtype} {tuple(labels.shape)}" if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise DataError(f"{where}: the {split} set's labels are {what}; give class indices, a torch.long tensor (N,)")
    classes = len(data.classes)
    if len(labels) and not (0 <= int(labels.min()) and int(labels.max()) < classes):
        raise DataError(
            f"{where}: the {split} set's labels run from {int(labels.min())} to {int(labels.max())}, but it has "
            f"{classes} classes; labels are class indices in [0, {classes}) (one name in classes per index)"
        )


# ---------------------------------------------------------------------------------------------- digits


def digits_source(cfg: Config) -> tuple[ImageSet, ImageSet]:
    """scikit-learn's bundled 1,797 handwritten 8x8 digits, upsampled, 80/20 stratified split."""
    image_size = cfg.model.image_size
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    pixels = torch.from_numpy(bunch.images).float().unsqueeze(1) * (255.0 / 16.0)
    if image_size != pixels.shape[-1]:
        pixels = F.interpolate(pixels, size=(image_size, image_size), mode="bilinear", align_corners=False)
    images = pixels.round().clamp(0, 255).to(torch.uint8)
    labels = torch.from_numpy(bunch.target).long()
    classes = [str(c) for c in bunch.target_names]
    train_idx, val_idx = train_test_split(
        np.arange(len(labels)), test_size=0.2, stratify=bunch.target, random_state=SPLIT_SEED
    )
    data = ImageSet(images, labels, classes)
    return data.subset(torch.from_numpy(train_idx)), data.subset(torch.from_numpy(val_idx))


# ---------------------------------------------------------------------------------------------- folder


class ImageTree:
    """Read access to an ImageFolder tree on disk or inside a .zip, with paths relative to its top."""

    def __init__(self, root: Path):
        self.root = root
        self.is_zip = root.suffix.lower() == ".zip" and not root.is_dir()  # an unpacker may name a folder data.zip
        if self.is_zip:
            try:
                with zipfile.ZipFile(root) as archive:
                    self.names = archive.namelist()  # folders end with "/", as on disk below
            except zipfile.BadZipFile as error:
                raise unreadable_zip(f"data.root={root}", root, error) from None
        else:
            self.names = [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()]
            self.names += [p.relative_to(root).as_posix() + "/" for p in root.rglob("*") if p.is_dir()]

    def sibling_splits(self, split: str) -> list[str]:
        """The folders beside `<split>/` (the other splits a tree has), found where split_prefix finds it."""
        prefix = self.split_prefix(split) or f"{split}/"
        parent = prefix[: -len(split) - 1]
        return sorted(
            {n[len(parent) :].split("/")[0] for n in self.names if n.startswith(parent) and "/" in n[len(parent) :]}
            - {split}
        )

    def split_prefix(self, split: str) -> str | None:
        """Find `<split>/` at the top or one folder down (zips often hold one top folder)."""
        tops = sorted({PurePosixPath(n).parts[0] for n in self.names if "/" in n})
        for prefix in [f"{split}/"] + [f"{t}/{split}/" for t in tops]:
            if any(n.startswith(prefix) for n in self.names):
                return prefix
        return None

    def class_folders(self, prefix: str) -> dict[str, list[str]]:
        folders: dict[str, list[str]] = {}
        for name in self.names:
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix) :].rstrip("/").split("/")
            if rest == [""]:
                continue  # the split folder itself
            if len(rest) == 1 and name.endswith("/"):
                folders.setdefault(rest[0], [])
            elif len(rest) == 2 and rest[1].lower().endswith(IMAGE_SUFFIXES):
                folders.setdefault(rest[0], []).append(name)
        return {k: sorted(v) for k, v in sorted(folders.items())}

    def deeper_images(self, prefix: str) -> list[str]:
        """Images under `prefix` below their class folder's own level (split/class/sub/image): never read."""
        return [
            self.location(n)
            for n in self.names
            if n.startswith(prefix) and n[len(prefix) :].count("/") > 1 and n.lower().endswith(IMAGE_SUFFIXES)
        ]

    def location(self, name: str) -> str:
        return location(self.root, self.is_zip, name)

    def non_images(self) -> list[str]:
        """Files in class folders (split/class/file, also one folder down) that have no image suffix: never read."""
        found = []
        for name in self.names:
            parts = name.split("/")
            if name.endswith("/") or len(parts) < 3 or parts[-1].lower().endswith(IMAGE_SUFFIXES):
                continue
            found.append(self.location(name))
        return found


def unreadable_zip(what: str, root: Path, error: zipfile.BadZipFile) -> DataError:
    """The error for a .zip that zipfile cannot open: most often one cut short by an interrupted download or copy (a
    zip's directory sits at its end), so the fix is a fresh copy; `python -m zipfile -t` checks one without unzip."""
    return DataError(
        f"{what} is not a readable zip file ({error}, {root.stat().st_size:,} bytes: cut short by an interrupted "
        f"download or copy, or not a zip); copy or download it again (python -m zipfile -t {root} checks it), or "
        "give the unpacked folder"
    )


def location(root: str | Path, is_zip: bool, name: str) -> str:
    """How a file of a tree is named in messages: `archive.zip:inner/path` or the path on disk."""
    return f"{root}:{name}" if is_zip else str(Path(root) / name)


@contextlib.contextmanager
def file_reader(root: str | Path, is_zip: bool) -> Iterator[Callable[[str], bytes]]:
    """Bytes of a tree's files by relative name: one open archive for a zip (picklable inputs for workers)."""
    if not is_zip:
        yield lambda name: (Path(root) / name).read_bytes()
        return
    with zipfile.ZipFile(root) as archive:
        yield archive.read


def folder_source(cfg: Config) -> tuple[ImageSet | PreparedSet, ImageSet | PreparedSet]:
    if is_prepared(Path(cfg.data.root).expanduser()):
        return prepared_source(cfg)
    root = Path(cfg.data.root).expanduser()
    if not root.exists():
        raise DataError(f"data.root={root} does not exist; point it at an ImageFolder tree or a .zip of one")
    if root.is_dir() and not any(root.iterdir()):
        raise DataError(f"data.root={root} is empty; it needs <split>/<class>/<image> files")
    tree = ImageTree(root)
    skipped = Skipped(non_images=tree.non_images())
    train = _read_split(tree, cfg.data.train_split, cfg, skipped, required=True)
    assert train is not None
    val = _read_split(tree, cfg.data.val_split, cfg, skipped, required=False, classes=train.classes)
    if val is None:
        train_rows, val_rows = held_out_split(len(train), cfg.data.val_fraction)
        skipped.held_out = held_out_line(cfg, tree.sibling_splits(cfg.data.train_split))
        return train.subset(train_rows), train.subset(val_rows)
    return train, val


def list_split(
    tree: ImageTree, split: str, required: bool, classes: list[str] | None = None
) -> tuple[list[str], list[int], list[str]] | None:
    """(image names, labels, class names) of one split, or None when an optional split is absent."""
    prefix = tree.split_prefix(split)
    if prefix is None:
        if required:
            raise DataError(
                f"data.root={tree.root} has no '{split}' folder; expected {split}/<class>/<image> "
                f"(or set data.train_split)"
            )
        return None
    folders = checked_class_folders(tree, prefix)
    classes = classes or list(folders)
    unknown = sorted(set(folders) - set(classes))
    if unknown:
        raise DataError(f"{tree.location(prefix)} has classes {unknown} that the train split does not have")
    files = [(f, classes.index(c)) for c, fs in folders.items() for f in fs]
    return [f for f, _ in files], [label for _, label in files], classes


def checked_class_folders(tree: ImageTree, prefix: str) -> dict[str, list[str]]:
    """Class folders under `prefix` with their images; an empty class folder is an error naming it."""
    folders = tree.class_folders(prefix)
    if not folders:
        raise DataError(f"{tree.location(prefix)} holds no class folders with images ({', '.join(IMAGE_SUFFIXES)})")
    for name, files in folders.items():
        if not files:
            below = prefix + name + "/"
            images = [n for n in tree.names if n.lower().endswith(IMAGE_SUFFIXES)]
            deeper = [tree.location(n) for n in images if n.startswith(below)]
            if deeper:
                raise DataError(
                    f"class folder {tree.location(prefix + name)} holds images only in folders below it (e.g. "
                    f"{deeper[0]}); the tree is <split>/<class>/<image>: move them up into it"
                )
            raise DataError(f"class folder {tree.location(prefix + name)} is empty; add images or remove it")
    return folders


# A prepare plan's or pack record's keys as an error line names them where they changed
PLAN_WORDS = {"files_sha256": "list of source files (images added, removed or renamed)"}

KNOWN_SPLITS = ("train", "val", "valid", "validation", "test")  # a lone folder of these names is a split, not a class


def find_splits(tree: ImageTree) -> dict[str, dict[str, list[str]]]:
    """{split: {class: images}} of an image tree, for `vitrain data prepare` and `pack`: a split is the folder holding
    <class>/<image> folders, at any depth (a zip's one top folder); a bare class tree is 'train'. Images at two depths
    (a class folder holding class folders) and a class that another split has and 'train' lacks are refused."""
    prefixes = set()
    for name in tree.names:
        parts = PurePosixPath(name).parts
        if name.endswith("/") or not name.lower().endswith(IMAGE_SUFFIXES) or len(parts) < 2:
            continue
        if any(p.startswith(".") or p == "__MACOSX" for p in parts):
            continue
        prefixes.add("/".join(parts[:-2]) + "/" if len(parts) > 2 else "")
    if not prefixes:
        raise DataError(f"{tree.root} holds no images ({', '.join(IMAGE_SUFFIXES)}) in <class>/ folders")
    for outer in sorted(prefixes):
        inner = next((p for p in sorted(prefixes) if p != outer and p.startswith(outer)), None)
        if inner is not None:  # e.g. train/cat/a.jpg beside val/1.jpg (a folder of unlabelled images)
            depth = lambda n, p: n.startswith(p) and n[len(p) :].count("/") == 1  # noqa: E731  (p/<folder>/<image>)
            shallow = next(n for n in sorted(tree.names) if depth(n, outer) and n.lower().endswith(IMAGE_SUFFIXES))
            deep = next(n for n in sorted(tree.names) if depth(n, inner) and n.lower().endswith(IMAGE_SUFFIXES))
            raise DataError(
                f"{tree.root} has images at two depths, {tree.location(shallow)} and {tree.location(deep)}; keep one "
                "<split>/<class>/<image> tree (move a folder of unlabelled images, or one nested in a class, out)"
            )
    splits: dict[str, dict[str, list[str]]] = {}
    where: dict[str, str] = {}
    for prefix in sorted(prefixes):
        last = PurePosixPath(prefix).name if prefix else ""
        split = last if (len(prefixes) > 1 or last in KNOWN_SPLITS) else "train"
        if split in splits:
            raise DataError(f"{tree.root} has two folders named '{split}' holding classes; keep one")
        splits[split], where[split] = checked_class_folders(tree, prefix), prefix
    if "train" in splits:
        for split, folders in splits.items():
            unknown = sorted(set(folders) - set(splits["train"]))
            if unknown:
                raise DataError(
                    f"{tree.location(where[split])} has classes {unknown} that the train split does not have; "
                    "name them as in train or remove them"
                )
    return splits


def held_out_line(cfg: Config, splits: list[str]) -> str:
    """The header's line saying validation was held out of train, and which splits the data has instead (a typo in
    data.val_split otherwise trains on less data and validates on the wrong images without a word)."""
    d = cfg.data
    others = f"it has {', '.join(splits)}" if splits else "it has no other split"
    fix = "; set data.val_split to name one" if splits else ""
    return (
        f"data: no '{d.val_split}' split beside '{d.train_split}' in data.root ({others}): data.val_fraction="
        f"{d.val_fraction} of train is held out as validation{fix}"
    )


def held_out_split(n: int, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(train rows, val rows) when the data has no validation split; fixed by SPLIT_SEED, not the run seed."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_val = max(1, int(round(val_fraction * n)))
    return perm[n_val:], perm[:n_val]


def _read_split(
    tree: ImageTree, split: str, cfg: Config, skipped: Skipped, required: bool, classes: list[str] | None = None
) -> ImageSet | None:
    listing = list_split(tree, split, required, classes)
    if listing is None:
        return None
    names, labels, classes = listing
    skipped.deeper += tree.deeper_images(tree.split_prefix(split) or "")
    mode = "L" if cfg.model.in_chans == 1 else "RGB"
    images, kept, bad = decode_some(tree.root, tree.is_zip, names, mode, cfg.model.image_size,
                                    cfg.data.decode_workers, cfg.data.skip_bad, len(skipped.undecodable),
                                    cfg.data.decode_reduce)  # fmt: skip
    skipped.undecodable += bad
    return ImageSet(images, torch.tensor(labels, dtype=torch.long)[kept], classes, skipped)


def decode_files(
    root: str | Path, is_zip: bool, names: list[str], mode: str, size: int, workers: int, reduce: bool = False
) -> torch.Tensor:
    """(N, C, size, size) uint8 of a tree's files, decoded in chunks by `workers` processes; a bad file is an error
    (face folders: their verification pairs name every image, so none may be skipped)."""
    return decode_some(root, is_zip, names, mode, size, workers, skip_bad=None, reduce=reduce)[0]


def decode_some(
    root: str | Path,
    is_zip: bool,
    names: list[str],
    mode: str,
    size: int,
    workers: int,
    skip_bad: int | None,
    already: int = 0,
    reduce: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[str, str]]]:
    """(images of the files that decoded, their rows in `names`, [(location, reason)] of up to `skip_bad` that did
    not, counting `already` skipped by an earlier split); one more is a DataError naming it and the switch (None: no
    file may be skipped). `reduce`: JPEGs may decode at a smaller DCT scale (vitrain/data/decode.py)."""
    workers = max(1, workers)
    chunks = [names[i : i + 2048] for i in range(0, len(names), 2048)]
    jobs = [(str(root), is_zip, chunk, mode, size, reduce) for chunk in chunks]
    if workers == 1 or len(chunks) == 1:
        results = [_decode_chunk(job) for job in jobs]
    else:
        with decode_pool(workers) as pool:
            results = list(pool.map(_decode_chunk, jobs))
    bad = [(start + i, reason) for start, (_, failed) in zip(range(0, len(names), 2048), results, strict=True)
           for i, reason in failed]  # fmt: skip
    room = max((skip_bad or 0) - already, 0)
    if len(bad) > room:
        row, reason = bad[room]
        where = f"cannot decode image {location(root, is_zip, names[row])} ({reason}); fix or remove the file"
        if skip_bad is None:
            raise DataError(where)
        allowed = f"data.skip_bad={skip_bad} allows {skip_bad}" if skip_bad else "data.skip_bad=0 allows none"
        number = already + room + 1
        raise DataError(f"{where}, or let the run skip undecodable images: {allowed}, this is number {number}")
    failed_rows = {row for row, _ in bad}
    kept = torch.tensor([i for i in range(len(names)) if i not in failed_rows], dtype=torch.long)
    images = torch.from_numpy(np.concatenate([array for array, _ in results]))[kept]
    return images, kept, [(location(root, is_zip, names[row]), reason) for row, reason in bad]


def _decode_chunk(job: tuple[str, bool, list[str], str, int, bool]) -> tuple[np.ndarray, list[tuple[int, str]]]:
    """Decode one chunk to (n, C, size, size) uint8 (a bad file's row left zero) and [(row, reason)] of bad files."""
    root, is_zip, names, mode, size, reduce = job
    out = np.zeros((len(names), 1 if mode == "L" else 3, size, size), dtype=np.uint8)
    failed = []
    with file_reader(root, is_zip) as read:
        for i, name in enumerate(names):
            try:
                out[i] = decode_image(read(name), mode, size, reduce)
            except Exception as exc:  # PIL raises many types for bad files
                failed.append((i, decode_failure(exc)))
    return out, failed


def decode_failure(exc: Exception) -> str:
    """Why a file did not decode, in words: no Python object reprs (`<_io.BytesIO object at 0x...>`)."""
    from PIL import UnidentifiedImageError

    if isinstance(exc, UnidentifiedImageError):
        return "not an image PIL can read"
    text = re.sub(r"<[^<>]* at 0x[0-9a-fA-F]+>", "the file", str(exc)).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# ---------------------------------------------------------------------------------------------- prepared


def prepared_source(cfg: Config) -> tuple[PreparedSet, PreparedSet]:
    """Memory-mapped splits written by `vitrain data prepare`, checksums verified before anything trains."""
    d = cfg.data
    splits = open_prepared(Path(d.root).expanduser(), verify=d.verify)
    if d.train_split not in splits:
        raise DataError(
            f"prepared data {d.root} has no '{d.train_split}' split (it has {', '.join(sorted(splits))}); "
            f"set data.train_split"
        )
    train = splits[d.train_split]
    val = splits.get(d.val_split)
    held_out = ""
    if val is None:
        train_rows, val_rows = held_out_split(len(train), d.val_fraction)
        train, val = train.subset(train_rows), train.subset(val_rows)
        held_out = held_out_line(cfg, sorted(set(splits) - {d.train_split}))
    # `vitrain data prepare` skipped what did not decode and listed it (failed.txt): named in the run's log too.
    failed = failed_files(Path(d.root).expanduser())
    if failed or held_out:
        failed_lines = [(where, f"{reason} (when prepared)") for where, reason in failed]
        train.skipped = Skipped(undecodable=failed_lines, held_out=held_out)
    return train, val


# ---------------------------------------------------------------------------------------------- synthetic


def synthetic_images(cfg: Config) -> tuple[Any, Any]:
    """Random images and labels: for throughput benchmarks, never for accuracy (data.source=synthetic, through
    vitrain/data/synthetic.py, which hands a model taking clips random clips instead)."""
    m = cfg.model
    gen = torch.Generator().manual_seed(cfg.train.seed)
    n = cfg.data.synthetic_samples
    images = torch.randint(0, 256, (n, m.in_chans, m.image_size, m.image_size), dtype=torch.uint8, generator=gen)
    labels = torch.randint(0, m.num_classes, (n,), generator=gen)
    data = ImageSet(images, labels, index_names(m.num_classes))
    n_val = max(1, n // 10)
    return data.subset(torch.arange(n_val, n)), data.subset(torch.arange(n_val))
