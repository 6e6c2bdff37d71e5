"""Face data: identity folders (or a prepared copy), the train/verification identity split, verification pairs."""

from __future__ import annotations

import posixpath
import re
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np
import torch

from vitrain.data.prepared import IDENTITIES, IDENTITIES_SPLIT, PreparedSet, is_prepared, read_manifest, verify_files
from vitrain.data.recordio import read_insightface
from vitrain.data.records import RecordSet, class_names
from vitrain.data.sources import IMAGE_SUFFIXES, ImageSet, decode_files, file_reader, location, unreadable_zip
from vitrain.errors import DataError

FOLDS = 10
LFW_FORMATS = "'name i j' (matched) or 'name1 i name2 j' (mismatched)"


def natural_key(text: str) -> tuple:
    """Sort key comparing digit runs as numbers: `2.pgm` before `10.pgm`, `s9` before `s10`."""
    parts = tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text))
    return parts, text


# ---------------------------------------------------------------------------------------------- tree


@dataclass
class FaceTree:
    """Identity folders on disk or inside a .zip."""

    root: Path
    is_zip: bool
    identities: list[str]  # natural-sorted
    files: dict[str, list[str]]  # identity -> image names as file_reader reads them, natural-sorted

    def location(self, name: str) -> str:
        """How a file of the tree is named in messages: `archive.zip:inner/path` or the path on disk."""
        return location(self.root, self.is_zip, name)


def open_face_tree(root: str | Path) -> FaceTree:
    """List the identities of a face set: the first folder level below the common folder of all images.

    `orl_faces/s1/1.pgm` gives identity `s1`; `cfp/Data/Images/001/frontal/01.jpg` gives `001` (an identity's
    images may sit in sub-folders). Files that are not images (READMEs, protocol lists) are ignored, and so are
    hidden files and `__MACOSX` folders that archivers add.
    """
    root = Path(root).expanduser()
    if not root.exists():
        raise DataError(f"face data {root} does not exist; point it at a folder of identity folders or a .zip of one")
    is_zip = root.is_file()
    if is_zip:
        try:
            with zipfile.ZipFile(root) as archive:
                names = [n for n in archive.namelist() if not n.endswith("/")]
        except zipfile.BadZipFile as error:
            raise unreadable_zip(f"face data {root}", root, error) from None
    else:
        names = [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()]
    images = [n for n in names if n.lower().endswith(IMAGE_SUFFIXES) and not _is_clutter(n)]
    if not images:
        raise DataError(f"face data {root} holds no images ({', '.join(IMAGE_SUFFIXES)}); expected <identity>/<image>")
    common = _common_folder(images)
    files: dict[str, list[str]] = {}
    for name in images:
        parts = PurePosixPath(name).parts
        if len(parts) > len(common) + 1:  # an image directly in the common folder has no identity folder
            files.setdefault(parts[len(common)], []).append(name)
    where = location(root, is_zip, "/".join(common)) if common else str(root)
    if not files:
        raise DataError(
            f"face data {where} holds its images directly, not in identity folders; a face set needs at least 2 "
            f"(one folder of images per person: <identity>/<image>)"
        )
    if len(files) < 2:
        raise DataError(
            f"face data {where} has 1 identity folder ({next(iter(files))}); a face set needs at least 2 "
            f"(one folder of images per person: <identity>/<image>)"
        )
    identities = sorted(files, key=natural_key)
    return FaceTree(root, is_zip, identities, {i: sorted(files[i], key=natural_key) for i in identities})


def _is_clutter(name: str) -> bool:
    return any(part.startswith(".") or part == "__MACOSX" for part in PurePosixPath(name).parts)


def _common_folder(names: list[str]) -> tuple[str, ...]:
    """The longest folder path that holds every name."""
    folders = [PurePosixPath(n).parts[:-1] for n in names]
    common = folders[0]
    for parts in folders[1:]:
        n = 0
        while n < min(len(common), len(parts)) and common[n] == parts[n]:
            n += 1
        common = common[:n]
    return common


