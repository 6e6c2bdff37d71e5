"""WebDataset-format tar shards: shard lists (paths, brace patterns, pipe: commands), their samples, index and writer.

A shard is a tar file whose members are grouped into samples by key, WebDataset's convention: `dir/key.ext`
belongs to sample `dir/key` (the key ends at the first dot of the file name), and the members of one sample are
consecutive. A sample holds one image (`jpg`, `jpeg`, `png`, `webp`, `ppm`, `pgm`, `bmp`) and a label: `cls` (an
integer as text) or `json` (an integer, or an object with `label`, `cls`, `class` or `identity`). For a video model a
sample is one clip: a video file (`mp4`, `avi`, `mkv`, `mov`, `webm`) or its numbered frames (`000.jpg`, `001.jpg`,
...), and a label; what a sample's members become is the reader's choice (`StreamSet.decode`, data/stream.py).

`index.json` beside the shards (written by `vitrain data pack` and `vitrain data index`) holds each shard's
sample count and the class names: what lets every rank plan the same number of steps without reading the data.
"""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import subprocess
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from vitrain.data.names import IndexNames, index_names
from vitrain.errors import DataError
from vitrain.files import atomic_write
from vitrain.shard_names import PIPE, is_list_file, named_urls

INDEX = "index.json"
FORMAT = "vitrain-shards/1"
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "ppm", "pgm", "bmp")
VIDEO_EXTS = ("mp4", "avi", "mkv", "mov", "webm")
LABEL_KEYS = ("label", "cls", "class", "identity")


# ---------------------------------------------------------------------------------------------- shard lists


def shard_urls(root: str, what: str = "data.root") -> list[str]:
    """The shards `root` names: a folder (its .tar files, or the split files its index lists), a text file listing one
    shard per line, a brace pattern, one .tar, or `pipe:COMMAND` (braces expand to one command per shard)."""
    root = root.strip()
    if not root:  # Path("") is the working folder: never read unasked
        raise DataError(f"{what} is empty; give a folder of .tar shards, a list file, a brace pattern or pipe:COMMAND")
    path = Path(root).expanduser()
    if not root.startswith(PIPE) and path.is_dir():
        tars = sorted(str(p) for p in path.glob("*.tar"))
        if not tars:
            raise DataError(f"{what}={root} is a folder without .tar shards; point it at shards or pack some")
        return tars
    urls = named_urls(root)
    listed = not root.startswith(PIPE) and is_list_file(path)
    if listed and not urls:
        raise DataError(f"{what}={root} lists no shards; write one shard path (or pipe:COMMAND) per line")
    if not urls:  # a brace range that runs backwards ({002..000}) names none
        raise DataError(f"{what}={root} names no shards; write a brace range low to high, e.g. shard-{{000..009}}.tar")
    _check_exist(urls, what, root, "the list file's lines" if listed else "the path or the brace range")
    return urls


def _check_exist(urls: list[str], what: str, root: str, check: str) -> None:
    """One line naming the first local shard of `urls` that is not a file (pipe: commands are not checked)."""
    missing = [u for u in urls if not u.startswith(PIPE) and not Path(u).is_file()]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise DataError(f"{what}={root}: shard {missing[0]} does not exist{more}; check {check}")


@contextlib.contextmanager
def open_shard(url: str) -> Iterator[IO[bytes]]:
    """A readable binary stream of the shard: the file, or the stdout of its pipe: command (which must succeed)."""
    if not url.startswith(PIPE):
        with open(url, "rb") as f:
            yield f
        return
    command = url[len(PIPE) :]
    proc = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    try:
        yield proc.stdout
    finally:
        proc.stdout.close()
        proc.kill()
        proc.wait()
        # A command that failed before writing everything shows up as a truncated tar, with its stderr named there.


# ---------------------------------------------------------------------------------------------- samples


@dataclass
class Sample:
    key: str
    image: bytes | None  # the first image member
    label: int | None
    where: str  # shard and byte offset, for messages
    problem: str = ""  # why this sample's label cannot train (none, not an integer), empty when it can
    members: dict[str, bytes] = field(default_factory=dict)  # every member by extension: a clip's frames or video


class BadSample(Exception):
    """A sample whose content cannot become a training input; the message says why (`has no image ...`)."""


def split_name(name: str) -> tuple[str, str]:
    """WebDataset's key and extension of a member name: `d/n0001.cls.txt` -> (`d/n0001`, `cls.txt`)."""
    folder, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


def parse_label(ext: str, raw: bytes) -> int:
    text = raw.decode("utf-8", "replace").strip()
    if ext == "json":
        value = json.loads(text)
        if isinstance(value, dict):
            value = next((value[k] for k in LABEL_KEYS if k in value), None)
        if isinstance(value, list) and value:
            value = value[0]
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(f"{value!r} is not an integer")  # int() would round 1.5 and read true as 1
    else:
        value = text
    return int(value)  # ValueError/TypeError: the caller names the sample


