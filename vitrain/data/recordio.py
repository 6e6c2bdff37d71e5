"""Read and write MXNet / insightface RecordIO image sets (.rec + .idx + property + .lst) without mxnet.

A record on disk: uint32 magic 0xced7230a, uint32 (cflag << 29 | length), the payload, zero padding to 4 bytes. A
payload holding the magic at a 4-aligned offset is cut there into chunks flagged 1 (first), 2 (middle), 3 (last), the
magic left out; a reader puts it back. An image payload is the header `<IfQQ` (flag, label, id, id2), then `flag`
float32 labels when flag > 0, then the encoded image. In insightface sets record 0 holds labels (a, b): images are
keys 1..a-1, and keys a..b-1 hold one (first key, end key) record per identity.
"""

from __future__ import annotations

import contextlib
import numbers
import os
import struct
import tempfile
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from vitrain.errors import DataError
from vitrain.files import atomic_write, fsync_dir

MAGIC = 0xCED7230A
LABEL_EXACT_LIMIT = 2**24  # float32 holds every integer up to here exactly, and no further
_MAGIC_BYTES = struct.pack("<I", MAGIC)
_FRAME = struct.Struct("<II")
_HEADER = struct.Struct("<IfQQ")
_MAX_CHUNK = (1 << 29) - 1
_CORRUPT = "the file is corrupted or truncated; pack it again or restore it"


def _exact(value: float, where: str, what: str) -> int:
    """`value` as an int when float32 holds it exactly; a DataError naming the file and the fix otherwise."""
    value = float(value)
    if value < 0:
        raise DataError(f"{where}: {what} {value:g} is negative; keys and labels count from 0; pack the set again")
    if not value.is_integer() or value >= LABEL_EXACT_LIMIT:
        why = "is not an integer" if not value.is_integer() else "is >= 16,777,216 (2**24)"
        raise DataError(
            f"{where}: {what} {value!r} {why}, and float32 holds integers exactly only up to 16,777,216, so it may "
            "name the wrong key or identity (insightface issue #1589); convert the set to tar shards, whose labels are "
            "exact integers (vitrain data pack SRC OUT --format shards), or split it into parts below 16,777,216"
        )
    return int(value)


@dataclass
class Header:
    """The header of an image record (mxnet's IRHeader): flag > 0 is the number of float32 labels after it."""

    flag: int
    label: float
    id: int
    id2: int


def pack_payload(label: float | Sequence[float], image: bytes, id: int = 0, id2: int = 0) -> bytes:
    """An image record's payload as mxnet.recordio.pack makes it: header, labels when a sequence, encoded image."""
    if isinstance(label, numbers.Real):
        return _HEADER.pack(0, float(label), id, id2) + bytes(image)
    labels = np.asarray(label, dtype="<f4").ravel()
    if labels.size == 0:
        raise DataError("pack_payload: the label sequence is empty; give one number or at least one label")
    return _HEADER.pack(labels.size, 0.0, id, id2) + labels.tobytes() + bytes(image)


def unpack_payload(payload: bytes, where: str) -> tuple[Header, np.ndarray, bytes]:
    """(header, float32 labels (at least one), encoded image) of an image payload; `where` names it in errors."""
    if len(payload) < _HEADER.size:
        raise DataError(
            f"{where}: the record holds {len(payload)} bytes, fewer than a 24-byte image header; {_CORRUPT}"
        )
    header = Header(*_HEADER.unpack_from(payload))
    if header.flag == 0:
        return header, np.array([header.label], np.float32), bytes(payload[_HEADER.size :])
    end = _HEADER.size + 4 * header.flag
    if end > len(payload):
        raise DataError(f"{where}: the header says {header.flag} labels in a {len(payload)}-byte record; {_CORRUPT}")
    labels = np.frombuffer(payload, "<f4", header.flag, _HEADER.size).astype(np.float32)
    return header, labels, bytes(payload[end:])


def _frames(payload: bytes) -> bytes:
    """One record's bytes on disk: cut at each 4-aligned magic (left out), each chunk framed and padded."""
    cuts, i = [], payload.find(_MAGIC_BYTES)
    while i >= 0:
        if i % 4 == 0:
            cuts.append(i)
        i = payload.find(_MAGIC_BYTES, i + (4 if i % 4 == 0 else 1))
    starts, ends = [0] + [c + 4 for c in cuts], [*cuts, len(payload)]
    out = bytearray()
    for n, (start, end) in enumerate(zip(starts, ends, strict=True)):
        cflag = 0 if not cuts else 1 if n == 0 else 3 if n == len(cuts) else 2
        if end - start > _MAX_CHUNK:
            raise DataError(f"a record part of {end - start} bytes is over RecordIO's {_MAX_CHUNK}; store it smaller")
        out += _FRAME.pack(MAGIC, cflag << 29 | (end - start)) + payload[start:end] + b"\0" * (-(end - start) % 4)
    return bytes(out)