# ---------------------------------------------------------------------------------------------- split


def split_identities(identities: list[str], verify: int, how: str, seed: int) -> tuple[list[str], list[str]]:
    """(training identities, verification identities): disjoint, each in natural-sort order.

    how="seeded" picks `verify` identities with a permutation fixed by `seed`; how="last" takes the last `verify`
    in natural-sort order (CFP: 001-450 train, 451-500 verify).
    """
    ordered = sorted(set(identities), key=natural_key)
    if not 2 <= verify <= len(ordered) - 1:
        fix = (f"use 2 to {len(ordered) - 1} (both sides need identities)" if len(ordered) >= 3
               else "verification needs 2 held-out identities and 1 to train on: add identity folders")  # fmt: skip
        raise DataError(f"task.verify_identities={verify} is impossible with {len(ordered)} identities; {fix}")
    if how == "last":
        chosen = set(ordered[-verify:])
    elif how == "seeded":
        perm = np.random.default_rng(seed).permutation(len(ordered))
        chosen = {ordered[i] for i in perm[:verify]}
    else:
        raise DataError(f"identity split '{how}' is unknown; use 'seeded' or 'last'")
    return [i for i in ordered if i not in chosen], [i for i in ordered if i in chosen]


# ---------------------------------------------------------------------------------------------- decode


def decode_faces(tree: FaceTree, names: list[str], in_chans: int, size: int, workers: int = 2) -> torch.Tensor:
    """Decode images to (N, in_chans, size, size) uint8: grey stays 1 channel, any size is resized (bicubic)."""
    if in_chans not in (1, 3):
        raise DataError(f"model.in_chans={in_chans} cannot hold face images; use 1 (grey) or 3 (RGB)")
    mode = "L" if in_chans == 1 else "RGB"
    if not names:
        return torch.empty((0, in_chans, size, size), dtype=torch.uint8)
    return decode_files(tree.root, tree.is_zip, names, mode, size, workers)


@dataclass
class FaceImages:
    """A face set's identity listing and its images by name: decoded from the tree, or rows of a prepared copy."""

    tree: FaceTree
    in_chans: int
    size: int
    workers: int = 2
    prepared: PreparedSet | RecordSet | None = None  # prepared (memory-mapped) or RecordIO (decoded per batch)
    row_of: dict[str, int] | None = None  # prepared or RecordIO: image name -> row
    failed: int = 0  # prepared: images that failed to decode when the set was prepared (they have no row)

    def read(self, names: list[str]) -> torch.Tensor:
        """uint8 images (N, in_chans, size, size) in the order of `names`."""
        if self.prepared is None:
            return decode_faces(self.tree, names, self.in_chans, self.size, self.workers)
        return self.prepared.read(self._rows(names))[0]

    def dataset(self, names: list[str], labels: torch.Tensor, classes: list[str]) -> ImageSet | PreparedSet:
        """A training set of `names`: decoded into memory, or the prepared rows left memory-mapped."""
        if self.prepared is None:
            return ImageSet(self.read(names), labels, classes)
        return self.prepared.subset(self._rows(names)).relabeled(labels, classes)

    def _rows(self, names: list[str]) -> torch.Tensor:
        return torch.tensor([self.row_of[name] for name in names], dtype=torch.long)


