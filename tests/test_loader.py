"""The fast loader (order, resume, prefetch, prepared reads), batched augmentation, the plain path, data wait."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.data_helpers import TREE_MODEL, make_tree
from vitrain.config import load_config
from vitrain.data import BatchAugment, BatchLoader, ImageSet, build_datasets, build_loaders, open_prepared
from vitrain.data.augment import pad_crop_flip, random_resized_crop
from vitrain.data.loader import (
    PAD_LABEL,
    TRACE_ENV,
    epoch_order,
    first_batch,
    from_workers,
    wait_for_end,
    worker_start,
)
from vitrain.data.prepare import prepare
from vitrain.data.prepared import PreparedSet
from vitrain.engine import Trainer
from vitrain.errors import DataError

CPU = torch.device("cpu")


def _cfg(*overrides: str):
    return load_config(overrides=[*TREE_MODEL, "log.progress=false", *overrides])


def _image_set(n: int = 40, size: int = 8) -> ImageSet:
    gen = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=gen)
    return ImageSet(images, torch.arange(n) % 2, ["a", "b"])


def _loader(data, prefetch: int = 2, **data_overrides) -> BatchLoader:
    cfg = _cfg(*[f"data.{k}={v}" for k, v in data_overrides.items()])
    augment = BatchAugment(cfg.data, 3, True, 8, 2)
    return BatchLoader(data, 8, augment, CPU, shuffle=True, seed=3, prefetch=prefetch)


@pytest.fixture(scope="module")
def prepared_tree(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("data")
    make_tree(root / "src", splits={"train": 20, "test": 4})
    prepare(root / "src", root / "out", shard_size=7, workers=1)
    return root / "src", root / "out"


# ---------------------------------------------------------------------------------------------- order


def test_ranks_get_disjoint_shares_that_cover_the_epoch():
    shares = [epoch_order(103, epoch=4, seed=7, shuffle=True, rank=r, world_size=4) for r in range(4)]
    joined = torch.cat(shares)
    assert all(len(s) == 25 for s in shares)
    assert len(set(joined.tolist())) == 100


def test_validation_shares_are_equal_and_hold_every_sample_once_the_padding_labelled_to_ignore():
    n, world_size = 13, 3  # padded to 15: two ranks end with one padding sample each
    data = ImageSet(torch.zeros(n, 3, 8, 8, dtype=torch.uint8), torch.arange(n), [str(i) for i in range(n)])
    augment = BatchAugment(_cfg().data, 3, False, 8, n)
    labels = []
    for rank in range(world_size):
        loader = BatchLoader(data, 2, augment, CPU, shuffle=False, rank=rank, world_size=world_size, drop_last=False)
        batches = [y for _, y in loader.epoch(0)]
        assert len(loader) == len(batches) == 3 and sum(len(y) for y in batches) == 5
        labels += torch.cat(batches).tolist()
    assert sorted(y for y in labels if y != PAD_LABEL) == list(range(n))
    assert labels.count(PAD_LABEL) == 2


def test_order_depends_only_on_seed_and_epoch():
    a = epoch_order(50, epoch=2, seed=1, shuffle=True)
    assert torch.equal(a, epoch_order(50, epoch=2, seed=1, shuffle=True))
    assert not torch.equal(a, epoch_order(50, epoch=3, seed=1, shuffle=True))


def test_resuming_mid_epoch_replays_the_same_batches():
    loader = _loader(_image_set(), crop_padding=2, hflip=0.5, mixup_alpha=0.4)
    full = list(loader.epoch(1))
    resumed = list(loader.epoch(1, 3))
    assert len(resumed) == len(full) - 3
    for (x, y), (rx, ry) in zip(full[3:], resumed, strict=True):
        assert torch.equal(x, rx) and torch.equal(y, ry)


def test_prefetch_yields_exactly_the_batches_of_the_plain_loop():
    data = _image_set()
    with_prefetch = list(_loader(data, prefetch=3, cutmix_alpha=1.0).epoch(0))
    without = list(_loader(data, prefetch=0, cutmix_alpha=1.0).epoch(0))
    assert len(with_prefetch) == len(without) == 5
    for (x, y), (px, py) in zip(with_prefetch, without, strict=True):
        assert torch.equal(x, px) and torch.equal(y, py)


class _FailingSet(ImageSet):
    def read(self, index):
        if 0 in index.tolist():
            raise DataError("row 0 is unreadable")
        return super().read(index)


def test_a_read_error_in_the_prefetch_thread_reaches_the_training_loop():
    data = _image_set()
    failing = _FailingSet(data.images, data.labels, data.classes)
    with pytest.raises(DataError, match="row 0 is unreadable"):
        list(_loader(failing, prefetch=2).epoch(0))


def test_stopping_early_ends_the_prefetch_thread():
    def prefetching() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "vitrain-prefetch"}

    others = prefetching()  # an earlier test's loader in this process may not be collected yet
    batches = _loader(_image_set(), prefetch=2).epoch(0)
    next(batches)
    assert prefetching() - others
    batches.close()
    assert not prefetching() - others


def test_the_sample_trace_leaves_out_the_first_batch_that_autotune_times(tmp_path, monkeypatch):
    monkeypatch.setenv(TRACE_ENV, str(tmp_path / "trace.txt"))
    loader = _loader(_image_set(), prefetch=2)
    first_batch(loader)  # autotune's race steps on it; training does not
    assert not (tmp_path / "trace.txt").exists()
    list(loader.epoch(0))
    traced = [line.split() for line in (tmp_path / "trace.txt").read_text().splitlines()]
    assert traced == [["train", *map(str, loader.order(0)[b * 8 : (b + 1) * 8].tolist())] for b in range(len(loader))]


# ---------------------------------------------------------------------------------------------- prepared reads


@pytest.mark.parametrize("way", ["pidfd", "poll"])
def test_a_worker_sees_the_training_process_end_even_while_it_is_an_unreaped_zombie(monkeypatch, way):
    # A parent reading a killed run's pipes to their end reaps it only once the workers holding them have gone:
    # the watch must count a zombie as ended, or both wait forever. The poll is the path off Linux (and macOS's
    # kqueue, not testable here).
    if way == "poll":
        monkeypatch.delattr(os, "pidfd_open", raising=False)
    elif not hasattr(os, "pidfd_open"):
        pytest.skip("os.pidfd_open needs Linux 5.3+ and Python 3.9+")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    ended = threading.Event()
    threading.Thread(target=lambda: (wait_for_end(child.pid, poll_s=0.05), ended.set()), daemon=True).start()
    assert not ended.wait(0.5)  # still running
    assert ended.wait(20)
    assert child.returncode is None  # never reaped while watched: it ended as a zombie
    assert child.wait() == 0


class _BadSample(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        raise DataError(f"sample {i} of /data/x.tar is not an image; fix the shard")


def test_an_error_raised_in_a_loader_worker_reaches_the_training_process_as_its_own_one_line():
    # torch re-raises it here with the worker's traceback as its message: many lines, where the CLI prints one.
    loader = torch.utils.data.DataLoader(_BadSample(), batch_size=2, num_workers=1, **worker_start(1))
    with pytest.raises(DataError) as raised:
        next(iter(from_workers(loader)))
    assert str(raised.value) == "sample 0 of /data/x.tar is not an image; fix the shard"


def test_prepared_reads_match_the_in_memory_decode(prepared_tree):
    src, out = prepared_tree
    cfg = _cfg("data.source=folder", f"data.root={src}")
    memory, _ = build_datasets(cfg)
    train = open_prepared(out)["train"]
    index = torch.tensor([39, 0, 13, 7, 14, 6, 21])  # crosses shard borders (7 per shard), unsorted
    images, labels = train.read(index)
    m_images, m_labels = memory.read(index)
    assert torch.equal(images, m_images) and torch.equal(labels, m_labels)


def test_a_subset_of_prepared_data_reads_its_own_rows(prepared_tree):
    train = open_prepared(prepared_tree[1])["train"]
    rows = torch.tensor([30, 2, 9])
    sub = train.subset(rows)
    images, labels = sub.read(torch.tensor([2, 0]))
    full_images, full_labels = train.read(torch.tensor([9, 30]))
    assert len(sub) == 3 and torch.equal(images, full_images) and torch.equal(labels, full_labels)
    assert torch.equal(sub.labels, train.labels[rows])


def test_folder_source_on_a_prepared_directory_uses_the_prepared_reader(prepared_tree):
    train, val = build_loaders(_cfg("data.source=folder", f"data.root={prepared_tree[1]}"), CPU)
    assert isinstance(train.data, PreparedSet) and (len(train.data), len(val.data)) == (40, 8)


def test_prepared_source_on_an_unprepared_folder_says_how_to_prepare_it(prepared_tree):
    with pytest.raises(DataError, match=r"is not prepared data .* run `vitrain data prepare"):
        build_loaders(_cfg("data.source=prepared", f"data.root={prepared_tree[0]}"), CPU)


# ---------------------------------------------------------------------------------------------- augmentation


def test_evaluation_batches_are_only_normalized():
    cfg = _cfg("data.mean=[0.5]", "data.std=[0.25]", "data.hflip=1.0", "data.mixup_alpha=1.0")
    x = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    out, targets = BatchAugment(cfg.data, 3, False, 8, 2)(x, torch.tensor([0, 1, 0, 1]))
    torch.testing.assert_close(out, (x.float() / 255 - 0.5) / 0.25)
    assert targets.tolist() == [0, 1, 0, 1]


def test_flip_with_probability_one_mirrors_every_image():
    cfg = _cfg("data.hflip=1.0", "data.mean=[0.0]", "data.std=[1.0]")
    x = torch.randint(0, 256, (3, 3, 8, 8), dtype=torch.uint8)
    out, _ = BatchAugment(cfg.data, 3, True, 8, 2)(x, torch.tensor([0, 1, 0]))
    torch.testing.assert_close(out * 255, x.flip(3).float())


def test_padded_random_crop_is_a_window_of_the_reflect_padded_image():
    x = torch.randint(0, 256, (16, 3, 8, 8), dtype=torch.uint8)
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2), mode="reflect")
    out = pad_crop_flip(x, 2, None, torch.Generator().manual_seed(0))
    offsets = set()
    for i in range(16):
        match = [
            (dy, dx)
            for dy in range(5)
            for dx in range(5)
            if torch.equal(out[i], padded[i, :, dy : dy + 8, dx : dx + 8])
        ]
        assert len(match) >= 1
        offsets.add(match[0])
    assert len(offsets) > 3  # the windows really move


def test_random_resized_crop_of_the_whole_frame_is_the_identity():
    x = torch.rand(3, 3, 8, 8)
    out = random_resized_crop(x, 8, scale=(1.0, 1.0), ratio=(1.0, 1.0), generator=torch.Generator())
    torch.testing.assert_close(out, x)


def test_random_resized_crop_samples_a_box_of_the_requested_area():
    columns = torch.arange(16.0).expand(2, 1, 16, 16).contiguous()  # pixel value = its column
    out = random_resized_crop(columns, 16, scale=(0.25, 0.25), ratio=(1.0, 1.0), generator=torch.Generator())
    span = out.amax(dim=(1, 2, 3)) - out.amin(dim=(1, 2, 3))
    assert out.shape == (2, 1, 16, 16)
    # An 8-pixel-wide box spans 7 columns between pixel centres; bilinear sampling reaches 1/4 pixel beyond.
    assert torch.all(span >= 7.0) and torch.all(span <= 7.5)


def test_stored_images_are_resized_to_the_model_input():
    cfg = _cfg()
    out, _ = BatchAugment(cfg.data, 3, True, 8, 2)(torch.zeros(2, 3, 12, 12, dtype=torch.uint8), torch.tensor([0, 1]))
    assert out.shape == (2, 3, 8, 8)


def test_mixup_blends_images_and_targets_with_the_same_weight():
    cfg = _cfg("data.mixup_alpha=0.4", "data.mean=[0.0]", "data.std=[1.0]")
    x = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    labels = torch.tensor([0, 1, 1, 1])
    out, targets = BatchAugment(cfg.data, 3, True, 8, 2)(x, labels, torch.Generator().manual_seed(5))
    lam = float(targets[0, 0])  # sample 0 (class 0) mixed with sample 3 (class 1)
    torch.testing.assert_close(targets.sum(1), torch.ones(4))
    torch.testing.assert_close(out * 255, x.float() * lam + x.flip(0).float() * (1 - lam), rtol=0, atol=1e-3)


def test_cutmix_targets_match_the_pasted_area():
    cfg = _cfg("data.cutmix_alpha=1.0", "data.mean=[0.0]", "data.std=[1.0]")
    x = torch.stack([torch.zeros(3, 8, 8, dtype=torch.uint8), torch.full((3, 8, 8), 255, dtype=torch.uint8)])
    out, targets = BatchAugment(cfg.data, 3, True, 8, 2)(x, torch.tensor([0, 1]), torch.Generator().manual_seed(2))
    pasted = float((out[0] == 1.0).float().mean())  # image 0 is black; white pixels came from image 1
    assert 0 < pasted < 1
    torch.testing.assert_close(targets[0], torch.tensor([1 - pasted, pasted]))


# ---------------------------------------------------------------------------------------------- plain path


def test_the_plain_loader_names_a_damaged_or_unknown_file_and_refuses_skip_bad(tmp_path):
    import zipfile

    from vitrain.data.plain import PlainSamples
    from vitrain.data.sources import ImageTree
    from vitrain.errors import ConfigError

    make_tree(tmp_path / "tree", {"train": 2})
    (tmp_path / "tree" / "train" / "cat" / "empty.png").write_bytes(b"")
    archive = tmp_path / "tree.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_STORED) as z:
        for path in sorted((tmp_path / "tree").rglob("*.png")):
            z.write(path, path.relative_to(tmp_path / "tree").as_posix())
    first = zipfile.ZipFile(archive).infolist()[0]
    raw = bytearray(archive.read_bytes())
    raw[first.header_offset + 30 + len(first.filename) + 20] ^= 0xFF  # one byte of its data: the CRC fails
    archive.write_bytes(bytes(raw))
    cfg = _cfg("data.source=folder", f"data.root={archive}", "data.loader=plain")
    names = ["train/cat/000.png", "train/cat/empty.png"]
    samples = PlainSamples(ImageTree(archive), names, [0, 0], ["cat"], cfg, train=False)
    with pytest.raises(DataError, match=rf"^cannot read image {archive}:train/cat/000.png: Bad CRC-32"):
        samples[0, 0]
    with pytest.raises(DataError, match=rf"^cannot decode image {archive}:train/cat/empty.png: not an image file "):
        samples[0, 1]
    with pytest.raises(ConfigError, match="^data.skip_bad=1 skips undecodable files in the fast loader"):
        build_loaders(_cfg("data.source=folder", f"data.root={tmp_path / 'tree'}", "data.loader=plain",
                           "data.skip_bad=1"), CPU)  # fmt: skip


def test_plain_loader_yields_the_same_batches_as_the_fast_path(prepared_tree):
    src, out = prepared_tree
    common = ["data.hflip=0.0", "train.batch_size=8", "data.loader_workers=1"]
    fast, _ = build_loaders(_cfg(*common, "data.source=folder", f"data.root={out}"), CPU)
    plain, _ = build_loaders(_cfg(*common, "data.source=folder", f"data.root={src}", "data.loader=plain"), CPU)
    assert len(fast) == len(plain) == 5
    for (x, y), (px, py) in zip(fast.epoch(2), plain.epoch(2), strict=True):
        torch.testing.assert_close(x, px)
        assert torch.equal(y, py)


def assert_same_batches(fast, plain, same_labels) -> None:
    """Two loaders' epochs give as many batches, at least one, with close images and `same_labels` labels."""
    pairs = list(zip(fast, plain, strict=True))
    assert pairs
    for (x, y), (px, py) in pairs:
        torch.testing.assert_close(x, px)
        same_labels(y, py)