class RecordReader:
    """Framed records from a path (os.pread: safe across threads, reopened in each process) or a seekable stream."""

    def __init__(self, source: str | os.PathLike | BinaryIO):
        stream = not isinstance(source, (str, os.PathLike))
        self.path = None if stream else Path(source)
        self._stream = source if stream else None
        self.name = str(self.path) if self.path else str(getattr(source, "name", "<stream>"))
        self._fd: int | None = None
        self._pid, self._size, self._lock = 0, 0, threading.Lock()

    def __getstate__(self) -> dict:
        if self._stream is not None:
            raise TypeError(f"a RecordReader over the stream {self.name} cannot be pickled; open it from a path")
        return {**self.__dict__, "_fd": None, "_pid": 0, "_lock": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def _open(self) -> int:
        if self._fd is None or self._pid != os.getpid():
            with self._lock:
                if self._fd is None or self._pid != os.getpid():
                    try:
                        fd = os.open(self.path, os.O_RDONLY)
                    except OSError as error:
                        raise DataError(f"{self.name}: cannot be opened ({error.strerror}); check the path") from None
                    self._size, self._pid, self._fd = os.fstat(fd).st_size, os.getpid(), fd
        return self._fd

    def size(self) -> int:
        """The file's length in bytes."""
        if self._stream is not None:
            with self._lock:
                return self._stream.seek(0, os.SEEK_END)
        self._open()
        return self._size

    def _read(self, offset: int, n: int) -> bytes:
        if self._stream is None:
            return os.pread(self._open(), n, offset)
        with self._lock:
            self._stream.seek(offset)
            return self._stream.read(n)

    def _bad(self, pos: int, what: str) -> DataError:
        return DataError(f"{self.name}: byte {pos}: {what}; {_CORRUPT}")

    def _chunk(self, pos: int, size: int, record: int, first: bool) -> tuple[int, bytes, int]:
        """(cflag, data, next offset) of the chunk at `pos`, a part of the record at `record`."""
        if pos + 8 > size:
            raise self._bad(pos, f"a record header needs 8 bytes but the file ends at byte {size}")
        magic, lrec = _FRAME.unpack(self._read(pos, 8))
        if magic != MAGIC:
            raise self._bad(pos, f"found 0x{magic:08x} where a record starts with the magic 0x{MAGIC:08x}")
        cflag, length = lrec >> 29, lrec & _MAX_CHUNK
        if pos + 8 + length > size:
            raise self._bad(pos, f"the record's {length} bytes run past the end of the file (byte {size})")
        if cflag not in ((0, 1) if first else (2, 3)):
            want = "0 or 1 to start a record" if first else f"2 or 3 to go on with the record at byte {record}"
            raise self._bad(pos, f"chunk flag {cflag} where {want} belongs")
        return cflag, self._read(pos + 8, length), pos + 8 + length + (-length % 4)

    def read_at(self, offset: int) -> tuple[bytes, int]:
        """(payload, offset of the next record) of the record starting at `offset`, split chunks joined."""
        size = self.size()
        if not 0 <= offset < size:
            raise self._bad(offset, f"the offset is past the end of the file ({size} bytes)")
        cflag, data, pos = self._chunk(offset, size, offset, True)
        parts = [data]
        while cflag in (1, 2):
            cflag, data, pos = self._chunk(pos, size, offset, False)
            parts.append(data)
        return _MAGIC_BYTES.join(parts), pos

    def read_head(self, offset: int, n: int) -> bytes:
        """The first `n` bytes (at most) of the payload at `offset`, reading little more than those."""
        if 0 <= offset < self.size() and n <= 4096:
            buf = self._read(offset, 8 + n)
            magic, lrec = _FRAME.unpack_from(buf) if len(buf) >= 8 else (0, 0)
            length = lrec & _MAX_CHUNK
            if magic == MAGIC and lrec >> 29 == 0 and offset + 8 + length <= self.size():
                return buf[8 : 8 + min(n, length)]
        return self.read_at(offset)[0][:n]

    def scan(self, start_offset: int = 0) -> Iterator[tuple[int, bytes]]:
        """(offset, payload) of each record from `start_offset` to the end of the file, in file order."""
        pos = start_offset
        while pos < self.size():
            payload, following = self.read_at(pos)
            yield pos, payload
            pos = following

    def close(self) -> None:
        """Close the file descriptor (a later read opens it again)."""
        fd, self._fd = self._fd, None
        if fd is not None and self._pid == os.getpid():
            os.close(fd)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _read_idx(path: Path, rec: RecordReader) -> dict[int, int]:
    offsets, size = {}, rec.size()
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 2 or not all(f.lstrip("-").isdigit() for f in fields):
            raise DataError(f"{path}: line {number}: {line[:60]!r} is not 'key<TAB>offset'; make the .idx again")
        key, offset = int(fields[0]), int(fields[1])
        if key in offsets:
            raise DataError(f"{path}: line {number}: key {key} is listed twice; make the .idx again from the .rec")
        if not 0 <= offset < size:
            raise DataError(
                f"{path}: line {number}: offset {offset} is past the end of {rec.name} ({size} bytes); {_CORRUPT}"
            )
        offsets[key] = offset
    end = rec.read_at(max(offsets.values()))[1] if offsets else 0
    if end < size:  # a cut-off .idx: the records past it would never be read
        raise DataError(
            f"{path}: its last record ends at byte {end} but {rec.name} goes on to byte {size}, so records are missing "
            "from it; make the .idx again, or delete it to read the .rec in one sequential pass"
        )
    return offsets


class RecordFile:
    """The records of a .rec by key: through its .idx, or keys 0, 1, 2... in file order when there is none."""

    def __init__(self, rec_path: str | os.PathLike, idx_path: str | os.PathLike | None = None):
        self.path = Path(rec_path)
        if not self.path.is_file():
            raise DataError(f"{self.path} does not exist or is not a file; point at the .rec of a RecordIO set")
        if idx_path is None and self.path.with_suffix(".idx").is_file():
            idx_path = self.path.with_suffix(".idx")
        self.idx_path = None if idx_path is None else Path(idx_path)
        self.reader = RecordReader(self.path)
        if self.idx_path is None:
            self._offsets = {key: offset for key, (offset, _) in enumerate(self.reader.scan())}
        else:
            self._offsets = _read_idx(self.idx_path, self.reader)
        self.keys: list[int] = list(self._offsets)

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, key: object) -> bool:
        return key in self._offsets

    def offset(self, key: int) -> int:
        """The byte offset of record `key` in the .rec."""
        if key not in self._offsets:
            raise DataError(f"{self.idx_path or self.path}: has no record with key {key}; the set is incomplete")
        return self._offsets[key]

    def payload(self, key: int) -> bytes:
        """Record `key`'s payload, split chunks joined."""
        return self.reader.read_at(self.offset(key))[0]

    def record(self, key: int) -> tuple[Header, np.ndarray, bytes]:
        """Record `key` as (header, float32 labels, encoded image)."""
        return unpack_payload(self.payload(key), f"{self.path}: key {key} (byte {self.offset(key)})")

    def header(self, key: int) -> tuple[Header, np.ndarray]:
        """Record `key`'s header and labels, reading those bytes only (not the image)."""
        offset = self.offset(key)
        head = self.reader.read_head(offset, _HEADER.size + 8)
        flag = _HEADER.unpack_from(head)[0] if len(head) >= _HEADER.size else 0
        if flag > 2:
            head = self.reader.read_head(offset, _HEADER.size + 4 * flag)
        header, labels, _ = unpack_payload(head, f"{self.path}: key {key} (byte {offset})")
        return header, labels


