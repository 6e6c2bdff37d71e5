"""RecordIO without mxnet: files built byte by byte from the documented layout read back right, and our writer's bytes
match that layout (dmlc-core's split at 4-aligned magics included); bad files and float32-inexact labels are one
DataError line naming the file and the byte offset or .idx line."""

from __future__ import annotations

import io
import pickle
import re
import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from vitrain.data.recordio import (
    MAGIC,
    RecordFile,
    RecordReader,
    RecordWriter,
    pack_payload,
    read_insightface,
    unpack_payload,
    write_im2rec,
    write_insightface,
)
from vitrain.errors import DataError

M = struct.pack("<I", 0xCED7230A)  # the magic as it lies on disk


# ------------------------------------------------------------------ an independent writer, straight from the format


def frame(cflag: int, data: bytes) -> bytes:
    return struct.pack("<II", 0xCED7230A, cflag << 29 | len(data)) + data + b"\0" * (-len(data) % 4)


def dmlc_record(payload: bytes) -> bytes:
    """dmlc-core's writer: cut wherever the 4 bytes at an aligned offset are the magic, drop it, flag 1, 2.., 3."""
    parts, start = [], 0
    for i in range(0, len(payload) - 3, 4):
        if payload[i : i + 4] == M:
            parts.append(payload[start:i])
            start = i + 4
    parts.append(payload[start:])
    flags = [0] if len(parts) == 1 else [1] + [2] * (len(parts) - 2) + [3]
    return b"".join(frame(f, p) for f, p in zip(flags, parts, strict=True))


def ir(label, image: bytes = b"", id: int = 0) -> bytes:
    """mxnet.recordio.pack: header <IfQQ, then the label array when there is one, then the image."""
    if isinstance(label, (list, tuple)):
        return struct.pack("<IfQQ", len(label), 0.0, id, 0) + struct.pack(f"<{len(label)}f", *label) + image
    return struct.pack("<IfQQ", 0, label, id, 0) + image


def write_set(rec, records: list[tuple[int, bytes]], idx: bool = True) -> list[int]:
    """Write `records` (key, payload) in file order, an .idx beside when asked; returns their offsets."""
    data, offsets = b"", []
    for _, payload in records:
        offsets.append(len(data))
        data += dmlc_record(payload)
    rec.write_bytes(data)
    if idx:
        lines = [f"{key}\t{offset}\n" for (key, _), offset in zip(records, offsets, strict=True)]
        rec.with_suffix(".idx").write_text("".join(lines))
    return offsets


def chunks(data: bytes) -> list[tuple[int, int]]:
    """(cflag, length) of each chunk of a .rec's bytes, parsed here by hand."""
    out, pos = [], 0
    while pos < len(data):
        magic, lrec = struct.unpack_from("<II", data, pos)
        assert magic == 0xCED7230A
        out.append((lrec >> 29, lrec & (2**29 - 1)))
        pos += 8 + (lrec & (2**29 - 1)) + (-lrec % 4)
    return out


@pytest.fixture(scope="module")
def jpeg() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.arange(192, dtype=np.uint8).reshape(8, 8, 3)).save(buffer, format="JPEG")
    return buffer.getvalue()


PAYLOADS = [
    b"",
    b"abc",
    b"abcd",
    M,
    M + M,
    b"x" + M + b"y",
    b"AAAA" + M + b"BBBB" + M + b"CC" + M + b"D",
    M + b"1234" + M,
]


# ------------------------------------------------------------------------------------------------------ framing


def test_an_aligned_magic_is_split_into_chunks_1_2_3_and_joined_back(tmp_path):
    payload = b"AAAA" + M + b"BBBB" + M + b"CC" + M + b"D"  # aligned at 4 and 12, unaligned at 18
    with RecordWriter(tmp_path / "a.rec") as writer:
        writer.write(7, payload)
    data = (tmp_path / "a.rec").read_bytes()
    assert chunks(data) == [(1, 4), (2, 4), (3, 7)]  # the two aligned magics left out, the unaligned one kept
    assert data == frame(1, b"AAAA") + frame(2, b"BBBB") + frame(3, b"CC" + M + b"D")
    assert (tmp_path / "a.idx").read_text() == "7\t0\n"
    assert RecordFile(tmp_path / "a.rec").payload(7) == payload


@pytest.mark.parametrize("payload", PAYLOADS)
def test_payloads_round_trip_and_our_bytes_are_dmlcs(tmp_path, payload):
    with RecordWriter(tmp_path / "a.rec") as writer:
        writer.write(0, b"first")
        writer.write(1, payload)
        writer.write(2, b"last")
    assert (tmp_path / "a.rec").read_bytes() == dmlc_record(b"first") + dmlc_record(payload) + dmlc_record(b"last")
    file = RecordFile(tmp_path / "a.rec")
    assert [file.payload(k) for k in file.keys] == [b"first", payload, b"last"]


