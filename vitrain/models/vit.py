"""Single-device Vision Transformer with exact parameter, FLOP and activation counting."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vitrain.config import ModelConfig
from vitrain.errors import ConfigError
from vitrain.models.kernels import manual_attention, merge_heads, split_heads
from vitrain.models.plan import ParallelPlan, vit_plan


class PatchEmbed(nn.Module):
    """Cuts an image into non-overlapping patches and projects each to `width` (a strided conv)."""

    def __init__(self, image_size: int, patch_size: int, in_chans: int, width: int):
        super().__init__()
        self.num_patches = (image_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_chans, width, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, N, D)


class ConvStem(nn.Module):
    """A convolutional patch embedding: 3x3 convs (BatchNorm, ReLU), then a 1x1 conv to `width`; same grid as
    PatchEmbed. `stem` is ModelConfig.stem: (out channels, stride) per 3x3 conv."""

    def __init__(self, image_size: int, patch_size: int, in_chans: int, width: int, stem: tuple[tuple[int, int], ...]):
        super().__init__()
        self.num_patches = (image_size // patch_size) ** 2
        layers: list[nn.Module] = []
        for channels, stride in stem:
            layers += [
                nn.Conv2d(in_chans, channels, 3, stride=stride, padding=1, bias=False),
                nn.BatchNorm2d(channels),
                nn.ReLU(inplace=True),
            ]
            in_chans = channels
        self.stem = nn.Sequential(*layers)
        self.proj = nn.Conv2d(in_chans, width, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.stem(x)).flatten(2).transpose(1, 2)  # (B, N, D)


class Attention(nn.Module):
    """Multi-head self-attention with one fused QKV projection."""

    def __init__(self, width: int, heads: int, qkv_bias: bool, impl: str, seq_first: bool):
        super().__init__()
        self.heads = heads
        self.head_dim = width // heads
        self.impl = impl
        self.seq_first = seq_first
        self.qkv = nn.Linear(width, 3 * width, bias=qkv_bias)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl == "manual":  # bmm and softmax, heads split once (vitrain/models/kernels.py)
            return self.proj(manual_attention(self.qkv(x), self.heads, self.seq_first))
        q, k, v = split_heads(self.qkv(x), self.heads, self.seq_first).unbind(0)  # each (B, H, N, hd)
        out = F.scaled_dot_product_attention(q, k, v)  # sdpa (and auto where no tuner decided: resolved before)
        return self.proj(merge_heads(out, self.seq_first))


class Mlp(nn.Module):
    def __init__(self, width: int, hidden: int, dropout: float):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class DropPath(nn.Module):
    """Stochastic depth: drops a residual branch per sample with probability `p` while training."""

    def __init__(self, p: float, batch_dim: int):
        super().__init__()
        self.p = p
        self.batch_dim = batch_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p == 0.0 or not self.training:
            return x
        shape = [1] * x.ndim
        shape[self.batch_dim] = x.shape[self.batch_dim]
        keep = x.new_empty(shape).bernoulli_(1.0 - self.p)
        return x * keep / (1.0 - self.p)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, drop_path: float):
        super().__init__()
        seq_first = cfg.layout == "seq_first"
        self.norm1 = nn.LayerNorm(cfg.width, eps=1e-6)
        self.attn = Attention(cfg.width, cfg.heads, cfg.qkv_bias, cfg.attention, seq_first)
        self.norm2 = nn.LayerNorm(cfg.width, eps=1e-6)
        self.mlp = Mlp(cfg.width, cfg.hidden_dim, cfg.dropout)
        self.drop_path = DropPath(drop_path, batch_dim=1 if seq_first else 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class EmbeddingNeck(nn.Module):
    """Pooled (or flattened) features -> an embedding: Linear without bias, then BatchNorm1d (face recognition)."""

    def __init__(self, in_features: int, embed_dim: int):
        super().__init__()
        self.fc = nn.Linear(in_features, embed_dim, bias=False)
        self.bn = nn.BatchNorm1d(embed_dim, eps=2e-5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x))


class VisionTransformer(nn.Module):
    """ViT classifier or embedding model; parameter names follow timm's VisionTransformer (state dicts map 1:1).

    `forward_features` gives the normalized token sequence, `forward_head` pools it and applies the head; with
    `embed_dim > 0` an `EmbeddingNeck` replaces the classifier and the model returns embeddings.

    `distilled` (DeiT): a distillation token beside the class token, with its own classifier `head_dist`. In training
    mode the model returns both heads' logits, (class head, distillation head), for the distillation loss; in eval
    mode their average, which is what the deployed student predicts. The token has no row in the position table: a
    learned position added to a learned token would be one more copy of the same parameter.

    `forward(images, keep)`: `keep` (B, K) indices of the patch tokens each image keeps (token dropping; the class
    and distillation tokens are always kept), drawn by the training step; None keeps every token.
    """

    def __init__(self, cfg: ModelConfig, embed_dim: int = 0, distilled: bool = False):
        super().__init__()
        if distilled and (embed_dim or cfg.pool != "cls"):
            raise ValueError("a distillation token needs a classifier with the class token (pool=cls, no embedding)")
        rng_state = torch.get_rng_state()  # what the layers' own default inits, then ours, draw from
        self.cfg = cfg
        self.embed_dim = embed_dim
        self.distilled = distilled
        self.patch_embed = self.make_patch_embed(cfg)
        self.pos_prefix = 1 if cfg.pool == "cls" else 0  # tokens before the patches with a row in the position table
        self.num_prefix_tokens = self.pos_prefix + (1 if distilled else 0)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.width)) if cfg.pool == "cls" else None
        self.dist_token = nn.Parameter(torch.zeros(1, 1, cfg.width)) if distilled else None
        seq_len = self.patch_embed.num_patches + self.pos_prefix
        if cfg.pos_embed == "learned":
            self.pos_embed = nn.Parameter(torch.zeros(1, seq_len, cfg.width))
        else:
            self.register_buffer("pos_embed", self._sincos_table(), persistent=False)
        self.pos_drop = nn.Dropout(cfg.dropout)
        rates = torch.linspace(0, cfg.drop_path, cfg.depth, device="cpu").tolist()  # also when built on meta
        self.blocks = nn.ModuleList(Block(cfg, r) for r in rates)
        # timm's convention: a class-token model normalizes the sequence, a pooled model the pooled vector.
        self.norm = nn.LayerNorm(cfg.width, eps=1e-6) if cfg.pool != "gap" else nn.Identity()
        self.fc_norm = nn.LayerNorm(cfg.width, eps=1e-6) if cfg.pool == "gap" else nn.Identity()
        features = features_dim(cfg)
        self.neck = EmbeddingNeck(features, embed_dim) if embed_dim else nn.Identity()
        self.head = nn.Linear(features, cfg.num_classes) if not embed_dim else nn.Identity()
        self.head_dist = nn.Linear(cfg.width, cfg.num_classes) if distilled else None
        if self.patch_embed.proj.weight.is_meta:
            # Built on the meta device (parallel.sharded_init): the weights are drawn later, shard by shard, from
            # the random state this build started from (vitrain/parallel/materialize.py).
            self.init_rng_state = rng_state
        else:
            self.reset_parameters()

    def make_patch_embed(self, cfg: ModelConfig) -> nn.Module:
        """The module that turns the input into patch tokens (B, N, D) and knows N as `num_patches`."""
        if cfg.patch_embed == "conv":
            return ConvStem(cfg.image_size, cfg.patch_size, cfg.in_chans, cfg.width, cfg.stem)
        return PatchEmbed(cfg.image_size, cfg.patch_size, cfg.in_chans, cfg.width)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        tensors = dict(self.named_parameters()) | dict(self.named_buffers())
        for name, init in self.init_plan():
            init(tensors[name], generator)

    def init_plan(self) -> list[tuple[str, Callable[[torch.Tensor, torch.Generator | None], None]]]:
        """How each parameter and buffer starts, by name, in the order the random draws are made."""
        plan = []
        for prefix, module in self.named_modules():
            at = f"{prefix}." if prefix else ""
            if isinstance(module, nn.Linear | nn.Conv2d | nn.Conv3d):
                plan.append((f"{at}weight", lambda t, g: nn.init.trunc_normal_(t, std=0.02, generator=g)))
                if module.bias is not None:
                    plan.append((f"{at}bias", lambda t, g: nn.init.zeros_(t)))
            elif isinstance(module, nn.LayerNorm | nn.modules.batchnorm._BatchNorm):  # also once made cross-rank
                plan += [(f"{at}weight", lambda t, g: nn.init.ones_(t)), (f"{at}bias", lambda t, g: nn.init.zeros_(t))]
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    plan += [
                        (f"{at}running_mean", lambda t, g: nn.init.zeros_(t)),
                        (f"{at}running_var", lambda t, g: nn.init.ones_(t)),
                        (f"{at}num_batches_tracked", lambda t, g: nn.init.zeros_(t)),
                    ]
        if isinstance(self.pos_embed, nn.Parameter):
            plan.append(("pos_embed", lambda t, g: nn.init.trunc_normal_(t, std=0.02, generator=g)))
        else:
            plan.append(("pos_embed", lambda t, g: t.copy_(self._sincos_table())))
        if self.cls_token is not None:
            plan.append(("cls_token", lambda t, g: nn.init.normal_(t, std=1e-6, generator=g)))
        if self.dist_token is not None:
            plan.append(("dist_token", lambda t, g: nn.init.trunc_normal_(t, std=0.02, generator=g)))
        return plan

    def _sincos_table(self) -> torch.Tensor:
        cfg = self.cfg
        table = sincos_2d(cfg.image_size // cfg.patch_size, cfg.width)
        return torch.cat([torch.zeros(self.pos_prefix, cfg.width), table]).unsqueeze(0)

    def forward_features(self, images: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Images (B, C, H, W) -> the normalized token sequence (B, N, D), batch first in either layout; N counts
        only the kept patch tokens where `keep` is given."""
        x = self.embed(images, keep)
        for block in self.blocks:
            x = block(x)
        return self.final_norm(x)

    def embed(self, images: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Images -> the first block's input: the class (and distillation) token, then the patch tokens (those in
        `keep` only, where given), each plus its position, in the layout."""
        x = self.patch_embed(images)
        pos, prefix = self.pos_embed, self.pos_prefix
        if x.shape[1] + prefix != pos.shape[1]:  # smaller images than model.image_size (data.min_size): fewer tokens
            pos = resized_positions(pos, prefix, images.shape[-1] // self.cfg.patch_size)
        x = x + pos[:, prefix:]
        if keep is not None:  # token dropping: after the positions are added, so each kept token keeps its own
            x = x.gather(1, keep.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        first = [] if self.cls_token is None else [self.cls_token + pos[:, :prefix]]
        if self.dist_token is not None:
            first.append(self.dist_token)
        if first:
            x = torch.cat([t.expand(x.shape[0], -1, -1) for t in first] + [x], dim=1)
        x = self.pos_drop(x)
        return x.transpose(0, 1) if self.cfg.layout == "seq_first" else x

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The last block's output -> the normalized token sequence (B, N, D), batch first."""
        x = self.norm(x)
        return x.transpose(0, 1) if self.cfg.layout == "seq_first" else x

    def forward_head(
        self, tokens: torch.Tensor, pre_logits: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Tokens (B, N, D) -> pooled features through the neck; then the classifier unless `pre_logits`. A
        distilled model's logits: (class head, distillation head) in training mode, their average in eval mode."""
        if self.cfg.pool == "cls":
            x = tokens[:, 0]
        elif self.cfg.pool == "gap":
            x = tokens.mean(dim=1)
        else:
            x = tokens[:, self.num_prefix_tokens :].flatten(1)
        x = self.neck(self.fc_norm(x))
        if pre_logits:
            return x
        logits = self.head(x)
        if self.head_dist is None:
            return logits
        distilled = self.head_dist(tokens[:, 1])
        return (logits, distilled) if self.training else (logits + distilled) / 2

    def forward(
        self, images: torch.Tensor, keep: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.forward_head(self.forward_features(images, keep))

    def complexity(self, batch_size: int = 1, kept_patches: int | None = None) -> Complexity:
        """The cost of a forward pass; `kept_patches`: of one that keeps this many patch tokens (token dropping)."""
        return complexity(self.cfg, batch_size, self.embed_dim, self.distilled, kept_patches)

    def parallel_plan(self, wrap: str) -> ParallelPlan:
        """Sharding units and checkpointable blocks for the strategies in vitrain/parallel."""
        return vit_plan(self, wrap)


class ViTStage(VisionTransformer):
    """The part of a ViT that pipeline stages hold: some blocks, the embedding with block 0, the head with the last.

    It takes the model's own modules under the model's own names (`blocks.7.attn.qkv.weight`: the blocks keep
    their index in a ModuleDict), so its state dict is a subset of the whole model's and DCP checkpoints move
    between a pipelined run and one process unchanged. Build the whole model, take the stages' parts, drop the
    model: what no part holds is freed (torchtitan's pipeline split does the same).

    A ViT itself, built from another one's modules instead of new ones: `embed`, `final_norm`, `forward_head`,
    `complexity` (the whole model's cost) and `parallel_plan` are the model's. `forward` runs the embedding (when
    held), the blocks in order, then the final norm and head (when held): on a part that holds consecutive blocks,
    exactly the model's forward over them.
    """

    def __init__(self, model: VisionTransformer, blocks: range | list[int]):
        nn.Module.__init__(self)  # the model's modules, not new ones
        self.cfg = model.cfg
        self.embed_dim, self.distilled = model.embed_dim, model.distilled
        self.num_prefix_tokens, self.pos_prefix = model.num_prefix_tokens, model.pos_prefix
        self.has_embedding = 0 in blocks
        self.has_head = self.cfg.depth - 1 in blocks
        if self.has_embedding:
            self.patch_embed = model.patch_embed
            self.cls_token, self.dist_token = model.cls_token, model.dist_token
            if isinstance(model.pos_embed, nn.Parameter):
                self.pos_embed = model.pos_embed
            else:  # sincos: a fixed table, not saved
                self.register_buffer("pos_embed", model.pos_embed, persistent=False)
            self.pos_drop = model.pos_drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in blocks})
        if self.has_head:
            self.norm, self.fc_norm, self.neck, self.head = model.norm, model.fc_norm, model.neck, model.head
            self.head_dist = model.head_dist

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images (first stage) or the previous stage's tokens -> tokens for the next stage, or the model's output."""
        if self.has_embedding:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        if self.has_head:
            return self.forward_head(self.final_norm(x))
        # Sent to the next stage: point-to-point sends take contiguous tensors only, and the token stream is a
        # strided view under pool=gap (no class token to concatenate) and under the seq_first layout.
        return x.contiguous()


def features_dim(cfg: ModelConfig) -> int:
    """Width of what the head (or neck) receives: one token's width, or every patch token's under pool=flatten."""
    if cfg.pool == "flatten":
        return cfg.num_patches * cfg.width
    return cfg.width


def resized_positions(pos: torch.Tensor, prefix: int, grid: int) -> torch.Tensor:
    """A (1, prefix + G*G, D) position table for a grid x grid token grid: the patch part resampled (bicubic, as
    timm does for other image sizes), the class token's row kept. Differentiable: the table still learns."""
    table = pos[:, prefix:]
    side = math.isqrt(table.shape[1])
    table = table.reshape(1, side, side, -1).permute(0, 3, 1, 2)
    table = F.interpolate(table.float(), size=(grid, grid), mode="bicubic", align_corners=False).to(pos.dtype)
    return torch.cat([pos[:, :prefix], table.permute(0, 2, 3, 1).reshape(1, grid * grid, -1)], dim=1)


