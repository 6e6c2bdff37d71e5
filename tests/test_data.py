"""Data sources, on-device augmentation and the seeded, resumable batch order."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_overrides
from tests.data_helpers import make_tree, zip_tree
from vitrain.config import load_config
from vitrain.data import BatchAugment, BatchLoader, ImageSet, build_datasets
from vitrain.errors import DataError


def folder_cfg(tmp_path: Path, root: Path, *extra: str):
    return load_config(
        None,
        tiny_overrides(
            tmp_path, "data.source=folder", f"data.root={root}", "model.in_chans=3", "model.num_classes=2",
            "model.image_size=8", "data.decode_workers=1", *extra,
        ),
    )  # fmt: skip


def test_digits_split_is_held_out_and_stratified(tiny_cfg):
    train, val = build_datasets(tiny_cfg)
    assert (len(train), len(val)) == (1437, 360)
    assert train.images.dtype == torch.uint8 and train.images.shape[1:] == (1, 16, 16)
    assert set(val.labels.tolist()) == set(range(10))
    train_rows = {bytes(x.numpy()) for x in train.images}
    assert sum(bytes(x.numpy()) in train_rows for x in val.images) < 5  # digits has a few exact duplicates


def test_folder_tree_decodes_every_image_with_class_labels(tmp_path):
    root = tmp_path / "data"
    pixels = make_tree(root, {"train": 3, "test": 3})
    train, val = build_datasets(folder_cfg(tmp_path, root))
    assert train.classes == ["cat", "dog"]
    assert (len(train), len(val)) == (6, 6)
    assert torch.equal(train.images[4], torch.from_numpy(pixels["train/dog/001.png"]))
    assert train.labels.tolist() == [0, 0, 0, 1, 1, 1]


def test_zip_with_top_folder_reads_like_the_tree(tmp_path):
    root = tmp_path / "tree"
    make_tree(root, {"train": 3, "test": 3})
    archive = zip_tree(root, tmp_path / "data.zip", top="top")
    from_zip, _ = build_datasets(folder_cfg(tmp_path, archive))
    from_tree, _ = build_datasets(folder_cfg(tmp_path, root))
    assert torch.equal(from_zip.images, from_tree.images)


def test_a_truncated_zip_is_one_line_saying_to_copy_it_again(tmp_path):
    root = tmp_path / "tree"
    make_tree(root, {"train": 3, "test": 3})
    archive = zip_tree(root, tmp_path / "data.zip")
    archive.write_bytes(archive.read_bytes()[:-100])  # an interrupted download: the central directory is gone
    with pytest.raises(DataError) as error:
        build_datasets(folder_cfg(tmp_path, archive))
    message = str(error.value)
    assert "\n" not in message and f"data.root={archive} is not a readable zip file" in message
    assert "cut short" in message and "copy or download it again" in message
    assert f"python -m zipfile -t {archive}" in message


def test_a_folder_named_like_a_zip_reads_as_a_folder(tmp_path):
    root = tmp_path / "data.zip"  # a folder that an unpacker named after its archive
    make_tree(root, {"train": 3, "test": 3})
    train, val = build_datasets(folder_cfg(tmp_path, root))
    assert (len(train), len(val)) == (6, 6)


def test_missing_val_split_holds_out_a_fraction(tmp_path):
    root = tmp_path / "data"
    make_tree(root, {"train": 10})
    train, val = build_datasets(folder_cfg(tmp_path, root, "data.val_fraction=0.25"))
    assert (len(train), len(val)) == (15, 5)


def test_missing_root_is_an_error_naming_it(tmp_path):
    with pytest.raises(DataError, match=r"data\.root=.*nowhere does not exist"):
        build_datasets(folder_cfg(tmp_path, tmp_path / "nowhere"))


def test_empty_root_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty is empty"):
        build_datasets(folder_cfg(tmp_path, tmp_path / "empty"))


def test_missing_train_split_is_an_error(tmp_path):
    root = tmp_path / "data"
    make_tree(root, {"valid": 3})
    with pytest.raises(DataError, match=r"has no 'train' folder"):
        build_datasets(folder_cfg(tmp_path, root))


def test_empty_class_folder_is_an_error_naming_it(tmp_path):
    root = tmp_path / "data"
    make_tree(root, {"train": 3, "test": 3})
    (root / "train" / "emu").mkdir()
    with pytest.raises(DataError, match=r"class folder .*train/emu is empty"):
        build_datasets(folder_cfg(tmp_path, root))


def test_image_that_does_not_decode_is_an_error_naming_the_file(tmp_path):
    root = tmp_path / "data"
    make_tree(root, {"train": 3, "test": 3})
    (root / "train" / "cat" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    with pytest.raises(DataError, match=r"cannot decode image .*train/cat/broken\.jpg"):
        build_datasets(folder_cfg(tmp_path, root))


def test_channel_mismatch_names_the_fix(tmp_path):
    root = tmp_path / "data"
    make_tree(root, {"train": 3, "test": 3})
    cfg = folder_cfg(tmp_path, root)
    cfg.model.num_classes = 3
    with pytest.raises(DataError, match=r"set model\.num_classes=2"):
        build_datasets(cfg)


def test_augment_is_deterministic_per_generator_and_normalizes(tiny_cfg):
    images = torch.randint(0, 256, (8, 1, 16, 16), dtype=torch.uint8)
    cfg = tiny_cfg.data
    cfg.crop_padding, cfg.hflip = 2, 0.5
    labels = torch.arange(8)
    train_aug = BatchAugment(cfg, channels=1, train=True, image_size=16, num_classes=10)
    a, _ = train_aug(images, labels, torch.Generator().manual_seed(3))
    b, _ = train_aug(images, labels, torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.shape == (8, 1, 16, 16)
    plain, _ = BatchAugment(cfg, channels=1, train=False, image_size=16, num_classes=10)(images, labels)
    torch.testing.assert_close(plain, (images.float() / 255 - 0.5) / 0.5)


def test_crop_shifts_content_within_padding(tiny_cfg):
    cfg = tiny_cfg.data
    cfg.crop_padding = 2
    images = torch.zeros(64, 1, 16, 16, dtype=torch.uint8)
    images[:, :, 7, 7] = 255
    augment = BatchAugment(cfg, channels=1, train=True, image_size=16, num_classes=10)
    out, _ = augment(images, torch.zeros(64, dtype=torch.long), torch.Generator().manual_seed(0))
    peaks = (out[:, 0] == out[:, 0].amax(dim=(1, 2), keepdim=True)).nonzero()[:, 1:]
    assert peaks.min() >= 5 and peaks.max() <= 9 and len(set(map(tuple, peaks.tolist()))) > 5


def loader(n=100, batch=10, **kw) -> BatchLoader:
    data = ImageSet(torch.arange(n, dtype=torch.uint8).view(n, 1, 1, 1), torch.arange(n), ["x"])
    aug = BatchAugment(load_config().data, channels=1, train=False, image_size=1, num_classes=n)
    return BatchLoader(data, batch, aug, torch.device("cpu"), shuffle=True, seed=7, **kw)


def test_order_depends_only_on_seed_and_epoch():
    assert torch.equal(loader().order(3), loader().order(3))
    assert not torch.equal(loader().order(3), loader().order(4))


def test_resume_mid_epoch_replays_the_same_batches():
    full = [y.tolist() for _, y in loader().epoch(2)]
    resumed = [y.tolist() for _, y in loader().epoch(2, 4)]
    assert resumed == full[4:]


def test_ranks_get_disjoint_shares():
    shares = [set(loader(rank=r, world_size=3).order(0).tolist()) for r in range(3)]
    assert sum(len(s) for s in shares) == 99 and len(set.union(*shares)) == 99
