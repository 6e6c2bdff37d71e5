"""Augmentation and normalization on whole uint8 batches, on the training device.

Order: random resized crop (or random crop after padding), horizontal flip, resize to the model's input size
when the stored size differs, mixup or cutmix (labels become soft targets), normalization last.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from vitrain.config import DataConfig


class BatchAugment:
    """Batched augmentation with no per-sample Python: `augment(images, labels, gen) -> (inputs, targets)`.

    Targets are the integer labels, or (B, num_classes) probabilities when mixup or cutmix is on; both work
    with `F.cross_entropy`.
    """

    def __init__(self, cfg: DataConfig, channels: int, train: bool, image_size: int, num_classes: int):
        self.image_size = image_size
        self.num_classes = num_classes
        self.random_resized_crop = cfg.random_resized_crop and train
        self.rrc_scale, self.rrc_ratio = cfg.rrc_scale, cfg.rrc_ratio
        self.crop_padding = cfg.crop_padding if train and not cfg.random_resized_crop else 0
        self.hflip = cfg.hflip if train else 0.0
        self.mixup_alpha = cfg.mixup_alpha if train else 0.0
        self.cutmix_alpha = cfg.cutmix_alpha if train else 0.0
        self.cutmix_prob = cfg.cutmix_prob
        self.mean = torch.tensor(_per_channel(cfg.mean, channels)).view(1, channels, 1, 1) * 255.0
        self.std = torch.tensor(_per_channel(cfg.std, channels)).view(1, channels, 1, 1) * 255.0

    def __call__(
        self, images: torch.Tensor, labels: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = images.float()
        if self.random_resized_crop:
            x = random_resized_crop(x, self.image_size, self.rrc_scale, self.rrc_ratio, generator)
        elif self.crop_padding:
            x = pad_and_random_crop(x, self.crop_padding, generator)
        if self.hflip:
            flip = (torch.rand(x.shape[0], generator=generator) < self.hflip).to(x.device)
            x = torch.where(flip[:, None, None, None], x.flip(3), x)
        if x.shape[-2:] != (self.image_size, self.image_size):
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear", antialias=True)
        targets = labels
        if self.mixup_alpha or self.cutmix_alpha:
            x, targets = self.mix(x, labels, generator)
        mean, std = self.mean.to(x.device), self.std.to(x.device)
        return ((x - mean) / std).contiguous(), targets

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
            x = x * lam + x.flip(0) * (1.0 - lam)
        return x, one_hot * lam + one_hot.flip(0) * (1.0 - lam)


def pad_and_random_crop(x: torch.Tensor, padding: int, generator: torch.Generator | None) -> torch.Tensor:
    """Pad every image by `padding` (reflect when it fits), then crop a random window of the original size."""
    b, _, h, w = x.shape
    p = padding
    x = F.pad(x, (p, p, p, p), mode="reflect" if p < min(h, w) else "constant")
    dy = torch.randint(0, 2 * p + 1, (b,), generator=generator).to(x.device)
    dx = torch.randint(0, 2 * p + 1, (b,), generator=generator).to(x.device)
    rows = (dy[:, None] + torch.arange(h, device=x.device))[:, :, None]  # (B, H, 1)
    cols = (dx[:, None] + torch.arange(w, device=x.device))[:, None, :]  # (B, 1, W)
    batch = torch.arange(b, device=x.device)[:, None, None]
    return x.permute(0, 2, 3, 1)[batch, rows, cols].permute(0, 3, 1, 2)


def random_resized_crop(
    x: torch.Tensor,
    size: int,
    scale: tuple[float, float],
    ratio: tuple[float, float],
    generator: torch.Generator | None,
    attempts: int = 10,
) -> torch.Tensor:
    """torchvision's RandomResizedCrop for a whole batch: one box per image, bilinear resampling to size x size.

    Each image tries `attempts` boxes (area fraction ~ U(scale), log aspect ~ U(log ratio)) and takes the
    first that fits; an image with none that fits keeps its whole frame.
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
    # affine_grid maps output [-1, 1] onto the box, in the input's normalized coordinates (align_corners=False).
    theta = torch.zeros(b, 2, 3)
    theta[:, 0, 0] = box_w / w
    theta[:, 0, 2] = (2 * left + box_w) / w - 1
    theta[:, 1, 1] = box_h / h
    theta[:, 1, 2] = (2 * top + box_h) / h - 1
    theta = theta.to(device=x.device, dtype=x.dtype)
    grid = F.affine_grid(theta, [b, x.shape[1], size, size], align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


def _per_channel(values: tuple[float, ...], channels: int) -> list[float]:
    return list(values) * channels if len(values) == 1 else list(values)