def sincos_2d(grid: int, width: int, temperature: float = 10000.0) -> torch.Tensor:
    """Fixed 2-D sine-cosine position table of shape (grid*grid, width)."""
    ys, xs = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")
    quarter = width // 4
    omega = 1.0 / temperature ** (torch.arange(quarter) / quarter)
    ys = ys.flatten()[:, None] * omega[None, :]
    xs = xs.flatten()[:, None] * omega[None, :]
    table = torch.cat([xs.sin(), xs.cos(), ys.sin(), ys.cos()], dim=1)
    if table.shape[1] < width:
        table = F.pad(table, (0, width - table.shape[1]))
    return table


@dataclass(frozen=True)
class Complexity:
    """Cost of one forward pass. `flops` counts a multiply-add as 2; `macs` counts it as 1."""

    params: int
    macs: int
    flops: int
    activations: int  # elements produced by the layers of one forward pass (pycls's "acts")

    @property
    def train_flops(self) -> int:
        """Forward + backward: the backward pass costs twice the forward's matmuls."""
        return 3 * self.flops


def complexity(
    cfg: ModelConfig, batch_size: int = 1, embed_dim: int = 0, distilled: bool = False, kept_patches: int | None = None
) -> Complexity:
    """Exact counts from the architecture alone (no tensors allocated, so it works for 120B presets).

    `embed_dim > 0`: the embedding model (neck instead of classifier), as the face task builds it. `distilled`:
    with DeiT's distillation token and head. `kept_patches`: the blocks see only this many patch tokens (token
    dropping; the patch embedding still sees them all).
    """
    d, h, depth = cfg.width, cfg.hidden_dim, cfg.depth
    n_patches = cfg.num_patches  # (num_frames / tubelet_size) x (image_size / patch_size)^2
    n_pos = n_patches + (1 if cfg.pool == "cls" else 0)  # rows of the position table
    n = (n_patches if kept_patches is None else kept_patches) + (1 if cfg.pool == "cls" else 0) + int(distilled)
    qkv_b = 3 * d if cfg.qkv_bias else 0

    block_params = (2 * d) + (3 * d * d + qkv_b) + (d * d + d) + (2 * d) + (d * h + h) + (h * d + d)
    features = features_dim(cfg)
    if embed_dim:  # neck: Linear without bias + BatchNorm1d's weight and bias
        head_params, head_macs, head_out = features * embed_dim + 2 * embed_dim, features * embed_dim, embed_dim
    else:
        head_params, head_macs = features * cfg.num_classes + cfg.num_classes, features * cfg.num_classes
        head_out = cfg.num_classes
    stem_params, stem_macs, stem_acts = _stem_cost(cfg)
    params = stem_params + depth * block_params + 2 * d + head_params
    if cfg.pool == "cls":
        params += d
    if cfg.pos_embed == "learned":
        params += n_pos * d
    if distilled:  # the token and its classifier
        params += d + d * cfg.num_classes + cfg.num_classes
        head_macs += d * cfg.num_classes
        head_out += cfg.num_classes

    # Multiply-adds of the matmuls (including attention's QK^T and AV), per image.
    embed_macs = stem_macs
    block_macs = n * 3 * d * d + 2 * n * n * d + n * d * d + 2 * n * d * h
    macs = embed_macs + depth * block_macs + head_macs

    heads = cfg.heads
    block_acts = (
        n * d  # norm1
        + 3 * n * d  # qkv
        + heads * n * n  # attention scores (materialized by the manual path; sdpa keeps less)
        + n * d  # attention output
        + n * d  # proj
        + n * d  # norm2
        + 2 * n * h  # fc1, gelu
        + n * d  # fc2
    )
    acts = stem_acts + depth * block_acts + n * d + head_out
    return Complexity(
        params=params,
        macs=macs * batch_size,
        flops=2 * macs * batch_size,
        activations=acts * batch_size,
    )