def test_files_written_by_hand_read_alike_with_and_without_idx_and_from_a_stream(tmp_path):
    records = [(k, p + bytes([k])) for k, p in enumerate(PAYLOADS)]
    (tmp_path / "with").mkdir()
    (tmp_path / "without").mkdir()
    offsets = write_set(tmp_path / "with" / "a.rec", records)
    write_set(tmp_path / "without" / "a.rec", records, idx=False)
    indexed, scanned = RecordFile(tmp_path / "with" / "a.rec"), RecordFile(tmp_path / "without" / "a.rec")
    assert scanned.idx_path is None and indexed.keys == scanned.keys == list(range(len(records)))
    assert [indexed.offset(k) for k in indexed.keys] == [scanned.offset(k) for k in scanned.keys] == offsets
    assert [indexed.payload(k) for k in indexed.keys] == [scanned.payload(k) for k in scanned.keys]
    assert [p for _, p in records] == [indexed.payload(k) for k in indexed.keys]
    stream = RecordReader(io.BytesIO((tmp_path / "with" / "a.rec").read_bytes()))
    assert list(stream.scan()) == [(o, p) for o, (_, p) in zip(offsets, records, strict=True)]


def test_image_payloads_with_a_label_array_and_with_a_scalar(jpeg):
    payload = pack_payload([1.5, 2.0, 3.0], jpeg, id=9)
    assert payload == ir([1.5, 2.0, 3.0], jpeg, id=9)
    header, labels, image = unpack_payload(payload, "x")
    assert (header.flag, header.label, header.id) == (3, 0.0, 9)
    assert labels.dtype == np.float32 and labels.tolist() == [1.5, 2.0, 3.0] and image == jpeg
    header, labels, image = unpack_payload(ir(4.0, jpeg), "x")
    assert header.flag == 0 and labels.tolist() == [4.0] and image == jpeg
    assert pack_payload(4, jpeg) == ir(4.0, jpeg)


# ------------------------------------------------------------------------------------------------------ layouts


def test_an_insightface_set_written_by_hand_reads_back(tmp_path, jpeg):
    images = [(1, 0), (2, 0), (3, 1), (4, 1), (5, 1)]  # (key, identity)
    records = [(k, ir(float(label), jpeg, id=k)) for k, label in images]
    records += [(6, ir([1.0, 3.0])), (7, ir([3.0, 6.0]))]
    records.append((0, ir([6.0, 8.0])))  # record 0 last in the file: only the .idx finds it
    write_set(tmp_path / "train.rec", records)
    (tmp_path / "property").write_text("2,8,8\n")
    data = read_insightface(tmp_path)
    assert data.keys == [1, 2, 3, 4, 5] and data.labels.tolist() == [0, 0, 1, 1, 1]
    assert data.labels.dtype == np.int64 and data.num_classes == 2 and data.image_size == (8, 8)
    assert data.identities.tolist() == [[1, 3], [3, 6]] and data.names is None
    assert np.asarray(Image.open(io.BytesIO(data.image(0)))).shape == (8, 8, 3)


def test_write_insightface_lays_out_record_0_images_and_identities(tmp_path, jpeg):
    images = [(3, jpeg, "c/0.jpg"), (3, jpeg, "c/1.jpg"), (0, jpeg, "a/0.jpg"), (1, jpeg, "b/0.jpg")]
    write_insightface(tmp_path, images, num_classes=5, size=(8, 8))
    assert (tmp_path / "property").read_text() == "5,8,8\n"
    data = (tmp_path / "train.rec").read_bytes()
    assert struct.unpack_from("<IIIfQQff", data) == (MAGIC, 32, 2, 0.0, 0, 0, 5.0, 8.0)  # record 0 first: (a, b)
    read = read_insightface(tmp_path)
    assert read.keys == [1, 2, 3, 4] and read.labels.tolist() == [3, 3, 0, 1] and read.num_classes == 5
    assert read.identities.tolist() == [[1, 3], [3, 4], [4, 5]]
    assert read.names == ["c/0.jpg", "c/1.jpg", "a/0.jpg", "b/0.jpg"] and read.image(3) == jpeg
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "train.rec").write_bytes(data)  # no .idx: keys in file order are the same
    assert RecordFile(tmp_path / "copy" / "train.rec").keys == RecordFile(tmp_path / "train.rec").keys == list(range(8))
    with pytest.raises(DataError, match="identity 3 came before"):
        write_insightface(tmp_path / "bad", [*images, (3, jpeg, "c/2.jpg")], num_classes=5, size=(8, 8))