def _assert_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(a, b)


def test_plain_loader_mixes_each_ranks_batches_as_the_fast_path_does(prepared_tree):
    # Mixup's weight and cutmix's box are drawn per batch and rank: ranks that mixed alike would add less variety.
    src, out = prepared_tree
    common = ["train.batch_size=4", "data.loader_workers=0", "data.source=folder", "data.mixup_alpha=0.4",
              "data.cutmix_alpha=1.0"]  # fmt: skip
    for rank in range(2):
        fast, _ = build_loaders(_cfg(*common, f"data.root={out}"), CPU, rank, 2)
        plain, _ = build_loaders(_cfg(*common, f"data.root={src}", "data.loader=plain"), CPU, rank, 2)
        assert_same_batches(fast.epoch(1), plain.epoch(1), torch.testing.assert_close)  # mixed labels are floats


def test_plain_loader_shards_validation_like_the_fast_path(prepared_tree):
    src, out = prepared_tree
    common = ["train.batch_size=3", "data.loader_workers=1", "data.source=folder"]
    for rank in range(3):
        _, fast = build_loaders(_cfg(*common, f"data.root={out}"), CPU, rank, 3)
        _, plain = build_loaders(_cfg(*common, f"data.root={src}", "data.loader=plain"), CPU, rank, 3)
        assert_same_batches(fast.epoch(0), plain.epoch(0), _assert_equal)