def _stem_cost(cfg: ModelConfig) -> tuple[int, int, int]:
    """(params, multiply-adds, activations) per image of the patch embedding, up to its projection to width."""
    d, p = cfg.width, cfg.patch_size
    n_patches = cfg.num_patches
    if cfg.patch_embed != "conv":  # a tubelet of t frames: a (t, p, p) kernel, t = 1 for images
        kernel = cfg.tubelet_size * p * p * cfg.in_chans
        return kernel * d + d, n_patches * kernel * d, n_patches * d
    params = macs = acts = 0
    size, in_chans = cfg.image_size, cfg.in_chans
    for channels, stride in cfg.stem:
        size = (size - 1) // stride + 1  # 3x3, padding 1
        params += 9 * in_chans * channels + 2 * channels  # conv (no bias) + BatchNorm's weight and bias
        macs += size * size * 9 * in_chans * channels
        acts += 3 * size * size * channels  # conv, norm, relu
        in_chans = channels
    params += in_chans * d + d
    macs += n_patches * in_chans * d
    return params, macs, acts + n_patches * d


def count_parameters(model: nn.Module) -> int:
    return sum(t.numel() for t in model.parameters())


def check_positive(m: ModelConfig, names: tuple[str, ...]) -> None:
    """Each of the model section's `names` above 0, else one line naming the first that is not."""
    for name in names:
        if getattr(m, name) <= 0:
            raise ConfigError(f"model.{name}={getattr(m, name)} must be positive")