def test_an_im2rec_set_reads_with_its_lst_names(tmp_path, jpeg):
    write_set(tmp_path / "val.rec", [(k, ir(float(k % 2), jpeg, id=k)) for k in range(3)])
    (tmp_path / "val.lst").write_text("0\t0.0\tcat/a.jpg\n1\t1.0\t2.0\tdog/b.jpg\n2\t0.0\tcat/c.jpg\n")
    data = read_insightface(tmp_path / "val.rec")
    assert data.keys == [0, 1, 2] and data.labels.tolist() == [0, 1, 0] and data.num_classes == 2
    assert data.identities is None and data.image_size is None and data.names == ["cat/a.jpg", "dog/b.jpg", "cat/c.jpg"]
    write_im2rec(tmp_path / "ours", "train", [(2, jpeg, "x/0.png"), (0, jpeg, "y/1.png")])
    assert (tmp_path / "ours" / "train.lst").read_text() == "0\t2\tx/0.png\n1\t0\ty/1.png\n"
    ours = read_insightface(tmp_path / "ours")
    assert ours.keys == [0, 1] and ours.labels.tolist() == [2, 0] and ours.names == ["x/0.png", "y/1.png"]


# ------------------------------------------------------------------------------------------------------ bad input


def corrupt(tmp_path, how: str):
    """A three-record set spoilt one way; returns (the file the error must name, what it must say)."""
    rec = tmp_path / "a.rec"
    offsets = write_set(rec, [(0, b"zero"), (1, b"one" * 5), (2, b"two")])
    data = rec.read_bytes()
    if how == "magic":
        rec.write_bytes(data[: offsets[1]] + b"\xff" + data[offsets[1] + 1 :])
        return rec, f"byte {offsets[1]}: found 0xced723ff"
    if how == "truncated":
        rec.write_bytes(data[: offsets[2] + 9])
        return rec, f"byte {offsets[2]}: the record's 3 bytes run past the end"
    if how == "lonely middle chunk":
        rec.write_bytes(data + frame(2, b"mid"))
        rec.with_suffix(".idx").write_text(f"0\t0\n3\t{len(data)}\n")
        return rec, f"byte {len(data)}: chunk flag 2"
    if how == "offset past end":
        rec.with_suffix(".idx").write_text(f"0\t0\n1\t{len(data) + 4}\n")
        return rec.with_suffix(".idx"), f"line 2: offset {len(data) + 4} is past the end"
    rec.with_suffix(".idx").write_text("0\t0\n1\t24\n2 twelve\n")
    return rec.with_suffix(".idx"), "line 3: '2 twelve' is not 'key<TAB>offset'"


@pytest.mark.parametrize("how", ["magic", "truncated", "lonely middle chunk", "offset past end", "malformed idx"])
def test_a_bad_file_is_one_line_naming_the_file_and_where(tmp_path, how):
    named, says = corrupt(tmp_path, how)
    with pytest.raises(DataError) as raised:
        file = RecordFile(tmp_path / "a.rec")
        for key in file.keys:
            file.payload(key)
    message = str(raised.value)
    assert "\n" not in message and str(named) in message and says in message, message


def test_reading_without_idx_meets_the_same_damage(tmp_path):
    _, says = corrupt(tmp_path, "truncated")
    (tmp_path / "a.idx").unlink()
    with pytest.raises(DataError, match=says):
        RecordFile(tmp_path / "a.rec")


def test_an_idx_that_stops_short_of_its_rec_is_refused_naming_both(tmp_path):
    offsets = write_set(tmp_path / "a.rec", [(0, b"zero"), (1, b"one"), (2, b"two")])
    idx, size = tmp_path / "a.idx", (tmp_path / "a.rec").stat().st_size
    idx.write_text("".join(idx.read_text().splitlines(keepends=True)[:2]))
    says = rf"a\.idx: its last record ends at byte {offsets[2]} but .*a\.rec goes on to byte {size}"
    with pytest.raises(DataError, match=says):
        RecordFile(tmp_path / "a.rec")
    idx.unlink()
    assert RecordFile(tmp_path / "a.rec").keys == [0, 1, 2]


def test_a_folder_with_the_val_rec_but_no_train_rec_is_refused_not_trained_on(tmp_path, jpeg):
    from tests.conftest import tiny_overrides
    from vitrain.config import load_config
    from vitrain.data.records import recordio_source

    images = [(k % 2, jpeg, f"{k}.jpg") for k in range(5)]
    write_im2rec(tmp_path / "one", "faces", images)  # one un-split .rec: trained on, a share held out
    train, val = recordio_source(load_config(None, tiny_overrides(tmp_path, f"data.root={tmp_path / 'one'}")))
    assert len(train) + len(val) == 5
    write_im2rec(tmp_path / "split", "test", images)
    with pytest.raises(DataError, match=r"has test\.rec \(data\.val_split\) but no train\.rec"):
        recordio_source(load_config(None, tiny_overrides(tmp_path, f"data.root={tmp_path / 'split'}")))


