"""Space-time ViT for clips: tubelet embedding, joint space-time attention with the image ViT's blocks, inflation.

A clip of T frames is cut into (T/t) x (H/p) x (W/p) tubelets of t x p x p pixels (one Conv3d, ViViT's "tubelet
embedding"); every token attends to every other (joint space-time attention, VideoMAE's backbone). Everything after
the embedding is the image ViT's own (`VisionTransformer`): the same `Block`, norms, pooling and head, so precision
policies, FSDP units and activation checkpointing (models/plan.py) apply unchanged, and `complexity` counts the
video's tokens through `ModelConfig.num_patches`.

The model takes clips as the loader gives them, frames stacked on the channel axis, (B, T*C, H, W) (frame-major:
the channels of frame 0, then frame 1, ...), or as (B, C, T, H, W).

`inflate_into` starts it from an image ViT's weights (ViViT and TimeSformer's inflation): the patch embedding's 2-D
kernel spread over the tubelet's t frames (`average`: w / t on each, so a static clip embeds exactly as its frame
does; `center`: w on the tubelet's centre frame, 0 elsewhere), the position table repeated over time (resampled
first when the grids differ), every other tensor copied.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from vitrain.config import ModelConfig
from vitrain.errors import CheckpointError, ConfigError
from vitrain.models.vit import VisionTransformer, check_vit, resized_positions


class TubeletEmbed(nn.Module):
    """Cuts a clip into t x p x p tubelets, each projected to `width` (a strided Conv3d); tokens in (t, h, w) order."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.frames, self.in_chans = cfg.num_frames, cfg.in_chans
        self.num_patches = cfg.num_patches
        kernel = (cfg.tubelet_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_chans, cfg.width, kernel_size=kernel, stride=kernel)

    def forward(self, clips: torch.Tensor) -> torch.Tensor:
        if clips.ndim == 4:  # (B, T*C, H, W) -> (B, C, T, H, W)
            b, _, h, w = clips.shape
            clips = clips.view(b, self.frames, self.in_chans, h, w).transpose(1, 2)
        return self.proj(clips).flatten(2).transpose(1, 2)  # (B, N, D)