def check_rates(m: ModelConfig) -> None:
    """model.drop_path and model.dropout in [0, 1), else one line naming the first that is not."""
    for name in ("drop_path", "dropout"):
        if not 0.0 <= getattr(m, name) < 1.0:
            raise ConfigError(f"model.{name}={getattr(m, name)} must be in [0, 1)")


def check_vit(m: ModelConfig) -> None:
    """Reject a ViT architecture that cannot be built, with one line that says how to fix it."""
    check_positive(m, ("image_size", "patch_size", "in_chans", "num_classes", "width", "depth", "heads"))
    if m.width % m.heads:
        raise ConfigError(
            f"model.width={m.width} is not divisible by model.heads={m.heads}; "
            f"use a width that is a multiple of {m.heads} or change heads"
        )
    if m.image_size % m.patch_size:
        raise ConfigError(
            f"model.patch_size={m.patch_size} does not divide model.image_size={m.image_size}; "
            f"pick an image size that is a multiple of {m.patch_size}"
        )
    if m.patch_embed == "conv":
        strides = m.patch_size.bit_length() - 1
        if m.patch_size != 1 << strides:
            raise ConfigError(
                f"model.patch_embed=conv halves the image with each stride-2 conv: model.patch_size={m.patch_size} "
                "must be a power of two (2, 4, 8, 16)"
            )
        if m.stem_channels and len(m.stem_channels) < strides:
            raise ConfigError(
                f"model.stem_channels={list(m.stem_channels)} has {len(m.stem_channels)} convs but patch_size="
                f"{m.patch_size} needs at least {strides} (one per halving); add channels or use a smaller patch"
            )
        if any(c <= 0 for c in m.stem_channels):
            raise ConfigError(f"model.stem_channels={list(m.stem_channels)} must be positive channel counts")
    if m.mlp_dim is not None and m.mlp_dim <= 0:
        raise ConfigError(f"model.mlp_dim={m.mlp_dim} must be positive (or null for 4 x width)")
    if m.width % 8 or m.hidden_dim % 8:
        warnings.warn(
            f"model.width={m.width} / mlp_dim={m.hidden_dim} is not a multiple of 8: "
            "tensor cores and vector units run fastest on multiples of 8",
            stacklevel=2,
        )
    if m.pos_embed == "sincos" and (m.width // 2) % 2:
        raise ConfigError(f"model.pos_embed=sincos needs model.width divisible by 4, got {m.width}")
    check_rates(m)