@dataclass
class InsightfaceSet:
    """A RecordIO image set: its image keys, one integer label each, and what `property` and the .lst add."""

    file: RecordFile
    keys: list[int]
    labels: np.ndarray  # int64, one per image key
    num_classes: int
    image_size: tuple[int, int] | None  # (height, width) from `property`
    identities: np.ndarray | None  # (identities, 2) int64 [first key, end key) in insightface's layout, else None
    names: list[str] | None  # the .lst's relative path per image key

    def __len__(self) -> int:
        return len(self.keys)

    def image(self, i: int) -> bytes:
        """The encoded bytes of image `i` (of `keys`)."""
        return self.file.record(self.keys[i])[2]


def _read_lst(path: Path) -> dict[int, str]:
    """key -> relative path: im2rec's `index<TAB>label...<TAB>path`, or insightface's `aligned<TAB>path<TAB>label`."""
    names = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fields = [f.strip() for f in line.strip().split("\t")]
        if len(fields) < 3 or not fields[0].isdigit():
            raise DataError(f"{path}: line {number}: {line[:60]!r} is not 'index<TAB>label<TAB>path'; make it again")
        if all(_is_number(f) for f in fields[1:-1]):
            names[int(fields[0])] = fields[-1]
        else:
            names[number] = fields[1]  # insightface's list: keys count from 1 in line order
    return names


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def read_insightface(source: str | os.PathLike) -> InsightfaceSet:
    """Open a set (a folder with train.rec, or a .rec): insightface layout when record 0 says so, else im2rec."""
    rec = Path(source)
    if rec.is_dir():
        found = sorted(rec.glob("*.rec"))
        if not (rec / "train.rec").is_file() and len(found) != 1:
            raise DataError(f"{rec} holds {len(found)} .rec files and no train.rec; name the .rec to read")
        rec = rec / "train.rec" if (rec / "train.rec").is_file() else found[0]
    file = RecordFile(rec)
    keys, identities = file.keys, None
    if 0 in file:
        header, labels, image = file.record(0)
        if header.flag >= 2 and not image:  # insightface's record 0: no image, labels (a, b)
            where = f"{rec}: record 0"
            a, b = _exact(labels[0], where, "first identity key a"), _exact(labels[1], where, "end key b")
            if not 1 <= a <= b:
                raise DataError(f"{where}: labels ({a}, {b}) are not an image key range 1 <= a <= b; {_CORRUPT}")
            missing = next((k for k in range(1, b) if k not in file), None)
            if missing is not None:
                raise DataError(f"{where}: says keys 1..{b - 1} but key {missing} is missing; {_CORRUPT}")
            keys = list(range(1, a))
            ranges = [file.header(k)[1][:2] for k in range(a, b)]
            identities = np.array(
                [[_exact(v, f"{rec}: key {a + i}", "identity key") for v in r] for i, r in enumerate(ranges)], np.int64
            ).reshape(-1, 2)
    labels = np.array([_exact(file.header(k)[1][0], f"{rec}: key {k}", "label") for k in keys], np.int64)
    num_classes, size = int(labels.max()) + 1 if labels.size else 0, None
    prop = rec.parent / "property"
    if prop.is_file():
        text = prop.read_text().strip()
        try:
            values = [int(v) for v in text.split(",")]
            num_classes, size = values[0], (values[1], values[2]) if len(values) >= 3 else None
        except (ValueError, IndexError):
            raise DataError(f"{prop}: {text[:60]!r} is not 'num_classes,height,width'; write it so") from None
        if num_classes > LABEL_EXACT_LIMIT:
            _exact(num_classes, str(prop), "num_classes")
        if labels.size and labels.max() >= num_classes:
            raise DataError(f"{rec}: label {labels.max()} is not below {prop}'s num_classes {num_classes}; fix {prop}")
    names = None
    if rec.with_suffix(".lst").is_file():
        listed = _read_lst(rec.with_suffix(".lst"))
        missing = next((k for k in keys if k not in listed), None)
        if missing is not None:
            raise DataError(f"{rec.with_suffix('.lst')}: no line for key {missing}; make the .lst again or delete it")
        names = [listed[k] for k in keys]
    return InsightfaceSet(file, keys, labels, num_classes, size, identities, names)


