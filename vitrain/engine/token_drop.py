"""Token dropping (train.token_drop): the patch tokens each training image keeps, drawn reproducibly by the step.

    drop = TokenDrop.from_config(cfg, rank)                 # None where train.token_drop=0
    keep = drop.keep(images, step, progress, micro_batch)   # (B, K) patch indices, or None: every token

Each image keeps a uniformly random subset of its patch tokens (PatchDropout, Liu et al. 2022; FLIP's random
masking, Li et al. 2023); the model gathers them after adding the positions and puts the class (and distillation)
token in front (vitrain/models/vit.py). The blocks then compute on K + 1 tokens instead of all of them: the step's
cost falls about in proportion (the patch embedding, the head and the optimizer step stay whole).

The draws come from a generator seeded by (train.seed, rank, step, micro-batch), not from the global random state: a
run resumed at step s draws what the uninterrupted run drew at step s, on any machine, and dropout or augmentation
settings do not shift them.
"""

from __future__ import annotations

import torch

from vitrain.config import Config
from vitrain.errors import ConfigError


class TokenDrop:
    """Which patch tokens each image keeps: `1 - fraction` of them, at random, until `until` of the schedule."""

    def __init__(self, fraction: float, until: float, patch_size: int, seed: int, rank: int):
        self.fraction, self.until, self.patch_size = fraction, until, patch_size
        self.seed, self.rank = seed, rank

    @classmethod
    def from_config(cls, cfg: Config, rank: int) -> TokenDrop | None:
        t = cfg.train
        return cls(t.token_drop, t.token_drop_until, cfg.model.patch_size, t.seed, rank) if t.token_drop else None

    def kept_patches(self, patches: int) -> int:
        """How many of an image's `patches` tokens it keeps (at least one)."""
        return max(1, round((1.0 - self.fraction) * patches))

    def describe(self, patches: int) -> str:
        """The log's line: what is dropped, until when."""
        until = f"until {self.until:.0%} of the schedule, then every token" if self.until < 1 else "to the end"
        return (
            f"token drop: each training image keeps {self.kept_patches(patches)} of its {patches} patch tokens "
            f"(train.token_drop={self.fraction:g}), drawn per image and step, {until}"
        )

    def keep(self, images: torch.Tensor, step: int, progress: float, micro_batch: int = 0) -> torch.Tensor | None:
        """The kept patch indices of each image of `images` (B, C, H, W) at optimizer step `step` (0-based),
        `progress` (0-1) into the schedule: (B, K) in raster order on the images' device; None once progress has
        reached train.token_drop_until (the unmasked finish)."""
        if progress >= self.until:
            return None
        patches = (images.shape[-2] // self.patch_size) * (images.shape[-1] // self.patch_size)
        # Tuples of ints hash the same in every process (PYTHONHASHSEED randomizes only str and bytes).
        generator = torch.Generator().manual_seed(hash((self.seed, self.rank, step, micro_batch)) & (2**63 - 1))
        scores = torch.rand(images.shape[0], patches, generator=generator)
        keep = scores.argsort(dim=1)[:, : self.kept_patches(patches)].sort(dim=1).values
        return keep.to(images.device, non_blocking=True)


def check(cfg: Config) -> None:
    """train.token_drop and what it needs of the model and the parallel strategy: one line naming the fix."""
    t, m = cfg.train, cfg.model
    if not 0.0 <= t.token_drop < 1.0:
        raise ConfigError(
            f"train.token_drop={t.token_drop} is the fraction of patch tokens dropped and must be in [0, 1), e.g. 0.5 "
            "(0 turns it off)"
        )
    if not 0.0 <= t.token_drop_until <= 1.0:
        raise ConfigError(
            f"train.token_drop_until={t.token_drop_until} is a fraction of the schedule and must be in [0, 1], e.g. "
            "0.9 (1: drop until the end)"
        )
    if not t.token_drop:
        return
    if m.name != "vit":
        raise ConfigError(
            f"train.token_drop={t.token_drop} needs vitrain's ViT (its forward takes the kept tokens); model.name="
            f"{m.name} is not it: set train.token_drop=0"
        )
    if m.pool == "flatten":
        raise ConfigError(
            f"train.token_drop={t.token_drop} with model.pool=flatten: the head reads every patch token; use "
            "model.pool=cls or gap, or train.token_drop=0"
        )
    if cfg.parallel.pipeline_stages > 1:
        raise ConfigError(
            f"train.token_drop={t.token_drop} with parallel.pipeline_stages={cfg.parallel.pipeline_stages}: the "
            "stages exchange activations of one fixed token count; set parallel.pipeline_stages=1 or "
            "train.token_drop=0"
        )