# ------------------------------------------------------------------------------------------------------ float32


@pytest.mark.parametrize(
    "records, says",
    [
        ([(0, ir([2.0, 2.0**24 + 2])), (1, ir(0.0, b"img"))], "end key b 16777218.0 is >= 16,777,216"),
        ([(0, ir(float(2**24), b"img"))], "label 16777216.0 is >= 16,777,216"),
        ([(0, ir(1.5, b"img"))], "label 1.5 is not an integer"),
    ],
)
def test_a_label_or_key_float32_cannot_hold_is_refused(tmp_path, records, says):
    write_set(tmp_path / "train.rec", records)
    with pytest.raises(DataError, match=says) as raised:
        read_insightface(tmp_path)
    assert "float32" in str(raised.value) and str(tmp_path / "train.rec") in str(raised.value)


def test_property_with_more_classes_than_float32_holds_is_refused(tmp_path, jpeg):
    write_set(tmp_path / "train.rec", [(0, ir(0.0, jpeg))])
    (tmp_path / "property").write_text(f"{2**24 + 1},112,112\n")
    with pytest.raises(DataError, match="16,777,216"):
        read_insightface(tmp_path)


def test_the_writers_refuse_labels_float32_cannot_hold(tmp_path, jpeg):
    with pytest.raises(DataError, match="16,777,216"):
        write_im2rec(tmp_path, "train", [(0, jpeg, "a.jpg"), (2**24, jpeg, "b.jpg")])
    with pytest.raises(DataError, match="16,777,216"):
        write_insightface(tmp_path, [(0, jpeg, "a.jpg")], num_classes=2**24 + 1, size=(8, 8))
    with pytest.raises(DataError, match="not an integer"):
        write_insightface(tmp_path, [(0.5, jpeg, "a.jpg")], num_classes=2, size=(8, 8))
    assert list(tmp_path.iterdir()) == []  # nothing half-written, no temporary files left


# ------------------------------------------------------------------------------------------------------ writer, workers


def test_an_exception_inside_the_writer_leaves_no_file(tmp_path):
    with pytest.raises(RuntimeError), RecordWriter(tmp_path / "a.rec") as writer:
        writer.write(0, b"payload")
        raise RuntimeError("crash")
    assert list(tmp_path.iterdir()) == []


def test_a_pickled_record_file_reads_in_its_copy_and_from_threads(tmp_path):
    write_set(tmp_path / "a.rec", [(k, bytes([k]) * (k + 1) + M) for k in range(32)])
    file = RecordFile(tmp_path / "a.rec")
    assert file.payload(3) == b"\3" * 4 + M  # the descriptor is open now; the copy must open its own
    copy = pickle.loads(pickle.dumps(file))
    assert copy.reader._fd is None and copy.payload(5) == b"\5" * 6 + M
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(copy.payload, [k % 32 for k in range(256)]))
    assert got == [bytes([k % 32]) * (k % 32 + 1) + M for k in range(256)]


# ------------------------------------------------------------------------------------------------------ class names


@pytest.mark.parametrize("listing", ["classes.txt", "identities.txt"])
@pytest.mark.parametrize(
    "labels, prop, says",
    [
        ([0, 1, 1], None, None),
        ([0, 1, 7], None, r"train\.rec: key 2 has label 7, but .*{listing} names 2 classes \(labels 0 to 1\)"),
        ([0, 1, 1], "5,8,8", r"{listing} names 2 classes but .*property says num_classes 5"),
    ],
    ids=["inside", "label-outside", "property-more"],
)
def test_a_label_the_class_listing_does_not_name_is_refused_naming_it(tmp_path, jpeg, listing, labels, prop, says):
    from vitrain.data.records import class_names

    write_set(tmp_path / "train.rec", [(k, ir(float(label), jpeg)) for k, label in enumerate(labels)])
    (tmp_path / listing).write_text("cat\ndog\n")
    if prop:
        (tmp_path / "property").write_text(prop + "\n")
    records = read_insightface(tmp_path)
    if says is None:
        assert class_names(tmp_path, records) == ["cat", "dog"]
        return
    with pytest.raises(DataError, match=says.format(listing=re.escape(listing))) as raised:
        class_names(tmp_path, records)
    assert "model.num_classes" not in str(raised.value) and "\n" not in str(raised.value)