class VideoTransformer(VisionTransformer):
    """The image ViT over tubelet tokens: `model.name=video_vit` (num_frames, tubelet_size in the model config).

    pos_embed=learned: one table over all (T/t) x (H/p) x (W/p) positions (plus the class token's row);
    sincos: a fixed separable table, a third of the channels each for time, rows and columns (`sincos_3d`).
    """

    def make_patch_embed(self, cfg: ModelConfig) -> nn.Module:
        return TubeletEmbed(cfg)

    def _sincos_table(self) -> torch.Tensor:
        cfg = self.cfg
        table = sincos_3d(cfg.num_frames // cfg.tubelet_size, cfg.image_size // cfg.patch_size, cfg.width)
        return torch.cat([torch.zeros(self.pos_prefix, cfg.width), table]).unsqueeze(0)


def build_video_vit(cfg: ModelConfig, embed_dim: int = 0) -> VideoTransformer:
    """The registry's `video_vit`: a clip classifier over cfg.num_classes (or an embedding model)."""
    return VideoTransformer(cfg, embed_dim)


def sincos_3d(frames: int, grid: int, width: int, temperature: float = 10000.0) -> torch.Tensor:
    """Fixed (frames*grid*grid, width) position table: sin and cos of time, row and column, width // 6 frequencies
    each (zero-padded to width), rows in the tubelet tokens' (t, h, w) order."""
    ts, ys, xs = torch.meshgrid(torch.arange(frames), torch.arange(grid), torch.arange(grid), indexing="ij")
    k = width // 6
    omega = 1.0 / temperature ** (torch.arange(k) / k)
    parts = []
    for axis in (ts, ys, xs):
        angle = axis.flatten()[:, None].float() * omega[None, :]
        parts += [angle.sin(), angle.cos()]
    return F.pad(torch.cat(parts, dim=1), (0, width - 6 * k))


def check(m: ModelConfig) -> None:
    """A video ViT's architecture: the image ViT's checks plus the clip's, one line naming the value and the fix."""
    check_vit(m)
    if m.num_frames < 1 or m.tubelet_size < 1:
        raise ConfigError(f"model.num_frames={m.num_frames} and model.tubelet_size={m.tubelet_size} must be >= 1")
    if m.num_frames % m.tubelet_size:
        raise ConfigError(
            f"model.tubelet_size={m.tubelet_size} does not divide model.num_frames={m.num_frames}; use a number of "
            f"frames that is a multiple of {m.tubelet_size}"
        )
    if m.patch_embed != "linear":
        raise ConfigError(
            f"model.patch_embed={m.patch_embed}: video_vit embeds tubelets linearly; set patch_embed=linear"
        )


# ---------------------------------------------------------------------------------------------- inflation


def inflate_state(
    image: dict[str, torch.Tensor], model: VideoTransformer, mode: str = "average", source: str = "model.inflate_from"
) -> dict[str, torch.Tensor]:
    """An image ViT's state dict made to fit `model`: the 2-D patch kernel spread over the tubelet (`average`:
    w / t on every frame; `center`: w on frame t // 2), the position table resampled to the clip's grid and repeated
    over time (the class token's row kept), a classifier of another size left out (it stays freshly initialized).
    `source`: the config key and file, for the error lines.

    With `average`, pos_embed=learned and pool=gap, a clip of one frame repeated has exactly the image model's
    logits on that frame: each tubelet embeds as the frame's patch does, every time step holds the same tokens, and
    attention over k copies of the same keys and values is attention over one copy (the softmax weights split k
    ways). A class token breaks it: its one key competes with k copies of each patch key instead of one.
    """
    own = model.state_dict()
    cfg = model.cfg
    state = dict(image)
    kernel = state.get("patch_embed.proj.weight")
    if kernel is None or kernel.ndim != 4:
        raise CheckpointError(f"{source} holds no image ViT patch embedding (patch_embed.proj.weight, 4-D)")
    t = cfg.tubelet_size
    if mode == "average":
        state["patch_embed.proj.weight"] = kernel.unsqueeze(2).repeat(1, 1, t, 1, 1) / t
    else:
        spread = kernel.new_zeros(kernel.shape[0], kernel.shape[1], t, *kernel.shape[2:])
        spread[:, :, t // 2] = kernel
        state["patch_embed.proj.weight"] = spread
    if "pos_embed" in own and "pos_embed" in state:
        state["pos_embed"] = _inflated_positions(state["pos_embed"], model, source)
    else:
        state.pop("pos_embed", None)  # a fixed sin-cos table on either side is not learned: nothing to carry
    for name in ("head.weight", "head.bias"):
        if "head.weight" not in own:  # an embedding model: the source's classifier has no counterpart here
            state.pop(name, None)
        elif name in state and name in own and state[name].shape != own[name].shape:
            state[name] = own[name]
    return state


def _inflated_positions(pos: torch.Tensor, model: VideoTransformer, source: str) -> torch.Tensor:
    """(1, prefix + G*G, D) image table -> (1, prefix + T' * g*g, D): the class row kept (or dropped for pool=gap),
    the grid resampled to the clip's g x g, then repeated over the T' tubelet steps."""
    cfg = model.cfg
    rows = pos.shape[1] if pos.ndim == 3 and pos.shape[0] == 1 else 0
    if not any(n > 0 and math.isqrt(n) ** 2 == n for n in (rows, rows - 1)):  # a square grid (and a class row)
        raise CheckpointError(
            f"{source}: pos_embed is {tuple(pos.shape)}, not an image ViT's position table (1, G*G or 1 + G*G, width) "
            "for a G x G patch grid; inflate from an image ViT's weights"
        )
    image_prefix = 0 if math.isqrt(pos.shape[1]) ** 2 == pos.shape[1] else 1
    if model.pos_prefix and not image_prefix:
        raise CheckpointError(
            "model.inflate_from has no class token (pool=gap); inflate it into a model with model.pool=gap too"
        )
    if image_prefix and not model.pos_prefix:
        pos = pos[:, 1:]
    prefix = model.pos_prefix
    grid = cfg.image_size // cfg.patch_size
    if pos.shape[1] - prefix != grid * grid:
        pos = resized_positions(pos, prefix, grid)
    first, table = pos[:, :prefix], pos[:, prefix:]
    return torch.cat([first, table.repeat(1, cfg.num_frames // cfg.tubelet_size, 1)], dim=1)


def inflate_into(model: nn.Module, path: Path, mode: str = "average") -> None:
    """Load an image ViT's weights file (vitrain export, timm or a .pt state dict) into a video ViT, inflated."""
    from vitrain.weights import read_weights

    if not isinstance(model, VideoTransformer):
        raise ConfigError(f"model.inflate_from={path} inflates into a video ViT; set model.name=video_vit")
    state = inflate_state(read_weights(Path(path), "model.inflate_from"), model, mode, f"model.inflate_from={path}")
    own = model.state_dict()
    wrong = [k for k in own if k in state and state[k].shape != own[k].shape]
    missing = [k for k in own if k not in state]
    extra = sorted(set(state) - set(own))  # a deeper model's blocks: refused, as model.init_from refuses them
    if wrong or missing or extra:
        name = (wrong or missing or extra)[0]
        if wrong:
            what = f"{name} has {tuple(state[name].shape)} where the model has {tuple(own[name].shape)}"
        else:
            what = f"{name} has no tensor" if missing else f"it has an extra tensor {name}"
        raise CheckpointError(
            f"model.inflate_from={path}: {what}; inflate from an image ViT of the same width, depth and heads"
        )
    model.load_state_dict({k: state[k] for k in own})
