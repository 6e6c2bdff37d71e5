"""Augmentation and normalization on whole uint8 batches, on the training device."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vitrain.config import DataConfig


class BatchAugment:
    """Random crop after padding, horizontal flip, then normalization; all batched, no per-sample Python."""

    def __init__(self, cfg: DataConfig, channels: int, train: bool):
        self.crop_padding = cfg.crop_padding if train else 0
        self.hflip = cfg.hflip if train else 0.0
        self.mean = torch.tensor(_per_channel(cfg.mean, channels)).view(1, channels, 1, 1) * 255.0
        self.std = torch.tensor(_per_channel(cfg.std, channels)).view(1, channels, 1, 1) * 255.0

    def __call__(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        x = images.float()
        b, _, h, w = x.shape
        if self.crop_padding:
            p = self.crop_padding
            x = F.pad(x, (p, p, p, p), mode="reflect" if p < min(h, w) else "constant")
            dy = torch.randint(0, 2 * p + 1, (b,), generator=generator, device="cpu").to(x.device)
            dx = torch.randint(0, 2 * p + 1, (b,), generator=generator, device="cpu").to(x.device)
            rows = (dy[:, None] + torch.arange(h, device=x.device))[:, :, None]  # (B, H, 1)
            cols = (dx[:, None] + torch.arange(w, device=x.device))[:, None, :]  # (B, 1, W)
            batch = torch.arange(b, device=x.device)[:, None, None]
            x = x.permute(0, 2, 3, 1)[batch, rows, cols].permute(0, 3, 1, 2)
        if self.hflip:
            flip = (torch.rand(b, generator=generator, device="cpu") < self.hflip).to(x.device)
            x = torch.where(flip[:, None, None, None], x.flip(3), x)
        mean, std = self.mean.to(x.device), self.std.to(x.device)
        return ((x - mean) / std).contiguous()


def _per_channel(values: tuple[float, ...], channels: int) -> list[float]:
    return list(values) * channels if len(values) == 1 else list(values)
