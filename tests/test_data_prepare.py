"""`vitrain data prepare` and the prepared format: conversion, bad input, resume, checksums."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.data_helpers import TREE_MODEL, make_tree, zip_tree
from vitrain.cli import main
from vitrain.data import prepared as prepared_module
from vitrain.data.prepare import FAILED, prepare
from vitrain.data.prepared import open_prepared, verify_files
from vitrain.errors import DataError

REPO = Path(__file__).resolve().parent.parent
CIFAR_ZIP = REPO.parent / "shared" / "data" / "cifar10-jpg.zip"


def _all_images(split) -> tuple[np.ndarray, np.ndarray]:
    images, labels = split.read(torch.arange(len(split)))
    return images.numpy(), labels.numpy()


def test_prepare_converts_every_image_with_its_label(tmp_path):
    pixels = make_tree(tmp_path / "src", splits={"train": 5, "test": 3})
    result = prepare(tmp_path / "src", tmp_path / "out", shard_size=4, workers=1)
    splits = open_prepared(tmp_path / "out")
    assert result.images == 16 and result.failed == []
    assert sorted(splits) == ["test", "train"]
    train = splits["train"]
    assert (len(train), len(splits["test"]), train.channels, train.size) == (10, 6, 3, 8)
    assert train.classes == ["cat", "dog"]
    images, labels = _all_images(train)
    expected = [pixels[f"train/{c}/{i:03d}.png"] for c in ("cat", "dog") for i in range(5)]
    np.testing.assert_array_equal(images, np.stack(expected))
    assert labels.tolist() == [0] * 5 + [1] * 5


def test_prepare_reads_a_zip_with_one_top_folder(tmp_path):
    make_tree(tmp_path / "src", splits={"train": 3, "val": 2})
    archive = zip_tree(tmp_path / "src", tmp_path / "src.zip")
    prepare(archive, tmp_path / "out", workers=1)
    splits = open_prepared(tmp_path / "out")
    assert {k: len(v) for k, v in splits.items()} == {"train": 6, "val": 4}


def test_grey_images_are_stored_with_one_channel(tmp_path):
    pixels = make_tree(tmp_path / "src", splits={"train": 2}, mode="L", suffix=".pgm")
    prepare(tmp_path / "src", tmp_path / "out", workers=1)
    train = open_prepared(tmp_path / "out")["train"]
    images, _ = _all_images(train)
    assert train.channels == 1
    np.testing.assert_array_equal(images[0], pixels["train/cat/000.pgm"])


def test_size_resizes_every_image(tmp_path):
    make_tree(tmp_path / "src", splits={"train": 2}, size=12)
    prepare(tmp_path / "src", tmp_path / "out", size=6, workers=1)
    images, _ = _all_images(open_prepared(tmp_path / "out")["train"])
    assert images.shape == (4, 3, 6, 6)


def test_images_of_mixed_sizes_need_an_explicit_size(tmp_path):
    make_tree(tmp_path / "src", splits={"train": 1}, classes=("a",), size=8)
    make_tree(tmp_path / "src", splits={"train": 1}, classes=("b",), size=10)
    with pytest.raises(DataError, match=r"not all one square size \(8x8, 10x10\); pass --size S"):
        prepare(tmp_path / "src", tmp_path / "out", workers=1)


def test_corrupt_and_truncated_images_are_reported_and_the_rest_converted(tmp_path):
    make_tree(tmp_path / "src", splits={"train": 4}, suffix=".jpg")
    garbage = tmp_path / "src" / "train" / "cat" / "garbage.jpg"
    garbage.write_bytes(b"this is not a jpeg")
    good = (tmp_path / "src" / "train" / "dog" / "000.jpg").read_bytes()
    truncated = tmp_path / "src" / "train" / "dog" / "truncated.jpg"
    truncated.write_bytes(good[: len(good) // 2])
    result = prepare(tmp_path / "src", tmp_path / "out", shard_size=3, workers=2)
    failed = dict(result.failed)
    assert set(failed) == {str(garbage), str(truncated)}
    assert failed[str(garbage)] == "not an image PIL can read"  # no `<_io.BytesIO object at 0x...>` in the reason
    assert "truncated" in failed[str(truncated)].lower()
    assert result.images == 8
    listed = (tmp_path / "out" / FAILED).read_text().splitlines()
    assert sorted(line.split("\t")[0] for line in listed) == sorted(failed)
    _, labels = _all_images(open_prepared(tmp_path / "out")["train"])
    assert labels.tolist() == [0] * 4 + [1] * 4


def test_a_class_tree_manifest_has_no_identity_layout_or_names(tmp_path):
    make_tree(tmp_path / "src", splits={"train": 2})
    prepare(tmp_path / "src", tmp_path / "out", workers=1)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert "layout" not in manifest and "names" not in manifest["splits"]["train"]


def test_identity_folders_prepare_into_one_split_named_all(tmp_path):
    make_tree(tmp_path / "src", splits={"train": 2}, classes=("s2", "s10"))  # 'train' is the common folder here
    prepare(tmp_path / "src", tmp_path / "out", workers=1, identities=True)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert list(manifest["splits"]) == ["all"] and manifest["classes"] == ["s2", "s10"]
    assert manifest["splits"]["all"]["names"] == [
        "train/s2/000.png",
        "train/s2/001.png",
        "train/s10/000.png",
        "train/s10/001.png",
    ]


def test_cli_prepare_prints_skipped_files(tmp_path, capsys):
    make_tree(tmp_path / "src", splits={"train": 2})
    bad = tmp_path / "src" / "train" / "cat" / "bad.png"
    bad.write_bytes(b"\x89PNG broken")
    assert main(["data", "prepare", str(tmp_path / "src"), str(tmp_path / "out"), "--workers", "1"]) == 0
    captured = capsys.readouterr()
    assert f"skipped {bad}" in captured.err
    assert "prepared 4 images" in captured.out
    assert "prepare:" not in captured.err  # its progress bar draws on a terminal, not into a file's text


def test_empty_class_folder_is_an_error_naming_it(tmp_path, capsys):
    make_tree(tmp_path / "src", splits={"train": 2})
    (tmp_path / "src" / "train" / "zebra").mkdir()
    with pytest.raises(DataError, match=r"class folder .*train/zebra is empty"):
        prepare(tmp_path / "src", tmp_path / "out", workers=1)
    assert main(["data", "prepare", str(tmp_path / "src"), str(tmp_path / "out2")]) == 2
    assert "train/zebra is empty" in capsys.readouterr().err


def test_empty_class_folder_inside_a_zip_is_an_error_naming_it(tmp_path):
    make_tree(tmp_path / "src", splits={"train": 2})
    (tmp_path / "src" / "train" / "zebra").mkdir()
    archive = zip_tree(tmp_path / "src", tmp_path / "src.zip")
    with pytest.raises(DataError, match=r"class folder .*src\.zip:data/train/zebra is empty"):
        prepare(archive, tmp_path / "out", workers=1)


class _InterruptAfter:
    """A progress callback that raises KeyboardInterrupt (as Ctrl-C would) after `shards` shards finished."""

    def __init__(self, shards: int):
        self.left = shards

    def __call__(self, n: int) -> None:
        self.left -= 1
        if self.left == 0:
            raise KeyboardInterrupt


@pytest.mark.parametrize("workers", [1, 2])
def test_interrupted_prepare_resumes_without_redoing_finished_shards(tmp_path, workers):
    make_tree(tmp_path / "src", splits={"train": 30}, size=8)  # 60 images, 30 shards of 2
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        prepare(tmp_path / "src", out, shard_size=2, workers=workers, progress=_InterruptAfter(2))
    assert not (out / "manifest.json").exists()
    finished = sorted(p.name.removesuffix(".done.json") for p in out.glob("*.done.json"))
    assert 2 <= len(finished) < 30  # shards already handed to a worker process finish; queued ones are dropped
    before = {name: os.stat(out / f"{name}.npy") for name in finished}

    result = prepare(tmp_path / "src", out, shard_size=2, workers=workers)
    assert (result.shards_done_before, result.shards_converted) == (len(finished), 30 - len(finished))
    for name, st in before.items():
        after = os.stat(out / f"{name}.npy")
        assert (after.st_ino, after.st_mtime_ns) == (st.st_ino, st.st_mtime_ns), f"{name} was redone"
    prepare(tmp_path / "src", tmp_path / "straight", shard_size=2, workers=1)
    resumed, straight = (
        _all_images(open_prepared(out)["train"]),
        _all_images(open_prepared(tmp_path / "straight")["train"]),
    )
    np.testing.assert_array_equal(resumed[0], straight[0])
    np.testing.assert_array_equal(resumed[1], straight[1])


def test_preparing_with_other_settings_into_the_same_folder_is_refused(tmp_path):
    make_tree(tmp_path / "src", splits={"train": 2})
    prepare(tmp_path / "src", tmp_path / "out", workers=1)
    with pytest.raises(DataError, match="different size"):
        prepare(tmp_path / "src", tmp_path / "out", size=4, workers=1)


@pytest.fixture
def prepared_dir(tmp_path) -> Path:
    make_tree(tmp_path / "src", splits={"train": 4, "test": 2})
    prepare(tmp_path / "src", tmp_path / "out", shard_size=4, workers=1)
    return tmp_path / "out"


def test_truncated_prepared_file_fails_with_its_name(prepared_dir):
    shard = prepared_dir / "train-00001.npy"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 10)
    with pytest.raises(DataError, match=r"prepared file .*train-00001\.npy is \d+ bytes .* truncated or changed"):
        open_prepared(prepared_dir)


def test_changed_prepared_file_fails_its_checksum(prepared_dir):
    labels = prepared_dir / "train.labels.npy"
    data = bytearray(labels.read_bytes())
    data[-1] ^= 1  # same size, one label changed
    labels.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"prepared file .*train\.labels\.npy fails its sha256 checksum"):
        open_prepared(prepared_dir)


def test_training_on_a_changed_prepared_set_stops_before_training(prepared_dir, tmp_path, capsys):
    shard = prepared_dir / "test-00000.npy"
    data = bytearray(shard.read_bytes())
    data[200] ^= 0xFF
    shard.write_bytes(bytes(data))
    args = [
        "train",
        f"log.out_dir={tmp_path / 'runs'}",
        "data.source=folder",
        f"data.root={prepared_dir}",
        *TREE_MODEL,
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "test-00000.npy fails its sha256 checksum" in err
    assert not (tmp_path / "runs" / "digits" / "last.pt").exists()


def _rewrite(root: Path, name: str, array: np.ndarray) -> None:
    """Replace the prepared file `name` with `array` and record its new size and checksum in the manifest."""
    np.save(root / name, array, allow_pickle=True)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["files"][name] = {
        "bytes": (root / name).stat().st_size,
        "sha256": prepared_module.sha256_file(root / name),
    }
    (root / "manifest.json").write_text(json.dumps(manifest))


def _edit(root: Path, change) -> None:
    manifest = json.loads((root / "manifest.json").read_text())
    change(manifest)
    (root / "manifest.json").write_text(json.dumps(manifest))


def _traverse(manifest):
    manifest["splits"]["train"]["shards"][0]["images"] = "../out/train-00000.npy"
    manifest["files"]["../out/train-00000.npy"] = manifest["files"].pop("train-00000.npy")


def _object_labels(root):
    labels = np.empty(8, dtype=object)
    labels[:] = 0
    _rewrite(root, "train.labels.npy", labels)


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda d: (d / "manifest.json").write_text("[1, 2]"), r"manifest\.json holds a JSON list"),
        (lambda d: _edit(d, lambda m: m.pop("splits")), r"manifest\.json: splits is missing"),
        (
            lambda d: _edit(d, lambda m: m["splits"]["train"]["shards"][0].update(count="abc")),
            r"splits\.train\.shards\[0\]\.count is 'abc', expected a whole number",
        ),
        (
            lambda d: _edit(d, lambda m: m["splits"]["train"]["shards"][0].update(count=9)),
            r"splits\.train\.count is 8 but its shards' counts add up to 13",
        ),
        (
            lambda d: _edit(
                d, lambda m: (m["splits"]["train"]["shards"][0].update(count=9), m["splits"]["train"].update(count=13))
            ),
            r"train-00000\.npy holds uint8 \(4, 3, 8, 8\) but manifest\.json records uint8 \(9, 3, 8, 8\)",
        ),
        (
            lambda d: _edit(d, lambda m: m.update(size=16)),
            r"-00000\.npy holds uint8 \(4, 3, 8, 8\) .* \(4, 3, 16, 16\)",
        ),
        (
            lambda d: _edit(d, lambda m: m.update(channels=1)),
            r"-00000\.npy holds uint8 \(4, 3, 8, 8\) .* \(4, 1, 8, 8\)",
        ),
        (
            lambda d: _rewrite(d, "train-00000.npy", np.zeros((4, 3, 8, 8), np.float32)),
            r"train-00000\.npy holds float32",
        ),
        (
            lambda d: _rewrite(d, "train.labels.npy", np.zeros(5, np.int64)),
            r"train\.labels\.npy holds int64 \(5,\) but manifest\.json records 8 integer labels",
        ),
        (_object_labels, r"train\.labels\.npy is not a numeric \.npy array"),
        (lambda d: _edit(d, _traverse), r"files\['\.\./out/train-00000\.npy'\] is not a plain file name"),
    ],
    ids=[
        "list",
        "no-splits",
        "count-text",
        "count-sum",
        "count-rows",
        "size",
        "channels",
        "float-shard",
        "short-labels",
        "object-labels",
        "outside-folder",
    ],
)
def test_manifest_that_disagrees_with_its_files_is_one_error_naming_it(prepared_dir, damage, match):
    damage(prepared_dir)
    with pytest.raises(DataError, match=match) as caught:
        open_prepared(prepared_dir)
    assert "prepare the data again" in str(caught.value) and "\n" not in str(caught.value)


def test_verified_files_are_not_hashed_again_until_they_change(prepared_dir, monkeypatch):
    monkeypatch.setattr(prepared_module, "RACY_WINDOW_NS", 0)
    files = json.loads((prepared_dir / "manifest.json").read_text())["files"]
    assert verify_files(prepared_dir, files) == len(files)
    assert verify_files(prepared_dir, files) == 0  # stamped: sizes checked, nothing hashed
    assert verify_files(prepared_dir, files, always_hash=True) == len(files)
    # Change bytes in place and put the old mtime back: the ctime still moves, so the file is hashed and caught.
    shard = prepared_dir / "train-00000.npy"
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(DataError, match="train-00000.npy fails its sha256 checksum"):
        verify_files(prepared_dir, files)


@pytest.mark.slow
@pytest.mark.skipif(not CIFAR_ZIP.exists(), reason=f"{CIFAR_ZIP} is not on this machine")
def test_cifar10_zip_converts_all_60000_images(tmp_path):
    result = prepare(CIFAR_ZIP, tmp_path / "cifar", workers=2)
    splits = open_prepared(tmp_path / "cifar")
    assert result.failed == []
    assert {k: len(v) for k, v in splits.items()} == {"train": 50000, "test": 10000}
    assert splits["train"].classes[:2] == ["airplane", "automobile"]


@pytest.mark.slow
@pytest.mark.skipif(not CIFAR_ZIP.exists(), reason=f"{CIFAR_ZIP} is not on this machine")
def test_cifar10_prepare_stopped_by_ctrl_c_resumes_without_redoing_finished_shards(tmp_path):
    """The acceptance run: Ctrl-C (SIGINT to the process group) part-way, then the same command again."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "cifar"
    command = [sys.executable, "-m", "vitrain", "data", "prepare", str(CIFAR_ZIP), str(out), "--workers", "2"]
    first = subprocess.Popen(command, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        while len(list(out.glob("*.done.json"))) < 3:
            assert first.poll() is None, first.communicate()
            time.sleep(0.2)
        os.killpg(first.pid, signal.SIGINT)
        _, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode == 130 and b"run the same command again" in err
    finished = sorted(p.name.removesuffix(".done.json") for p in out.glob("*.done.json"))
    before = {name: os.stat(out / f"{name}.npy").st_mtime_ns for name in finished}
    assert 3 <= len(finished) < 30 and not (out / "manifest.json").exists()

    second = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr
    assert f"{30 - len(finished)} shards converted, {len(finished)} already done" in second.stdout
    assert {name: os.stat(out / f"{name}.npy").st_mtime_ns for name in finished} == before
    splits = open_prepared(out)
    assert {k: len(v) for k, v in splits.items()} == {"train": 50000, "test": 10000}