def test_plain_loader_applies_the_configured_augmentations(prepared_tree):
    cfg = _cfg(
        "data.source=folder",
        f"data.root={prepared_tree[0]}",
        "data.loader=plain",
        "data.loader_workers=0",
        "data.random_resized_crop=true",
        "data.hflip=0.5",
        "data.mixup_alpha=0.4",
        "train.batch_size=8",
    )
    plain, _ = build_loaders(cfg, CPU)
    x, targets = next(plain.epoch(0))
    assert x.shape == (8, 3, 8, 8) and targets.shape == (8, 2)
    torch.testing.assert_close(targets.sum(1), torch.ones(8))


# ---------------------------------------------------------------------------------------------- data wait


def _train(tmp_path, prepared: Path, *overrides: str) -> tuple[dict, list[dict]]:
    cfg = _cfg(
        "data.source=prepared",
        f"data.root={prepared}",
        f"log.out_dir={tmp_path}",
        "train.batch_size=8",
        "train.max_steps=4",
        "log.every_steps=1",
        *overrides,
    )
    summary = Trainer(cfg).fit()
    records = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, [r for r in records if "loss" in r]


def test_trainer_runs_on_the_plain_loader(tmp_path, prepared_tree):
    cfg = _cfg(
        "data.source=folder",
        f"data.root={prepared_tree[0]}",
        "data.loader=plain",
        "data.loader_workers=0",
        f"log.out_dir={tmp_path}",
        "train.batch_size=8",
        "train.max_steps=2",
    )
    summary = Trainer(cfg).fit()
    assert summary["steps"] == 2 and 0 <= summary["val_top1"] <= 1 and "data_wait_frac" in summary


