"""ViTDet: a plain ViT backbone with windowed attention, the simple feature pyramid, and an FCOS head on top.

Li et al. 2022 ("Exploring Plain Vision Transformer Backbones for Object Detection"): most blocks attend within
non-overlapping windows of `model.window_size` tokens (the map padded to a multiple of it), a few blocks
(`model.global_blocks`, ViTDet-B: 2, 5, 8, 11) attend over the whole map; the pyramid is built from the last
stride-16 map alone (deconvolutions for strides 4 and 8, the map itself for 16, a max-pool for 32). The blocks are
vitrain's own `Block` (the same Attention and MLP, so timm and vitrain ViT weights load 1:1); only the token layout
around the attention differs. ViTDet's relative position biases are not used: absolute positions only.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vitrain.config import ModelConfig
from vitrain.errors import CheckpointError, ConfigError
from vitrain.models.fcos import FCOSHead, Points
from vitrain.models.plan import ParallelPlan, fp32_layers
from vitrain.models.vit import Block, Complexity, PatchEmbed


def pyramid_strides(patch_size: int) -> tuple[int, int, int, int]:
    """The pyramid levels' strides in pixels: a quarter, half, one and two patches (4, 8, 16, 32 for patch 16)."""
    return (patch_size // 4, patch_size // 2, patch_size, 2 * patch_size)


def window_partition(x: torch.Tensor, window: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """(B, H, W, D) -> (B * windows, window * window, D), the map zero-padded at its bottom and right to a multiple
    of `window`; also the padded (H, W)."""
    b, h, w, d = x.shape
    pad_h, pad_w = -h % window, -w % window
    if pad_h or pad_w:
        x = F.pad(x, (0, 0, 0, pad_w, 0, pad_h))
    hp, wp = h + pad_h, w + pad_w
    x = x.view(b, hp // window, window, wp // window, window, d).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, window * window, d), (hp, wp)


def window_unpartition(
    windows: torch.Tensor, window: int, padded: tuple[int, int], size: tuple[int, int]
) -> torch.Tensor:
    """The inverse of `window_partition`: (B * windows, window * window, D) -> (B, H, W, D), padding cut off."""
    hp, wp = padded
    h, w = size
    d = windows.shape[-1]
    b = windows.shape[0] // ((hp // window) * (wp // window))
    x = windows.view(b, hp // window, wp // window, window, window, d).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, hp, wp, d)[:, :h, :w].contiguous()


class WindowedBlock(Block):
    """vitrain's pre-norm Block over a (B, H, W, D) token map: attention within windows of `window` tokens (0: over
    the whole map, a global block). Padding tokens are zeros appended after the norm, as ViTDet pads."""

    def __init__(self, cfg: ModelConfig, drop_path: float, window: int):
        super().__init__(cfg, drop_path)
        self.window = window

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, d = x.shape
        y = self.norm1(x)
        if self.window:
            windows, padded = window_partition(y, self.window)
            y = window_unpartition(self.attn(windows), self.window, padded, (h, w))
        else:
            y = self.attn(y.reshape(b, h * w, d)).view(b, h, w, d)
        x = x + self.drop_path(y)
        return x + self.drop_path(self.mlp(self.norm2(x)))


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of a (B, C, H, W) map (ViTDet's pyramid norm); a LayerNorm, so low precision
    keeps it in fp32 like every other norm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class SimplePyramid(nn.Module):
    """The patch map (stride 16 for patch 16) -> maps at strides 4, 8, 16, 32, each with `channels` channels
    (ViTDet's simple pyramid)."""

    def __init__(self, width: int, channels: int):
        super().__init__()
        half, quarter = width // 2, width // 4
        self.scales = nn.ModuleList(
            [
                nn.Sequential(
                    nn.ConvTranspose2d(width, half, 2, stride=2),
                    LayerNorm2d(half, eps=1e-6),
                    nn.GELU(),
                    nn.ConvTranspose2d(half, quarter, 2, stride=2),
                ),
                nn.ConvTranspose2d(width, half, 2, stride=2),
                nn.Identity(),
                nn.MaxPool2d(2, stride=2),
            ]
        )
        self.outputs = nn.ModuleList(
            nn.Sequential(
                nn.Conv2d(dim, channels, 1, bias=False),
                LayerNorm2d(channels, eps=1e-6),
                nn.Conv2d(channels, channels, 3, padding=1, bias=False),
                LayerNorm2d(channels, eps=1e-6),
            )
            for dim in (quarter, half, width, width)
        )

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [out(scale(x)) for scale, out in zip(self.scales, self.outputs, strict=True)]


class ViTDet(nn.Module):
    """Images (B, C, S, S) -> FCOS outputs over the points of the four pyramid levels, as one tuple of tensors
    (class logits (B, P, classes), box distances l, t, r, b in pixels (B, P, 4), centerness logits (B, P)), so
    that every precision policy hands them back in fp32. `points()` gives the P points' (x, y) and stride."""

    def __init__(self, cfg: ModelConfig, pyramid_channels: int = 256, head_convs: int = 4):
        super().__init__()
        check_vitdet(cfg)
        self.cfg = cfg
        self.grid = cfg.image_size // cfg.patch_size
        self.patch_embed = PatchEmbed(cfg.image_size, cfg.patch_size, cfg.in_chans, cfg.width)
        # No class token: the table holds the detection grid's positions; a pretrained one is resampled to it.
        self.pos_embed = nn.Parameter(torch.zeros(1, self.grid * self.grid, cfg.width))
        rates = torch.linspace(0, cfg.drop_path, cfg.depth, device="cpu").tolist()
        windows = [0 if i in cfg.global_blocks else cfg.window_size for i in range(cfg.depth)]
        self.blocks = nn.ModuleList(WindowedBlock(cfg, r, w) for r, w in zip(rates, windows, strict=True))
        self.pyramid_channels, self.head_convs = pyramid_channels, head_convs
        self.pyramid = SimplePyramid(cfg.width, pyramid_channels)
        self.head = FCOSHead(pyramid_channels, cfg.num_classes, head_convs, pyramid_strides(cfg.patch_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for module in [self.patch_embed, *self.blocks]:
            for sub in module.modules():
                if isinstance(sub, nn.Linear | nn.Conv2d):
                    nn.init.trunc_normal_(sub.weight, std=0.02)
                    if sub.bias is not None:
                        nn.init.zeros_(sub.bias)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def features(self, images: torch.Tensor) -> list[torch.Tensor]:
        """Images -> the pyramid's maps at strides 4, 8, 16, 32."""
        x = self.patch_embed(images)  # (B, N, D)
        grid_h, grid_w = images.shape[-2] // self.cfg.patch_size, images.shape[-1] // self.cfg.patch_size
        pos = self.pos_embed
        if (grid_h, grid_w) != (self.grid, self.grid):
            pos = resample_positions(pos, (grid_h, grid_w))
        x = (x + pos).view(x.shape[0], grid_h, grid_w, -1)
        for block in self.blocks:
            x = block(x)
        return self.pyramid(x.permute(0, 3, 1, 2))

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.head(self.features(images))

    def points(self, image_size: int | None = None) -> Points:
        """The head's points for a square input (default model.image_size)."""
        return self.head.points(image_size or self.cfg.image_size)

    def complexity(self, batch_size: int = 1) -> Complexity:
        """The cost of a forward pass at model.image_size (the run's start line, `vitrain bench`)."""
        return complexity(self.cfg, self.pyramid_channels, self.head_convs, batch_size)

    def parallel_plan(self, wrap: str) -> ParallelPlan:
        """The blocks as sharding and checkpointing units, as for vitrain's ViT (the pyramid and head are small)."""
        blocks = list(self.blocks)
        units: list[nn.Module] = [sub for b in blocks for sub in (b.attn, b.mlp)] if wrap == "sublayer" else []
        units += blocks if wrap in ("block", "sublayer") else []
        grid, width = self.grid, self.cfg.width
        return ParallelPlan(units, blocks, *fp32_layers(self, blocks), lambda n: (n, grid, grid, width))

    def load_image_backbone(self, state: dict[str, torch.Tensor], where: str) -> None:
        """Start the backbone from a vitrain or timm image ViT's state dict: its patch embedding and blocks as they
        are, its position table resampled to the detection grid (the class token's row dropped); its class token,
        final norm and classifier have no counterpart here and are left out. The pyramid and head start fresh."""
        own = self.state_dict()
        taken = {k: v for k, v in state.items() if k.startswith(("patch_embed.", "blocks."))}
        missing = sorted(k for k in own if k.startswith(("patch_embed.", "blocks.")) and k not in taken)
        extra = sorted(k for k in taken if k not in own)
        if missing or extra:
            what = f"lacks tensor {missing[0]}" if missing else f"has an extra tensor {extra[0]}"
            raise CheckpointError(f"{where} holds a different backbone: it {what}; set model.width/depth to match")
        for key, tensor in taken.items():
            if tensor.shape != own[key].shape:
                raise CheckpointError(
                    f"{where}: {key} is {tuple(tensor.shape)} there, {tuple(own[key].shape)} here; set the model.* "
                    "keys to match the checkpoint"
                )
        if "pos_embed" in state:
            table = state["pos_embed"]
            rows = table.shape[1]
            side = math.isqrt(rows)
            prefix = rows - side * side  # a class (and distillation) token's rows come first
            table = table[:, prefix:].reshape(1, side * side, -1)
            taken["pos_embed"] = resample_positions(table, (self.grid, self.grid))
        with torch.no_grad():
            for key, tensor in taken.items():
                own[key].copy_(tensor)


def resample_positions(table: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """A (1, G*G, D) position table resampled (bicubic) to a grid of (H, W) tokens: (1, H*W, D)."""
    side = math.isqrt(table.shape[1])
    square = table.reshape(1, side, side, -1).permute(0, 3, 1, 2).float()
    resized = F.interpolate(square, size=grid, mode="bicubic", align_corners=False).to(table.dtype)
    return resized.permute(0, 2, 3, 1).reshape(1, grid[0] * grid[1], -1)


def check_vitdet(m: ModelConfig) -> None:
    """What the ViTDet backbone asks of the model section, one line per fault."""
    if m.image_size % (m.patch_size * 2):
        raise ConfigError(
            f"model.image_size={m.image_size} must be a multiple of 2 x model.patch_size={m.patch_size} (the "
            "pyramid's stride-32 level halves the patch grid)"
        )
    if m.patch_size % 4:
        raise ConfigError(
            f"model.patch_size={m.patch_size} must be divisible by 4 (the pyramid's finest level has stride patch/4)"
        )
    if m.width % 4:
        raise ConfigError(f"model.width={m.width} must be divisible by 4 (the pyramid's stride-4 level has width/4)")
    if m.window_size < 0:
        raise ConfigError(f"model.window_size={m.window_size} must be >= 0 tokens (0: every block global)")
    bad = [i for i in m.global_blocks if not 0 <= i < m.depth]
    if bad:
        raise ConfigError(
            f"model.global_blocks={list(m.global_blocks)} names block {bad[0]}, but model.depth={m.depth} has blocks "
            f"0 to {m.depth - 1}"
        )
    if m.pool != "cls" or m.layout != "batch_first" or m.patch_embed != "linear" or m.pos_embed != "learned":
        raise ConfigError(
            "model.name=vitdet uses a learned position table, the linear patch embedding and the batch_first layout; "
            "leave model.pos_embed, patch_embed, layout and pool at their defaults"
        )


def parameter_count(m: ModelConfig, pyramid_channels: int, head_convs: int) -> int:
    """The detector's exact parameter count from the config alone (pycls's habit: every model knows its cost)."""
    d, h, c, k = m.width, m.hidden_dim, pyramid_channels, m.num_classes
    qkv_bias = 3 * d if m.qkv_bias else 0
    block = 2 * d + (3 * d * d + qkv_bias) + (d * d + d) + 2 * d + (d * h + h) + (h * d + d)
    backbone = m.in_chans * m.patch_size**2 * d + d + (m.image_size // m.patch_size) ** 2 * d + m.depth * block
    half, quarter = d // 2, d // 4
    scales = (4 * d * half + half) + 2 * half + (4 * half * quarter + quarter) + (4 * d * half + half)
    outputs = sum(dim * c + 2 * c + 9 * c * c + 2 * c for dim in (quarter, half, d, d))
    towers = 2 * head_convs * (9 * c * c + c + 2 * c)
    predictions = (9 * c * k + k) + (9 * c * 4 + 4) + (9 * c + 1) + 4  # + one scale per level
    return backbone + scales + outputs + towers + predictions


def complexity(m: ModelConfig, pyramid_channels: int, head_convs: int, batch_size: int = 1) -> Complexity:
    """Exact parameters and multiply-adds of the convs, linears and attention matmuls of one forward pass (a windowed
    block's projections also run on the padding tokens); activations: the elements those layers, the norms and the
    attention scores produce."""
    d, h, c, k = m.width, m.hidden_dim, pyramid_channels, m.num_classes
    grid = m.image_size // m.patch_size
    n = grid * grid
    macs = n * m.in_chans * m.patch_size**2 * d
    acts = n * d
    for i in range(m.depth):
        window = 0 if i in m.global_blocks else m.window_size
        if window:
            side = -(-grid // window) * window
            windows, tokens = (side // window) ** 2, side * side
            scores = windows * window**4
        else:
            tokens, scores = n, n * n
        macs += tokens * 4 * d * d + 2 * scores * d + n * 2 * d * h
        acts += n * d + tokens * 4 * d + m.heads * scores + n * (d + 2 * h + d)
    half, quarter = d // 2, d // 4
    sides = [grid * 4, grid * 2, grid, grid // 2]
    macs += sides[1] ** 2 * d * half + sides[0] ** 2 * half * quarter + sides[1] ** 2 * d * half
    acts += 2 * sides[1] ** 2 * half + sides[0] ** 2 * quarter + sides[1] ** 2 * half + sides[3] ** 2 * d
    per_point = 2 * head_convs * 9 * c * c + 9 * c * (k + 4 + 1)
    for side, dim in zip(sides, (quarter, half, d, d), strict=True):
        macs += side * side * (dim * c + 9 * c * c + per_point)
        acts += side * side * (4 * c + 2 * head_convs * 3 * c + k + 4 + 1)
    params = parameter_count(m, pyramid_channels, head_convs)
    return Complexity(params, macs * batch_size, 2 * macs * batch_size, acts * batch_size)