def open_face_images(root: str | Path, in_chans: int, size: int, workers: int = 2, verify: str = "once") -> FaceImages:
    """The face set at `root`: identity folders (see `open_face_tree`), or a folder made from them by
    `vitrain data prepare SRC DST --identities`, whose listing holds the names the images had in SRC."""
    root = Path(root).expanduser()
    if is_recordio(root):
        return _recordio_faces(root, in_chans, size, workers)
    if not is_prepared(root):
        return FaceImages(open_face_tree(root), in_chans, size, workers)
    manifest = read_manifest(root)
    if manifest.get("layout") != IDENTITIES:
        raise DataError(
            f"face data {root} is prepared from class folders, not identity folders; "
            f"prepare the face tree with `vitrain data prepare SRC DST --identities --size S`"
        )
    if (manifest["size"], manifest["channels"]) != (size, in_chans):
        raise DataError(
            f"prepared face data {root} holds {manifest['size']}x{manifest['size']} images with "
            f"{manifest['channels']} channel(s) but model.image_size={size} and model.in_chans={in_chans}; prepare "
            f"it again with --size {size} --channels {in_chans} or set model.image_size={manifest['size']} "
            f"model.in_chans={manifest['channels']}"
        )
    verify_files(root, manifest["files"], always_hash=verify == "always")
    prepared = PreparedSet(root, manifest, IDENTITIES_SPLIT)
    names = manifest["splits"][IDENTITIES_SPLIT]["names"]
    files: dict[str, list[str]] = {}
    for name, label in zip(names, prepared.all_labels.tolist(), strict=True):
        files.setdefault(prepared.classes[label], []).append(name)
    tree = FaceTree(root, False, [i for i in prepared.classes if i in files], files)
    rows = {name: row for row, name in enumerate(names)}
    return FaceImages(tree, in_chans, size, workers, prepared, rows, int(manifest.get("failed", 0)))


def is_recordio(root: Path) -> bool:
    return root.suffix == ".rec" or (root.is_dir() and (root / "train.rec").is_file())


def _recordio_faces(root: Path, in_chans: int, size: int, workers: int) -> FaceImages:
    """A face set packed as RecordIO (insightface's layout): identities from the labels (named by identities.txt
    when `vitrain data pack` wrote one), images named by the .lst (else `<identity>/<key>`), decoded per batch."""
    records = read_insightface(root)
    identities = class_names(root, records)
    labels = records.labels.tolist()
    names = records.names or [f"{identities[label]}/{key}" for label, key in zip(labels, records.keys, strict=True)]
    files: dict[str, list[str]] = {}
    for name, label in zip(names, labels, strict=True):
        files.setdefault(identities[label], []).append(name)
    folder = root if root.is_dir() else root.parent
    tree = FaceTree(folder, False, [i for i in identities if i in files], files)
    data = RecordSet(records, identities, in_chans, size, reduce=False, workers=workers)
    return FaceImages(tree, in_chans, size, workers, data, {name: row for row, name in enumerate(names)})


# ---------------------------------------------------------------------------------------------- pairs


@dataclass
class Pairs:
    """Verification pairs of image names, with whether both show one person and a fold for 10-fold accuracy."""

    name: str  # "generated", "cfp-ff", "cfp-fp", or the pairs file's stem
    left: list[str]  # image names in the tree
    right: list[str]
    same: np.ndarray  # bool, (P,)
    folds: np.ndarray  # int in [0, 10), (P,)

    def __len__(self) -> int:
        return len(self.left)


def deal_folds(same: np.ndarray) -> np.ndarray:
    """Folds dealt round-robin, matched and mismatched pairs separately, so every fold is balanced."""
    folds = np.empty(len(same), dtype=np.int64)
    for flag in (True, False):
        rows = np.flatnonzero(same == flag)
        folds[rows] = np.arange(len(rows)) % FOLDS
    return folds


def _pairs(name: str, rows: list[tuple[str, str, bool]], folds: np.ndarray | None = None) -> Pairs:
    same = np.array([s for _, _, s in rows], dtype=bool)
    return Pairs(
        name=name,
        left=[a for a, _, _ in rows],
        right=[b for _, b, _ in rows],
        same=same,
        folds=deal_folds(same) if folds is None else np.asarray(folds, dtype=np.int64),
    )


