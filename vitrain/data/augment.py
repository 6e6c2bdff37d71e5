"""Augmentation and normalization on whole uint8 batches, on the training device.

Order: random resized crop (or random crop after padding), horizontal flip, resize to the model's input size
when the stored size differs, strong augmentation (RandAugment, TrivialAugment or 3-Augment, colour jitter) and random
erasing (vitrain/data/strong.py), mixup or cutmix (labels become soft targets), normalization last.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from vitrain.config import DataConfig
from vitrain.data.strong import RandomErasing, strong_augment


class BatchAugment:
    """Batched augmentation with no per-sample Python: `augment(images, labels, gen) -> (inputs, targets)`.

    Targets are the integer labels, or (B, num_classes) probabilities when mixup or cutmix is on; both work
    with `F.cross_entropy`.
    """

    def __init__(self, cfg: DataConfig, channels: int, train: bool, image_size: int, num_classes: int, frames: int = 1):
        self.image_size = image_size
        self.num_classes = num_classes
        self.random_resized_crop = cfg.random_resized_crop and train
        self.rrc_scale, self.rrc_ratio = cfg.rrc_scale, cfg.rrc_ratio
        self.crop_padding = cfg.crop_padding if train and not cfg.random_resized_crop else 0
        self.hflip = cfg.hflip if train else 0.0
        self.mixup_alpha = cfg.mixup_alpha if train else 0.0
        self.cutmix_alpha = cfg.cutmix_alpha if train else 0.0
        self.cutmix_prob = cfg.cutmix_prob
        mean = torch.tensor(_per_channel(cfg.mean, channels)).view(1, channels, 1, 1) * 255.0
        std = torch.tensor(_per_channel(cfg.std, channels)).view(1, channels, 1, 1) * 255.0
        # Strong ops fill what they uncover with the mean (0 once normalized), as timm does; erasing's noise is
        # N(0, 1) once normalized.
        self.strong = strong_augment(cfg, mean.flatten()) if train else None
        self.erasing = RandomErasing(cfg.random_erasing, mean, std) if train and cfg.random_erasing else None
        # (x - mean) / std as one fused x * scale + shift, which also reads uint8 without a float copy first.
        self.scale, self.shift = 1.0 / std, -mean / std
        # Clips arrive as (B, T*C, H, W): crops and flips move all T frames alike; each frame normalized per channel.
        self.scale, self.shift = self.scale.repeat(1, frames, 1, 1), self.shift.repeat(1, frames, 1, 1)

    def __call__(
        self, images: torch.Tensor, labels: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b = images.shape[0]
        flip = torch.rand(b, generator=generator) < self.hflip if self.hflip else None
        if self.random_resized_crop:
            x = random_resized_crop(images.float(), self.image_size, self.rrc_scale, self.rrc_ratio, generator, flip)
        else:
            # Crop and flip move uint8 pixels: a quarter of the bytes of float32.
            x = pad_crop_flip(images, self.crop_padding, flip, generator)
        if x.shape[-2:] != (self.image_size, self.image_size):
            x = F.interpolate(x.float(), size=(self.image_size, self.image_size), mode="bilinear", antialias=True)
        if self.strong is not None:
            x = self.strong(x.float(), generator)
        if self.erasing is not None:
            x = self.erasing(x.float(), generator)
        targets = labels
        if self.mixup_alpha or self.cutmix_alpha:
            x, targets = self.mix(x.float(), labels, generator)
        return torch.addcmul(self.shift.to(x.device), x, self.scale.to(x.device)), targets

    def mix(
        self, x: torch.Tensor, labels: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mixup or cutmix of the batch with its reverse; one weight per batch, as in timm."""
        # torch has no Beta sampler that takes a generator: draw a seed from it for numpy.
        rng = np.random.default_rng(int(torch.randint(0, 2**62, (1,), generator=generator)))
        use_cutmix = self.cutmix_alpha > 0 and (self.mixup_alpha == 0 or rng.random() < self.cutmix_prob)
        one_hot = F.one_hot(labels, self.num_classes).float()
        if use_cutmix:
            lam = float(rng.beta(self.cutmix_alpha, self.cutmix_alpha))
            h, w = x.shape[-2:]
            cut_h, cut_w = int(h * math.sqrt(1 - lam)), int(w * math.sqrt(1 - lam))
            cy, cx = int(rng.integers(h)), int(rng.integers(w))
            y0, y1 = max(cy - cut_h // 2, 0), min(cy + cut_h // 2, h)
            x0, x1 = max(cx - cut_w // 2, 0), min(cx + cut_w // 2, w)
            x = x.clone()
            x[:, :, y0:y1, x0:x1] = x.flip(0)[:, :, y0:y1, x0:x1]
            lam = 1.0 - (y1 - y0) * (x1 - x0) / (h * w)  # the area actually pasted
        else:
            lam = float(rng.beta(self.mixup_alpha, self.mixup_alpha))
            x = torch.lerp(x.flip(0), x, lam)  # lam * x + (1 - lam) * reversed batch, in one pass
        return x, one_hot * lam + one_hot.flip(0) * (1.0 - lam)


def pad_crop_flip(
    x: torch.Tensor, padding: int, flip: torch.Tensor | None, generator: torch.Generator | None
) -> torch.Tensor:
    """Random crop after padding by `padding` (reflect when it fits) and optional flips, as one gather."""
    if not padding and flip is None:
        return x
    b, _, h, w = x.shape
    p = padding
    if p:
        x = F.pad(x, (p, p, p, p), mode="reflect" if p < min(h, w) else "constant")
    c, padded_w = x.shape[1], x.shape[3]
    dy = torch.randint(0, 2 * p + 1, (b,), generator=generator).to(x.device)
    dx = torch.randint(0, 2 * p + 1, (b,), generator=generator).to(x.device)
    cols = torch.arange(w, device=x.device).expand(b, w)
    if flip is not None:
        cols = torch.where(flip.to(x.device)[:, None], cols.flip(1), cols)
    rows = dy[:, None, None] + torch.arange(h, device=x.device)[None, :, None]  # (B, H, 1)
    flat = (rows * padded_w + (dx[:, None] + cols)[:, None, :]).view(b, 1, h * w)  # (B, 1, H*W)
    return x.flatten(2).gather(2, flat.expand(b, c, h * w)).view(b, c, h, w)


def random_resized_crop(
    x: torch.Tensor,
    size: int,
    scale: tuple[float, float],
    ratio: tuple[float, float],
    generator: torch.Generator | None,
    flip: torch.Tensor | None = None,
    attempts: int = 10,
) -> torch.Tensor:
    """torchvision's RandomResizedCrop for a whole batch: one box per image, bilinear resampling to size x size.

    Each image tries `attempts` boxes (area fraction ~ U(scale), log aspect ~ U(log ratio)) and takes the
    first that fits; an image with none that fits keeps its whole frame. Resampling is separable, so it runs
    as two batched matmuls with per-image interpolation matrices (flips are reversed rows of the matrix).
    """
    b, _, h, w = x.shape
    area = h * w * torch.empty(b, attempts).uniform_(scale[0], scale[1], generator=generator)
    log_ratio = torch.empty(b, attempts).uniform_(math.log(ratio[0]), math.log(ratio[1]), generator=generator)
    aspect = log_ratio.exp()
    box_w = (area * aspect).sqrt().round()
    box_h = (area / aspect).sqrt().round()
    fits = (box_w <= w) & (box_h <= h) & (box_w > 0) & (box_h > 0)
    first = fits.float().argmax(1)  # first attempt that fits (0 when none does; replaced below)
    box_w = box_w.gather(1, first[:, None]).squeeze(1)
    box_h = box_h.gather(1, first[:, None]).squeeze(1)
    none_fits = ~fits.any(1)
    box_w = torch.where(none_fits, torch.tensor(float(w)), box_w)
    box_h = torch.where(none_fits, torch.tensor(float(h)), box_h)
    top = (torch.rand(b, generator=generator) * (h - box_h + 1)).floor()
    left = (torch.rand(b, generator=generator) * (w - box_w + 1)).floor()
    rows = _interpolation_matrix(top, box_h, h, size).to(device=x.device, dtype=x.dtype)  # (B, size, H)
    cols = _interpolation_matrix(left, box_w, w, size)  # (B, size, W)
    if flip is not None:
        cols = torch.where(flip[:, None, None], cols.flip(1), cols)
    cols = cols.to(device=x.device, dtype=x.dtype)
    # Channels folded into the matmul rows: a few large bmm calls instead of B*C tiny ones, no broadcast copies.
    c = x.shape[1]
    x = torch.bmm(x.reshape(b, c * h, w), cols.transpose(1, 2))  # (B, C*H, size)
    x = x.view(b, c, h, size).transpose(1, 2).reshape(b, h, c * size)  # (B, H, C*size)
    x = torch.bmm(rows, x)  # (B, size, C*size)
    return x.view(b, size, c, size).transpose(1, 2).contiguous()


def _interpolation_matrix(start: torch.Tensor, length: torch.Tensor, extent: int, size: int) -> torch.Tensor:
    """(B, size, extent) bilinear weights that resample [start, start + length) of each row to `size` samples."""
    out = torch.arange(size, dtype=torch.float32)
    source = start[:, None] + (out + 0.5) * (length[:, None] / size) - 0.5  # pixel centres, align_corners=False
    source = source.clamp(0, extent - 1)
    pixels = torch.arange(extent, dtype=torch.float32)
    return (1 - (source[:, :, None] - pixels).abs()).clamp_(min=0)


def progressive_size(progress: float, min_size: int, max_size: int, ramp: tuple[float, float], step: int) -> int:
    """data.min_size: the training image size at `progress` (0..1) of the schedule: min_size until ramp[0], then
    growing linearly in multiples of `step` (the patch size), max_size from ramp[1] on."""
    if not min_size or progress >= ramp[1]:
        return max_size
    share = max(0.0, progress - ramp[0]) / max(ramp[1] - ramp[0], 1e-9)
    return min_size + int(share * (max_size - min_size)) // step * step


def resize_batch(images: torch.Tensor, size: int) -> torch.Tensor:
    """A normalized (B, C, H, W) batch at size x size (antialiased bilinear; unchanged when already that size)."""
    if images.shape[-1] == size and images.shape[-2] == size:
        return images
    return F.interpolate(images, size=(size, size), mode="bilinear", antialias=True, align_corners=False)


def _per_channel(values: tuple[float, ...], channels: int) -> list[float]:
    return list(values) * channels if len(values) == 1 else list(values)
