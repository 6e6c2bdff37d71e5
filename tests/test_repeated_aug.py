"""Repeated augmentation (data.repeated_aug): the epoch's sequence, how ranks share it, resuming it, its refusals."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from tests.conftest import TINY
from tests.data_helpers import TREE_MODEL, write_shards
from vitrain.config import load_config, to_yaml
from vitrain.data import BatchAugment, BatchLoader, ImageSet, build_loaders
from vitrain.data.loader import Position, epoch_order, epoch_sequence, resume_order
from vitrain.engine.runs import resumed_config
from vitrain.errors import CheckpointError, ConfigError


def test_each_image_comes_k_times_in_a_row_and_the_epoch_keeps_its_length():
    plain = epoch_sequence(10, epoch=2, seed=1, shuffle=True)
    repeated = epoch_sequence(10, epoch=2, seed=1, shuffle=True, repeats=3)
    assert len(repeated) == 10
    assert repeated.tolist() == [int(i) for i in plain[:4] for _ in range(3)][:10]


def test_the_unshuffled_validation_order_is_not_repeated():
    assert torch.equal(epoch_sequence(7, 0, 0, shuffle=False, repeats=3), torch.arange(7))


@pytest.mark.parametrize("world_size", [3, 4])
def test_the_copies_of_an_image_land_on_different_ranks(world_size):
    holders = defaultdict(list)
    for rank in range(world_size):
        for i in epoch_order(120, 0, 5, True, rank, world_size, repeats=3).tolist():
            holders[i].append(rank)
    assert len(holders) == 40
    assert all(len(set(ranks)) == len(ranks) == 3 for ranks in holders.values())


def test_on_fewer_ranks_than_copies_a_rank_gets_an_image_more_than_once():
    holders = defaultdict(list)
    for rank in range(2):
        for i in epoch_order(60, 0, 5, True, rank, 2, repeats=3).tolist():
            holders[i].append(rank)
    assert all(sorted(set(ranks)) == [0, 1] and len(ranks) == 3 for ranks in holders.values())


def test_a_resume_on_another_world_size_consumes_the_rest_of_the_repeated_sequence():
    n, batch, seed = 96, 4, 3
    sequence = epoch_sequence(n, 1, seed, True, repeats=3)
    # Two ranks ran 5 batches each: the first 40 positions of the sequence, whatever their ranks held.
    before = [resume_order(n, 1, seed, True, r, 2, batch, True, None, 3)[0][: 5 * batch] for r in range(2)]
    assert sorted(torch.cat(before).tolist()) == sorted(sequence[:40].tolist())
    at = Position(epoch=1, samples=5 * batch * 2)
    after = [resume_order(n, 1, seed, True, r, 3, batch, True, at, 3) for r in range(3)]
    rest = torch.cat([index[: count * batch] for index, _, count in after])
    # 56 positions left; 3 ranks take 4 whole batches each, the next 48 positions of the same sequence.
    assert sorted(rest.tolist()) == sorted(sequence[40:88].tolist())


def _loader(repeats: int) -> BatchLoader:
    n = 48
    images = torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    cfg = load_config(overrides=[*TREE_MODEL, "data.randaugment=rand-p1-m9-mstd0.5-inc1", "data.random_erasing=0.25"])
    augment = BatchAugment(cfg.data, 3, True, 8, n)
    return BatchLoader(ImageSet(images, torch.arange(n), ["x"]), 12, augment, torch.device("cpu"), True, 4,
                       repeats=repeats)  # fmt: skip


def test_the_copies_in_a_batch_are_augmented_each_its_own_way():
    images, labels = next(iter(_loader(repeats=3).epoch(0)))
    assert labels.tolist() == [int(i) for i in labels[::3] for _ in range(3)]  # 4 images, 3 copies each
    for k in range(0, 12, 3):
        assert not torch.equal(images[k], images[k + 1]) and not torch.equal(images[k + 1], images[k + 2])


def test_resuming_mid_epoch_with_repeats_and_strong_augmentation_replays_the_same_batches():
    loader = _loader(repeats=3)
    full = list(loader.epoch(1))
    resumed = list(loader.epoch(1, loader.position(1, None, 2)))
    assert len(resumed) == len(full) - 2
    for (x, y), (rx, ry) in zip(full[2:], resumed, strict=True):
        assert torch.equal(x, rx) and torch.equal(y, ry)


def test_streamed_shards_refuse_repeats_naming_the_fix(tmp_path):
    write_shards(tmp_path / "shards", [5, 4])
    cfg = load_config(None, [*TINY, *TREE_MODEL, "data.source=shards", f"data.root={tmp_path / 'shards'}",
                             "data.repeated_aug=3"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"data.repeated_aug=3 repeats images by index .* set data.repeated_aug=1"):
        build_loaders(cfg, torch.device("cpu"))


def test_a_resume_cannot_change_the_repeats_of_the_data_order(tmp_path):
    cfg = load_config(None, [*TINY, f"log.out_dir={tmp_path}"])
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "config.yaml").write_text(to_yaml(cfg))
    with pytest.raises(CheckpointError, match=r"--resume: data.repeated_aug=3 differs from the run's 1"):
        resumed_config(cfg, True, ["data.repeated_aug=3"])