class _Staged:
    """A file written under a temporary name beside `path`; commit() fsyncs and renames it into place."""

    def __init__(self, path: Path, mode: str):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, self.tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        self.path, self.handle = path, os.fdopen(fd, mode)

    def commit(self) -> None:
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)

    def discard(self) -> None:
        self.handle.close()
        Path(self.tmp).unlink(missing_ok=True)

    def __enter__(self) -> _Staged:
        return self

    def __exit__(self, error: type | None, *_: object) -> None:
        self.discard() if error else self.commit()


class RecordWriter:
    """Writes a .rec and its .idx under temporary names; close() renames them into place, so neither is ever half.

    Keys must be unique (readers refuse an .idx that lists a key twice).
    """

    def __init__(self, rec_path: str | os.PathLike, idx_path: str | os.PathLike | None = None):
        self.rec_path = Path(rec_path)
        self.idx_path = self.rec_path.with_suffix(".idx") if idx_path is None else Path(idx_path)
        self._rec, self._idx = _Staged(self.rec_path, "w+b"), _Staged(self.idx_path, "w")
        self._offset, self.closed = 0, False

    def write(self, key: int, payload: bytes) -> int:
        """Append a record (cut at 4-aligned magics as dmlc-core does) and its .idx line; returns its offset."""
        offset, data = self._offset, _frames(payload)
        self._rec.handle.write(data)
        self._idx.handle.write(f"{int(key)}\t{offset}\n")
        self._offset += len(data)
        return offset

    def _rewrite(self, offset: int, payload: bytes) -> None:
        """Overwrite the unsplit record at `offset` with a payload of the same framed size."""
        data, handle = _frames(payload), self._rec.handle
        handle.seek(offset)
        _, lrec = _FRAME.unpack(handle.read(8))
        assert lrec >> 29 == 0 and len(data) == 8 + lrec + (-lrec % 4), "a rewrite needs a record of the same size"
        handle.seek(offset)
        handle.write(data)
        handle.seek(0, os.SEEK_END)

    def close(self) -> None:
        """fsync both files and rename them into place."""
        if not self.closed:
            self.closed = True
            self._rec.commit()
            self._idx.commit()

    def abort(self) -> None:
        """Drop both temporary files: nothing appears under the final names."""
        if not self.closed:
            self.closed = True
            self._rec.discard()
            self._idx.discard()

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, error: type | None, *_: object) -> None:
        self.abort() if error else self.close()