def _sample(key: str, members: dict[str, bytes], where: str, clash: str = "") -> Sample:
    image = next((raw for ext, raw in members.items() if ext.rpartition(".")[2] in IMAGE_EXTS), None)
    label, problem = None, ""
    label_ext = next((e for e in ("cls", "json") if e in members), None)
    if clash:
        problem = f"has two .{clash} labels that differ"
    elif label_ext is None:
        problem = f"has no label (no .cls or .json member; it has {', '.join(sorted(members)) or 'nothing'})"
    else:
        try:
            label = parse_label(label_ext, members[label_ext])
        except (ValueError, TypeError):
            problem = f"has a .{label_ext} label that is not an integer"
        else:
            if label < 0:
                problem, label = f"has a negative label {label}", None
    return Sample(key, image, label, where, problem, members)


class _Header(tarfile.TarInfo):
    """A member header that notes on its TarFile why the listing ended: tarfile ends it quietly where the file is
    cut off or a header is corrupt, as it does at the end-of-archive block."""

    @classmethod
    def fromtarfile(cls, tar: tarfile.TarFile) -> tarfile.TarInfo:
        try:
            return super().fromtarfile(tar)
        except tarfile.EOFHeaderError:
            raise
        except tarfile.EmptyHeaderError:
            tar.cut = "the file ends without the end-of-archive block"
            raise
        except tarfile.HeaderError as exc:
            tar.cut = f"the member header there is cut off or corrupt ({exc})"
            raise


def read_samples(url: str, skip: int = 0, count: int | None = None, labels_only: bool = False) -> Iterator[Sample]:
    """The shard's samples in order, after skipping `skip` of them (for a local file by reading only tar headers),
    at most `count`. A truncated or corrupt tar raises a DataError naming the shard and byte offset."""
    seekable = not url.startswith(PIPE)
    with open_shard(url) as stream:
        try:
            tar = tarfile.open(fileobj=stream, mode="r:" if seekable else "r|", tarinfo=_Header)
        except tarfile.TarError as exc:
            raise DataError(f"shard {url} is not a readable tar file ({exc}); write it again") from None
        key, members, offset, seen, emitted, clash = None, {}, 0, 0, 0, ""
        try:
            while count is None or emitted < count:
                member = tar.next()
                tar.members = []  # the listing would grow with the shard; nothing here needs it
                if member is None and getattr(tar, "cut", ""):
                    raise tarfile.ReadError(tar.cut)
                name_key = split_name(member.name) if member is not None and member.isfile() else None
                if member is not None and name_key is None:
                    continue
                if member is None or name_key[0] != key:
                    if key is not None:
                        if seen >= skip:
                            yield _sample(key, members, f"{url} byte {offset}", clash)
                            emitted += 1
                        seen += 1
                    if member is None or (count is not None and emitted >= count):
                        break
                    key, members, offset, clash = name_key[0], {}, member.offset, ""
                wanted = seen >= skip and (not labels_only or name_key[1] in ("cls", "json"))
                if wanted:
                    extracted = tar.extractfile(member)
                    raw = extracted.read() if extracted is not None else b""
                    if len(raw) != member.size:
                        raise tarfile.ReadError("unexpected end of data")
                    if name_key[1] in ("cls", "json") and members.get(name_key[1], raw).strip() != raw.strip():
                        clash = name_key[1]
                    members[name_key[1]] = raw
                else:
                    members.setdefault(name_key[1], b"")
        except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
            where = f"after sample {key}" if key else "at its start"
            raise DataError(
                f"shard {url} is truncated or corrupt near byte {getattr(tar, 'offset', '?')} ({where}): {exc}; "
                f"write the shard again (vitrain data pack), or remove it from the list"
            ) from None
        finally:
            tar.close()


# ---------------------------------------------------------------------------------------------- index


@dataclass
class ShardIndex:
    """The shards of one split, their sample counts and the class names (label i is classes[i])."""

    urls: list[str]
    counts: list[int]
    classes: list[str]
    layout: str = "classes"  # or "identities" (face sets: one class per person)

    @property
    def total(self) -> int:
        return sum(self.counts)


def index_path(urls: list[str]) -> Path | None:
    """Where the index of local shards lives: index.json in the folder of the first shard."""
    if not urls or urls[0].startswith(PIPE):
        return None
    return Path(urls[0]).parent / INDEX


def read_index(path: Path, urls: list[str]) -> ShardIndex | None:
    """The counts of `urls` from an index file, or None when the file does not cover every one of them."""
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as exc:
        raise DataError(f"shard index {path} is not valid JSON ({exc}); write it again: vitrain data index") from None
    check_index(path, saved)
    counts = {name: n for name, n in saved["counts"].items()}
    names = [url if url.startswith(PIPE) else Path(url).name for url in urls]
    if not all(name in counts for name in names):
        return None
    classes = list(saved["classes"])
    # Indexed from labels alone: said since index.json says so ("named"); before, names that are the indices.
    named = saved["named"] if "named" in saved else classes != index_names(len(classes))
    classes = classes if named else IndexNames(classes)
    return ShardIndex(urls, [counts[n] for n in names], classes, saved.get("layout", "classes"))


