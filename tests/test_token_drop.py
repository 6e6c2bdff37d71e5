"""Token dropping (train.token_drop): which tokens each image keeps, how the model uses them, and what the run does."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from tests.conftest import TINY_MODEL, run_cli, tiny_overrides
from tests.distributed_helpers import losses, tiny_config, whole_and_resumed
from vitrain.bench.step import bench_step
from vitrain.config import load_config
from vitrain.engine import Trainer
from vitrain.engine.token_drop import TokenDrop
from vitrain.errors import ConfigError
from vitrain.models import VisionTransformer, complexity

IMAGES = torch.randn(3, 1, 16, 16)  # TINY_MODEL's 16 px grey images: 16 patch tokens each


@pytest.mark.parametrize("pool, layout", [("cls", "batch_first"), ("gap", "batch_first"), ("cls", "seq_first")])
def test_the_model_keeps_exactly_the_chosen_patch_tokens_with_their_own_positions(pool, layout):
    model = VisionTransformer(dataclasses.replace(TINY_MODEL, pool=pool, layout=layout))
    keep = torch.tensor([[0, 5, 6, 15], [1, 2, 3, 4], [12, 13, 14, 15]])
    batch_dim = 1 if layout == "seq_first" else 0
    every, kept = model.embed(IMAGES).movedim(batch_dim, 0), model.embed(IMAGES, keep).movedim(batch_dim, 0)
    prefix = model.num_prefix_tokens
    assert kept.shape == (3, prefix + 4, TINY_MODEL.width)
    for image in range(3):
        rows = list(range(prefix)) + [prefix + int(i) for i in keep[image]]
        torch.testing.assert_close(kept[image], every[image, rows], rtol=0, atol=0)
    assert model(IMAGES, keep).shape == (3, TINY_MODEL.num_classes)


def test_each_image_keeps_its_own_random_half_drawn_from_seed_rank_and_step():
    drop = TokenDrop(0.5, until=1.0, patch_size=4, seed=0, rank=0)
    keep = drop.keep(IMAGES, step=3, progress=0.1)
    assert keep.shape == (3, 8) and keep.dtype == torch.int64
    for row in keep:  # eight distinct patches in raster order
        assert row.tolist() == sorted(set(row.tolist())) and 0 <= row.min() and row.max() < 16
    assert len({tuple(row.tolist()) for row in keep}) == 3  # each image its own subset
    assert torch.equal(keep, drop.keep(IMAGES, step=3, progress=0.7))  # the same step draws the same, anywhere
    others = [
        drop.keep(IMAGES, step=4, progress=0.1),
        drop.keep(IMAGES, step=3, progress=0.1, micro_batch=1),
        TokenDrop(0.5, 1.0, 4, seed=0, rank=1).keep(IMAGES, 3, 0.1),
        TokenDrop(0.5, 1.0, 4, seed=1, rank=0).keep(IMAGES, 3, 0.1),
    ]
    assert all(not torch.equal(keep, other) for other in others)
    assert TokenDrop(0.75, 1.0, 4, 0, 0).keep(IMAGES, 0, 0.0).shape == (3, 4)
    assert TokenDrop(0.5, 1.0, 4, 0, 0).keep(IMAGES[..., :8, :8], 0, 0.0).shape == (3, 2)  # data.min_size's grid


def test_the_unmasked_finish_starts_at_token_drop_until():
    drop = TokenDrop(0.5, until=0.9, patch_size=4, seed=0, rank=0)
    assert drop.keep(IMAGES, step=89, progress=0.89) is not None
    assert drop.keep(IMAGES, step=90, progress=0.9) is None


def test_the_cost_counts_only_the_kept_tokens():
    full = complexity(TINY_MODEL)
    assert complexity(TINY_MODEL, kept_patches=16) == full
    half = complexity(TINY_MODEL, kept_patches=8)
    assert half.params == full.params and half.flops < 0.6 * full.flops


def test_a_run_draws_per_step_and_trains_on_every_token_after_until(tmp_path, monkeypatch):
    seen = []
    real = TokenDrop.keep

    def spy(self, images, step, progress, micro_batch=0):
        keep = real(self, images, step, progress, micro_batch)
        seen.append((step, None if keep is None else keep.shape[1]))
        return keep

    monkeypatch.setattr(TokenDrop, "keep", spy)
    cfg = tiny_config(tmp_path, "drop", train={"token_drop": 0.5, "token_drop_until": 0.6, "max_steps": 0})
    Trainer(cfg).fit()  # 3 steps/epoch x 3 epochs: steps 0-5 before 60% of the schedule, 6-8 after
    assert seen == [(step, 2 if step < 6 else None) for step in range(9)]  # 8x8 images: 2 of their 4 patches
    log = (cfg.run_dir / "log.txt").read_text()
    assert "token drop: each training image keeps 2 of its 4 patch tokens" in log


def test_a_resumed_run_draws_the_tokens_the_uninterrupted_run_drew(tmp_path):
    ten = {"epochs": 4, "max_steps": 10, "checkpoint_every_steps": 5, "token_drop": 0.5}
    whole, part, _ = whole_and_resumed(tmp_path, ten, stop_at=5)
    expected, got = losses(whole.run_dir), losses(part.run_dir)
    assert [got[s] for s in range(6, 11)] == [expected[s] for s in range(6, 11)]  # exactly


@pytest.mark.parametrize("mode", ["amp_o1", "amp_o2", "pure"])
def test_low_precision_policies_hand_the_kept_tokens_through(tmp_path, mode):
    cfg = tiny_config(tmp_path, mode, train={"token_drop": 0.5, "max_steps": 2}, precision={"mode": mode})
    summary = Trainer(cfg).fit()
    assert summary["steps"] == 2 and all(torch.isfinite(torch.tensor(list(losses(cfg.run_dir).values()))))


def test_bench_reports_the_flops_of_the_kept_tokens(tmp_path):
    base = tiny_overrides(tmp_path, "train.batch_size=8")
    every = bench_step(load_config(None, base), steps=1, warmup=0)
    dropped = bench_step(load_config(None, [*base, "train.token_drop=0.5"]), steps=1, warmup=0)
    assert dropped["token_drop"] == 0.5 and every["token_drop"] == 0.0
    assert dropped["train_gflops_per_image"] < 0.6 * every["train_gflops_per_image"]


# slow: 13 s on a Zen 4; token dropping trains and resumes in the default suite
@pytest.mark.slow
def test_the_digits_recipe_trains_with_token_drop_from_the_cli(tmp_path):
    done = run_cli(
        "train", "digits", "train.epochs=3", "train.token_drop=0.5", "train.token_drop_until=0.8",
        f"log.out_dir={tmp_path}", "log.progress=false", "precision.mode=fp32",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "digits" / "summary.json").read_text())
    assert summary["steps"] == 66 and summary["val_top1"] > 0.2  # ten classes: well above chance after 3 epochs
    assert (
        "keeps 8 of its 16 patch tokens (train.token_drop=0.5), drawn per image and step, until 80%"
        in (tmp_path / "digits" / "log.txt").read_text()
    )


@pytest.mark.parametrize(
    "overrides, line",
    [
        (["train.token_drop=1.0"], "train.token_drop=1.0 is the fraction of patch tokens dropped and must be in [0, 1"),
        (["train.token_drop=-0.1"], "train.token_drop=-0.1 is the fraction of patch tokens dropped and must be in"),
        (["train.token_drop_until=1.5"], "train.token_drop_until=1.5 is a fraction of the schedule"),
        (["train.token_drop=0.5", "model.pool=flatten"], "model.pool=flatten: the head reads every patch token"),
        (["train.token_drop=0.5", "parallel.pipeline_stages=2", "parallel.strategy=ddp"], "parallel.pipeline_stages=2"),
        (["train.token_drop=0.5", "model.name=timm:vit_tiny_patch16_224"], "needs vitrain's ViT"),
    ],
)
def test_bad_token_drop_settings_are_refused_in_one_line(tmp_path, overrides, line):
    with pytest.raises(ConfigError, match=re.escape(line)):
        load_config(None, tiny_overrides(tmp_path, *overrides))


def test_the_cli_refuses_token_drop_of_one_with_exit_2(tmp_path):
    done = run_cli("train", "digits", "train.token_drop=1", f"log.out_dir={tmp_path}")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "vitrain: error: train.token_drop=1.0 is the fraction of patch tokens dropped and must be in [0, 1), e.g. 0.5 "
        "(0 turns it off)"
    )