def _name(name: str, where: str) -> str:
    if "\t" in name or "\n" in name:
        raise DataError(f"{where}: the name {name!r} holds a tab or a newline, which a .lst cannot; rename it")
    return name


def write_insightface(
    folder: str | os.PathLike, images: Iterable[tuple[int, bytes, str]], num_classes: int, size: tuple[int, int]
) -> Path:
    """Write train.rec/.idx/.lst and property in insightface's layout; each identity's images must come together."""
    folder = Path(folder)
    if not 0 < num_classes <= LABEL_EXACT_LIMIT:
        _exact(num_classes, f"{folder}: num_classes", "num_classes")  # names float32's limit; else too few
        raise DataError(f"{folder}: num_classes {num_classes} must be at least 1; give the number of identities")
    with RecordWriter(folder / "train.rec") as writer, _Staged(folder / "train.lst", "w") as lst:
        start = writer.write(0, pack_payload([0.0, 0.0], b""))  # record 0: (a, b) are known at the end
        ranges: list[list[int]] = []
        seen: set[int] = set()
        key = 1
        for label, image, name in images:
            where = f"{folder}: image {key} ({name})"
            label = _exact(label, where, "label")
            if label >= num_classes:
                raise DataError(f"{where}: label {label} is not below num_classes {num_classes}; give the right count")
            if not ranges or ranges[-1][0] != label:
                if label in seen:
                    raise DataError(f"{where}: identity {label} came before; give each identity's images together")
                ranges.append([label, key, key])
                seen.add(label)
            _exact(key, where, "key")
            writer.write(key, pack_payload(float(label), image, id=key))
            lst.handle.write(f"{key}\t{label}\t{_name(name, where)}\n")
            ranges[-1][2] = key = key + 1
        a = key
        _exact(a + len(ranges), f"{folder}: {a - 1} images and {len(ranges)} identities", "end key")
        for i, (_, first, end) in enumerate(ranges):
            writer.write(a + i, pack_payload([float(first), float(end)], b""))
        writer._rewrite(start, pack_payload([float(a), float(a + len(ranges))], b""))
    atomic_write(folder / "property", f"{num_classes},{size[0]},{size[1]}\n".encode())
    return folder / "train.rec"


def write_im2rec(folder: str | os.PathLike, name: str, images: Iterable[tuple[int, bytes, str]]) -> Path:
    """Write name.rec/.idx/.lst as mxnet's im2rec does: keys 0..N-1, one scalar label each."""
    folder = Path(folder)
    with RecordWriter(folder / f"{name}.rec") as writer, _Staged(folder / f"{name}.lst", "w") as lst:
        for key, (label, image, path) in enumerate(images):
            where = f"{folder / name}.rec: image {key} ({path})"
            label = _exact(label, where, "label")
            writer.write(key, pack_payload(float(label), image, id=key))
            lst.handle.write(f"{key}\t{label}\t{_name(path, where)}\n")
    return folder / f"{name}.rec"