def test_data_wait_is_reported_per_step_and_in_the_summary(tmp_path, prepared_tree):
    summary, steps = _train(tmp_path, prepared_tree[1])
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["data_wait_s"] >= 0 and 0 <= r["data_wait_frac"] <= 1 for r in steps)
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert 0 <= saved["data_wait_frac"] <= 1 and saved["data_wait_s"] == summary["data_wait_s"]


def test_data_wait_measures_time_blocked_on_a_slow_loader(tmp_path, prepared_tree, monkeypatch):
    original = PreparedSet.read

    def slow_read(self, index):
        time.sleep(0.2)
        return original(self, index)

    monkeypatch.setattr(PreparedSet, "read", slow_read)
    summary, steps = _train(tmp_path, prepared_tree[1], "data.prefetch=0")
    assert all(r["data_wait_s"] >= 0.19 for r in steps)
    assert summary["data_wait_s"] >= 3 * 0.19  # steps 2-4 are timed (step 1 is warm-up)
    timed_s = 3 * 8 / summary["images_per_s"]  # the timed steps' wall time
    assert summary["data_wait_frac"] == pytest.approx(summary["data_wait_s"] / timed_s)


def test_loader_benchmark_reports_both_paths_per_round(prepared_tree):
    from vitrain.bench.loader import bench_loader

    src, out = prepared_tree
    result = bench_loader(str(out), str(src), ["train.batch_size=4", "data.loader_workers=0"], 2, 1, rounds=2)
    assert len(result["fast_images_per_s_rounds"]) == len(result["plain_images_per_s_rounds"]) == 2
    assert min(result["fast_images_per_s_rounds"] + result["plain_images_per_s_rounds"]) > 0
    assert result["speedup"] == pytest.approx(result["fast_images_per_s"] / result["plain_images_per_s"])


# A script that runs torch on several threads, then decodes a dataset with data.decode_workers=2 (a second
# vitrain.train in one process does this: video, detection, face packs).
AFTER_THREADS = """
import sys
import torch
import torch.nn.functional as F
from vitrain.data.sources import decode_pool

def resize(seed):
    x = torch.randn(16, 3, 120, 160, generator=torch.Generator().manual_seed(seed))
    return F.interpolate(x, size=(64, 80), mode="bilinear", antialias=True).shape[0]

if __name__ == "__main__":
    torch.set_num_threads(2)
    resize(0)  # the parent's OpenMP pool has run
    with decode_pool(2) as pool:
        print(sum(pool.map(resize, range(8))))
"""


def test_decode_workers_forked_after_torch_ran_on_several_threads_finish(tmp_path):
    # The workers are forked: one forked from a process whose OpenMP pool had run hung in its first parallel op
    # (F.interpolate, as video decoding resizes frames), and the run with it, for good. They now run one thread each.
    script = tmp_path / "after_threads.py"
    script.write_text(AFTER_THREADS)
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, _ = child.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # the hung workers with it
        child.communicate()
        pytest.fail("the decode workers hung")
    assert child.returncode == 0 and out.split() == ["128"]