def read_lfw_pairs(path: str | Path, tree: FaceTree) -> Pairs:
    """Pairs from an LFW-format `pairs.txt`, image indices counted from 1 in each identity's natural order.

    An optional header `F N` means F folds of N matched then N mismatched lines; a single `N` means one block of
    N matched then N mismatched lines. Without an `F N` header the pairs are dealt into 10 balanced folds.
    """
    path = Path(path).expanduser()
    try:
        text = path.read_text()
    except OSError as exc:
        raise DataError(f"pairs file {path} cannot be read ({exc.strerror}); give an LFW-format pairs.txt") from None
    lines = [(number, line.split()) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise DataError(f"pairs file {path} is empty; expected lines {LFW_FORMATS}")
    header_number, header = lines[0]
    has_header = len(header) <= 2 and all(re.fullmatch(r"\d+", t) for t in header)
    body = lines[1:] if has_header else lines

    rows = [_lfw_line(path, number, fields, tree) for number, fields in body]
    folds = None
    if has_header:
        counts = [int(t) for t in header]
        n_folds, per_fold = counts if len(counts) == 2 else (1, counts[0])
        if not 1 <= n_folds <= FOLDS:
            raise DataError(
                f"pairs file {path} line {header_number}: header asks for {n_folds} folds; use 1 to {FOLDS}"
            )
        expected = [True] * per_fold + [False] * per_fold
        expected *= n_folds
        if len(rows) != len(expected):
            raise DataError(
                f"pairs file {path} line {header_number}: header '{' '.join(header)}' promises {len(expected)} "
                f"pair lines ({n_folds} fold(s) of {per_fold} matched + {per_fold} mismatched) but the file has "
                f"{len(rows)}; fix the header or the lines"
            )
        for (number, _), (_, _, same), want in zip(body, rows, expected, strict=True):
            if same != want:
                kind = "matched 'name i j'" if want else "mismatched 'name1 i name2 j'"
                raise DataError(
                    f"pairs file {path} line {number}: the header '{' '.join(header)}' puts a {kind} line here; "
                    f"each fold lists its matched lines first, then its mismatched ones"
                )
        if n_folds > 1:
            folds = np.repeat(np.arange(n_folds), 2 * per_fold)
    pairs = _pairs(path.stem, rows, folds)
    for flag, kind in ((True, "matched"), (False, "mismatched")):
        if not (pairs.same == flag).any():
            raise DataError(f"pairs file {path} has no {kind} pairs; verification needs both kinds")
    return pairs


def _lfw_line(path: Path, number: int, fields: list[str], tree: FaceTree) -> tuple[str, str, bool]:
    where = f"pairs file {path} line {number}"
    if len(fields) == 3:
        name, i, j = fields
        return _lfw_image(where, tree, name, i), _lfw_image(where, tree, name, j), True
    if len(fields) == 4:
        name1, i, name2, j = fields
        if name1 == name2:
            raise DataError(f"{where}: a mismatched line names '{name1}' twice; write it as matched 'name i j'")
        return _lfw_image(where, tree, name1, i), _lfw_image(where, tree, name2, j), False
    raise DataError(f"{where}: expected {LFW_FORMATS}, got {len(fields)} field(s) '{' '.join(fields)}'")


def _lfw_image(where: str, tree: FaceTree, identity: str, index: str) -> str:
    if identity not in tree.files:
        raise DataError(
            f"{where}: unknown identity '{identity}' (no such identity folder in {tree.root}); "
            f"fix the name or point the face data at the tree the pairs were written for"
        )
    if not re.fullmatch(r"[+-]?\d+", index):
        raise DataError(f"{where}: image index '{index}' is not an integer; expected {LFW_FORMATS}")
    images = tree.files[identity]
    number = int(index)
    if not 1 <= number <= len(images):
        raise DataError(
            f"{where}: identity {identity} has {len(images)} images, no image {number}; "
            f"indices count from 1 in natural-sort order of the file names"
        )
    return images[number - 1]


def cfp_pairs(tree: FaceTree, which: str) -> Pairs:
    """CFP's official frontal-frontal ("ff") or frontal-profile ("fp") pairs, read from its Protocol folder."""
    if which not in ("ff", "fp"):
        raise DataError(f"CFP protocol '{which}' is unknown; use cfp-ff or cfp-fp")
    if is_prepared(tree.root):
        raise DataError(
            f"cfp-{which} needs CFP's Protocol files, which the prepared face data {tree.root} does not hold; "
            f"point data.root at the CFP zip (or its unpacked cfp folder) for cfp-ff / cfp-fp pairs"
        )
    data_folder = _common_folder([n for names in tree.files.values() for n in names])
    missing = (
        f"cfp-{which} needs CFP's Protocol folder beside Data (cfp/Protocol next to cfp/Data/Images); "
        f"use the whole cfp-faces.zip or an unpacked cfp folder"
    )
    if "Data" not in data_folder:
        raise DataError(f"face data {tree.root} has no Data folder: {missing}")
    protocol = "/".join(data_folder[: data_folder.index("Data")] + ("Protocol",))
    second = "F" if which == "ff" else "P"
    rows, folds = [], []
    with file_reader(tree.root, tree.is_zip) as read:
        lists = [_cfp_image_list(tree, read, protocol, letter, missing) for letter in ("F", second)]
        for fold in range(FOLDS):
            for kind, same in (("same", True), ("diff", False)):
                name = f"{protocol}/Split/{which.upper()}/{fold + 1:02d}/{kind}.txt"
                for number, fields in _cfp_lines(tree, read, name, missing):
                    a, _, b = "".join(fields).partition(",")
                    if not (a.isdigit() and b.isdigit()):
                        raise DataError(f"{tree.location(name)} line {number}: expected 'a,b' image numbers")
                    if int(a) not in lists[0] or int(b) not in lists[1]:
                        raise DataError(
                            f"{tree.location(name)} line {number}: image number {a} or {b} is not in "
                            f"Pair_list_F.txt / Pair_list_{second}.txt"
                        )
                    rows.append((lists[0][int(a)], lists[1][int(b)], same))
                    folds.append(fold)
    return _pairs(f"cfp-{which}", rows, np.array(folds))


def _cfp_lines(tree: FaceTree, read: Callable[[str], bytes], name: str, missing: str) -> list[tuple[int, list[str]]]:
    """(line number, fields) of a protocol file's non-blank lines."""
    try:
        raw = read(name).decode()
    except (KeyError, OSError):
        raise DataError(f"{tree.location(name)} is missing: {missing}") from None
    return [(number, line.split()) for number, line in enumerate(raw.splitlines(), 1) if line.strip()]


def _cfp_image_list(
    tree: FaceTree, read: Callable[[str], bytes], protocol: str, letter: str, missing: str
) -> dict[int, str]:
    """Image number -> image name, from Pair_list_F.txt or Pair_list_P.txt (paths relative to Protocol)."""
    name = f"{protocol}/Pair_list_{letter}.txt"
    known = {n for names in tree.files.values() for n in names}
    images = {}
    for number, fields in _cfp_lines(tree, read, name, missing):
        if len(fields) != 2 or not fields[0].isdigit():
            raise DataError(f"{tree.location(name)} line {number}: expected 'number path'")
        image = posixpath.normpath(posixpath.join(protocol, fields[1]))
        if image not in known:
            raise DataError(f"{tree.location(name)} line {number}: {image} is not an image of the face data")
        images[int(fields[0])] = image
    return images


def generate_pairs(tree: FaceTree, identities: list[str], count: int, seed: int) -> Pairs:
    """Up to `count` matched and as many mismatched pairs among `identities`, distinct, fixed by `seed`.

    Matched pairs are all the distinct ones when there are at most `count`, else a sample without replacement;
    mismatched pairs are sampled the same way. Both are dealt into 10 balanced folds.
    """
    unknown = sorted(set(identities) - set(tree.files))
    if unknown:
        raise DataError(f"identities {unknown[:3]} are not identity folders of {tree.root}")
    ordered = sorted(set(identities), key=natural_key)
    names = [n for i in ordered for n in tree.files[i]]
    owner = np.repeat(np.arange(len(ordered)), [len(tree.files[i]) for i in ordered])
    sizes = np.array([len(tree.files[i]) for i in ordered], dtype=np.int64)
    rng = np.random.default_rng(seed)

    matched_per_identity = sizes * (sizes - 1) // 2
    matched_total = int(matched_per_identity.sum())
    mismatched_total = (len(names) ** 2 - int((sizes**2).sum())) // 2
    wanted = min(count, matched_total, mismatched_total)
    if wanted < 1:
        raise DataError(
            f"the {len(ordered)} verification identities of {tree.root} give no matched or no mismatched pairs; "
            f"verification needs at least 2 identities, one of them with 2+ images"
        )

    picked = np.arange(matched_total) if wanted == matched_total else rng.choice(matched_total, wanted, replace=False)
    first_image = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    first_pair = np.concatenate([[0], np.cumsum(matched_per_identity)[:-1]])
    rows = []
    for linear in np.sort(picked):
        identity = int(np.searchsorted(first_pair, linear, side="right")) - 1
        i, j = _triangle_pair(int(linear - first_pair[identity]), int(sizes[identity]))
        base = int(first_image[identity])
        rows.append((names[base + i], names[base + j], True))

    for a, b in _mismatched(owner, wanted, mismatched_total, rng):
        rows.append((names[a], names[b], False))
    return _pairs("generated", rows)


def _triangle_pair(t: int, n: int) -> tuple[int, int]:
    """The t-th pair (i < j) of n items in the order (0,1), (0,2), ..., (1,2), ..."""
    row_ends = np.cumsum(np.arange(n - 1, 0, -1))
    i = int(np.searchsorted(row_ends, t, side="right"))
    start = int(row_ends[i - 1]) if i else 0
    return i, i + 1 + t - start


def _mismatched(owner: np.ndarray, wanted: int, total: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """`wanted` distinct image pairs (a < b) of different identities, sorted, sampled uniformly."""
    if total <= 4 * wanted:  # few enough to list them all
        a, b = np.triu_indices(len(owner), k=1)
        keep = owner[a] != owner[b]
        a, b = a[keep], b[keep]
        chosen = np.sort(rng.choice(len(a), wanted, replace=False))
        return list(zip(a[chosen].tolist(), b[chosen].tolist(), strict=True))
    seen: set[tuple[int, int]] = set()
    while len(seen) < wanted:
        draws = rng.integers(0, len(owner), size=(2 * (wanted - len(seen)) + 16, 2))
        for a, b in draws.tolist():
            if owner[a] != owner[b] and len(seen) < wanted:
                seen.add((min(a, b), max(a, b)))
    return sorted(seen)


def restrict_pairs(pairs: Pairs, tree: FaceTree, identities: list[str]) -> Pairs:
    """The pairs whose two images both belong to `identities`; re-dealt into 10 folds when fewer remain."""
    identity_of = {name: identity for identity, names in tree.files.items() for name in names}
    wanted = set(identities)
    pair_names = zip(pairs.left, pairs.right, strict=True)
    keep = np.array([identity_of.get(a) in wanted and identity_of.get(b) in wanted for a, b in pair_names], dtype=bool)
    if not keep.any():
        raise DataError(
            f"none of the {len(pairs)} {pairs.name} pairs has both images among the {len(wanted)} verification "
            f"identities; choose verification identities the pairs cover or another pair source"
        )
    rows = np.flatnonzero(keep)
    same, folds = pairs.same[rows], pairs.folds[rows]
    if len(np.unique(folds)) < FOLDS:
        folds = deal_folds(same)
    return Pairs(
        name=pairs.name,
        left=[pairs.left[r] for r in rows],
        right=[pairs.right[r] for r in rows],
        same=same,
        folds=folds,
    )