def check_index(path: Path, saved: Any) -> None:
    """Refuse an index file that is not the object `vitrain data index` writes, naming the entry."""
    again = "write it again: vitrain data index"
    if not isinstance(saved, dict):
        raise DataError(f"shard index {path} holds a JSON {type(saved).__name__}, not an object; {again}")
    if saved.get("format") != FORMAT:
        raise DataError(f"shard index {path} has format {saved.get('format')!r}, expected {FORMAT!r}")
    counts = saved.get("counts")
    if not isinstance(counts, dict) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts.values()
    ):
        raise DataError(f"shard index {path}: counts is not an object of shard name -> sample count; {again}")
    classes = saved.get("classes")
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise DataError(f"shard index {path}: classes is not a list of class names; {again}")
    if not isinstance(saved.get("named", True), bool):
        raise DataError(f"shard index {path}: named is {saved['named']!r}, not true or false; {again}")


def write_index(path: Path, index: ShardIndex, extra: dict[str, Any] | None = None) -> None:
    """Add `index`'s shards to the index file at `path` (other splits' shards already there are kept)."""
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        saved = {"format": FORMAT, "counts": {}}
    except json.JSONDecodeError as exc:
        raise DataError(f"shard index {path} is not valid JSON ({exc}); delete it and run vitrain data index") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("counts"), dict):
        raise DataError(f"shard index {path} is not an index vitrain wrote (no counts object); delete it and run again")
    names = [url if url.startswith(PIPE) else Path(url).name for url in index.urls]
    saved["counts"].update(dict(zip(names, index.counts, strict=True)))
    saved["classes"] = index.classes
    saved["named"] = not isinstance(index.classes, IndexNames)  # false: "0", "1", ... made up from the labels
    saved["layout"] = index.layout
    saved.update(extra or {})
    atomic_write(path, (json.dumps(saved, indent=1) + "\n").encode())


def scan_index(urls: list[str], classes: list[str] | None = None) -> ShardIndex:
    """Count every shard's samples by reading it once (tar headers and labels only); classes: range(max label + 1)."""
    counts, top = [], -1
    for url in urls:
        n = 0
        for sample in read_samples(url, labels_only=True):
            n += 1
            if sample.label is not None:
                top = max(top, sample.label)
        counts.append(n)
    return ShardIndex(urls, counts, classes or index_names(top + 1))


def load_index(urls: list[str], what: str) -> ShardIndex:
    """The index of `urls` from index.json; local shards without one are scanned."""
    path = index_path(urls)
    index = read_index(path, urls) if path is not None else None
    if index is not None:
        return index
    if path is None:
        raise DataError(
            f"{what}: pipe: shards need their sample counts up front; run `vitrain data index '{urls[0]}' --out "
            f"index.json` once (it streams every shard) and give data.shard_index=index.json"
        )
    return scan_index(urls)


# ---------------------------------------------------------------------------------------------- writer


@dataclass
class ShardWriter:
    """Writes samples into `pattern % k` tar shards (or the one file `pattern` names, without a %) of at most
    `max_count` samples or `max_bytes` bytes each; each shard is written under a temporary name and renamed when
    complete. `written` lists (path, count)."""

    pattern: str
    max_count: int = 10_000
    max_bytes: int = 1 << 30
    first: int = 0
    written: list[tuple[str, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._tar: tarfile.TarFile | None = None
        self._path = ""
        self._count = self._bytes = 0
        self._k = self.first

    def write(self, key: str, members: dict[str, bytes]) -> None:
        if self._tar is None or self._count >= self.max_count or self._bytes >= self.max_bytes:
            self._finish()
            self._path = self.pattern % self._k if "%" in self.pattern else self.pattern
            self._k += 1
            self._tar = tarfile.open(self._path + ".partial", "w", format=tarfile.USTAR_FORMAT)
        for ext, raw in members.items():
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size, info.mtime, info.mode = len(raw), 0, 0o444
            self._tar.addfile(info, io.BytesIO(raw))
            self._bytes += 512 + len(raw)
        self._count += 1

    def _finish(self) -> None:
        if self._tar is None:
            return
        self._tar.close()
        Path(self._path + ".partial").replace(self._path)
        self.written.append((self._path, self._count))
        self._tar, self._count, self._bytes = None, 0, 0

    def close(self) -> list[tuple[str, int]]:
        self._finish()
        return self.written


def describe(urls: list[str]) -> str:
    shown = shlex.join(urls[:2]) + (f" ... ({len(urls)} shards)" if len(urls) > 2 else "")
    return shown
