"""MViTv2 for clips: pooling attention over a space-time grid that shrinks stage by stage (`model.name=mvit`).

Li et al. 2022 ("MViTv2: Improved Multiscale Vision Transformers for Classification and Detection"), the video model
of the large-model source. A clip is embedded by an overlapping Conv3d (kernel 2t-1 x 2p-1 x 2p-1, stride t x p x p:
MViTv2-S's 3x7x7 / 2x4x4), a class token is put in front, and `model.stages` stages of blocks follow. Stage s has
width `width * 2^s`, `heads * 2^s` heads (the head width stays the same) and an MLP of `hidden_dim * 2^s`. Its first
block (s > 0) halves the grid's height and width by pooling the queries (and max-pooling the residual), and
projects the channels up after the attention. Every block pools its queries, keys and values with a depthwise
3x3x3 convolution followed by a LayerNorm. The keys and values are pooled with stride 2^(stages-1-s), so that every
stage attends to the last stage's grid. MViTv2's two changes over MViT are here: decomposed relative positions (a
bias from the query and a table per axis: time, height and width) and the pooled query added back to the
attention's output (residual pooling). The class token is not pooled.

The shapes of every block follow from the config alone (`block_shapes`), so a block holds its input grid and takes
only the tokens, like the image ViT's: FSDP units, activation checkpointing and the precision policies apply
unchanged (`parallel_plan`). `complexity` counts parameters and multiply-adds exactly (a test holds it to torch's
FLOP counter). `model.attention`: manual (products and softmax) or sdpa (the relative positions as its additive
mask); the same function.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vitrain.config import ModelConfig
from vitrain.errors import CheckpointError, ConfigError
from vitrain.models.plan import ParallelPlan, fp32_layers
from vitrain.models.vit import Complexity, DropPath, Mlp, check_positive, check_rates

Grid = tuple[int, int, int]  # (time, height, width) of a token map

# torchvision's MViTv2 names (torchvision/models/video/mvit.py, the mvit_v2_s weights file) -> vitrain's.
TORCHVISION_NAMES = (
    (r"^conv_proj\.", "patch_embed."),
    (r"^pos_encoding\.class_token$", "cls_token"),
    (r"^head\.1\.", "head."),  # head.0 is its dropout
    (r"\.attn\.project\.0\.", ".attn.proj."),
    (r"\.attn\.pool_([qkv])\.pool\.", r".attn.pool_\1.conv."),
    (r"\.attn\.pool_([qkv])\.norm_act\.0\.", r".attn.pool_\1.norm."),
    (r"\.mlp\.0\.", ".mlp.fc1."),
    (r"\.mlp\.3\.", ".mlp.fc2."),
)


def pooled(size: int, stride: int) -> int:
    """Positions along one axis after a pooling of kernel 3 (stride + 1 for the residual's max pool), padding 1."""
    return (size - 1) // stride + 1


@dataclass(frozen=True)
class BlockShape:
    """One block's sizes: channels in and out, heads, MLP width, and the grids it reads, queries and attends to."""

    dim_in: int
    dim_out: int
    heads: int
    hidden: int
    q_stride: int  # spatial stride of the query (and residual) pooling: 2 in a stage's first block, else 1
    kv_stride: int  # spatial stride of the key and value pooling
    grid_in: Grid
    grid_q: Grid
    grid_kv: Grid

    @property
    def head_dim(self) -> int:
        return self.dim_out // self.heads

    @property
    def table_size(self) -> int:
        """Rows of the height and width relative-position tables: every offset between a query and a key row."""
        return 2 * max(self.grid_q[1], self.grid_kv[1]) - 1


def embed_grid(cfg: ModelConfig) -> Grid:
    side = cfg.image_size // cfg.patch_size
    return (cfg.num_frames // cfg.tubelet_size, side, side)


def block_shapes(cfg: ModelConfig) -> list[BlockShape]:
    """Every block's shape, in order, from the model config alone."""
    grid = embed_grid(cfg)
    last = len(cfg.stages) - 1
    shapes = []
    for s, count in enumerate(cfg.stages):
        for i in range(count):
            q_stride = 2 if s > 0 and i == 0 else 1
            kv_stride = 1 << (last - s)
            dim_in = cfg.width << (s - 1) if s > 0 and i == 0 else cfg.width << s
            t, h, w = grid
            grid_q = (t, pooled(h, q_stride), pooled(w, q_stride))
            grid_kv = (t, pooled(h, kv_stride), pooled(w, kv_stride))
            shape = BlockShape(
                dim_in, cfg.width << s, cfg.heads << s, cfg.hidden_dim << s, q_stride, kv_stride, grid, grid_q, grid_kv
            )
            shapes.append(shape)
            grid = grid_q
    return shapes


def tokens(grid: Grid) -> int:
    """Tokens of a grid with the class token in front."""
    return 1 + grid[0] * grid[1] * grid[2]


def pool_tokens(x: torch.Tensor, pool: nn.Module, grid: Grid) -> tuple[torch.Tensor, Grid]:
    """(B, H, 1 + T*Hg*Wg, C) tokens -> `pool` over their grid, the class token kept in front; and the new grid."""
    b, heads, _, c = x.shape
    cls, rest = x[:, :, :1], x[:, :, 1:]
    # Contiguous: torch 2.13's CPU bf16 depthwise Conv3d gets its weight gradient wrong (and different each call)
    # from an input with channels-last strides, as this permuted grid has (tests/test_mvit.py).
    rest = rest.reshape(b * heads, *grid, c).permute(0, 4, 1, 2, 3).contiguous()
    rest = pool(rest)
    new = (rest.shape[2], rest.shape[3], rest.shape[4])
    rest = rest.flatten(2).transpose(1, 2).reshape(b, heads, -1, c)
    return torch.cat([cls, rest], dim=2), new


class AttentionPool(nn.Module):
    """A depthwise 3x3x3 convolution over each head's token grid (shared by the heads), then a LayerNorm."""

    def __init__(self, dim: int, stride: int, grid: Grid):
        super().__init__()
        self.grid = grid
        self.conv = nn.Conv3d(dim, dim, 3, stride=(1, stride, stride), padding=1, groups=dim, bias=False)
        self.norm = nn.LayerNorm(dim, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(pool_tokens(x, self.conv, self.grid)[0])


def offsets(q: int, k: int) -> torch.Tensor:
    """(q, k) rows of a relative-position table for query i and key j along one axis: the grids' spacings scaled to
    the finer one, shifted to start at row 0 (MViTv2's decomposed relative positions)."""
    q_ratio, k_ratio = max(k / q, 1.0), max(q / k, 1.0)
    i = torch.arange(q, dtype=torch.float64)[:, None]
    j = torch.arange(k, dtype=torch.float64)[None, :]
    return (i * q_ratio - (j - (k - 1)) * k_ratio).long()


class PoolingAttention(nn.Module):
    """Multi-head attention with pooled queries, keys and values, relative positions and residual pooling."""

    def __init__(self, shape: BlockShape, qkv_bias: bool, kernel: str):
        super().__init__()
        self.shape, self.kernel = shape, kernel
        heads, hd = shape.heads, shape.head_dim
        self.scale = hd**-0.5
        self.qkv = nn.Linear(shape.dim_in, 3 * shape.dim_out, bias=qkv_bias)
        self.proj = nn.Linear(shape.dim_out, shape.dim_out)
        self.pool_q = AttentionPool(hd, shape.q_stride, shape.grid_in)
        self.pool_k = AttentionPool(hd, shape.kv_stride, shape.grid_in)
        self.pool_v = AttentionPool(hd, shape.kv_stride, shape.grid_in)
        self.rel_pos_h = nn.Parameter(torch.zeros(shape.table_size, hd))
        self.rel_pos_w = nn.Parameter(torch.zeros(shape.table_size, hd))
        self.rel_pos_t = nn.Parameter(torch.zeros(2 * shape.grid_in[0] - 1, hd))
        (tq, hq, wq), (tk, hk, wk) = shape.grid_q, shape.grid_kv
        for axis, q, k in (("t", tq, tk), ("h", hq, hk), ("w", wq, wk)):
            self.register_buffer(f"rows_{axis}", offsets(q, k), persistent=False)
        self.heads = heads

    def relative_bias(self, q: torch.Tensor) -> torch.Tensor:
        """(B, H, 1 + Nq, hd) pooled queries -> (B, H, Nq, Nk) bias over the grid tokens (not the class token's)."""
        b, heads, _, hd = q.shape
        (tq, hq, wq), (tk, hk, wk) = self.shape.grid_q, self.shape.grid_kv
        grid_q = q[:, :, 1:].reshape(b, heads, tq, hq, wq, hd)
        along_t = torch.einsum("bntyxc,tkc->bntyxk", grid_q, self.rel_pos_t[self.rows_t])
        along_h = torch.einsum("bntyxc,ykc->bntyxk", grid_q, self.rel_pos_h[self.rows_h])
        along_w = torch.einsum("bntyxc,xkc->bntyxk", grid_q, self.rel_pos_w[self.rows_w])
        bias = along_t[..., :, None, None] + along_h[..., None, :, None] + along_w[..., None, None, :]
        return bias.reshape(b, heads, tq * hq * wq, tk * hk * wk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        q, k, v = self.pool_q(q), self.pool_k(k), self.pool_v(v)
        bias = self.relative_bias(q)
        if self.kernel == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=F.pad(bias, (1, 0, 1, 0)).to(q.dtype))
        else:
            scores = torch.matmul(q * self.scale, k.transpose(-2, -1))
            scores[:, :, 1:, 1:] += bias
            out = torch.matmul(scores.softmax(dim=-1), v)
        # Residual pooling: the pooled query added, not the class token's. Out of place: a fused kernel (sdpa on a
        # GPU) may keep its output for backward.
        out = out + F.pad(q[:, :, 1:], (0, 0, 1, 0))
        return self.proj(out.transpose(1, 2).reshape(b, -1, self.shape.dim_out))


class MultiscaleBlock(nn.Module):
    """Pre-norm block: the pooled (and projected) input + attention, then + MLP; it takes and gives tokens only."""

    def __init__(self, shape: BlockShape, cfg: ModelConfig, drop_path: float):
        super().__init__()
        self.shape = shape
        self.norm1 = nn.LayerNorm(shape.dim_in, eps=1e-6)
        self.attn = PoolingAttention(shape, cfg.qkv_bias, cfg.attention)
        self.norm2 = nn.LayerNorm(shape.dim_out, eps=1e-6)
        self.mlp = Mlp(shape.dim_out, shape.hidden, 0.0)
        self.drop_path = DropPath(drop_path, batch_dim=0)
        self.project = nn.Linear(shape.dim_in, shape.dim_out) if shape.dim_in != shape.dim_out else None
        s = shape.q_stride
        self.skip = nn.MaxPool3d((1, s + 1, s + 1), (1, s, s), (0, 1, 1)) if s > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm1(x)
        attended = self.attn(y)
        if self.project is not None:
            x = self.project(y)
        if self.skip is not None:
            x = pool_tokens(x.unsqueeze(1), self.skip, self.shape.grid_in)[0].squeeze(1)
        x = x + self.drop_path(attended)
        return x + self.drop_path(self.mlp(self.norm2(x)))


class MViT(nn.Module):
    """Clips (B, T*C, H, W) frame-major, as the loader gives them, or (B, C, T, H, W) -> class logits."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        check(cfg)
        self.cfg = cfg
        t, p = cfg.tubelet_size, cfg.patch_size
        self.patch_embed = nn.Conv3d(
            cfg.in_chans, cfg.width, (2 * t - 1, 2 * p - 1, 2 * p - 1), stride=(t, p, p), padding=(t - 1, p - 1, p - 1)
        )
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.width))
        shapes = block_shapes(cfg)
        rates = torch.linspace(0, cfg.drop_path, len(shapes), device="cpu").tolist()
        self.blocks = nn.ModuleList(MultiscaleBlock(s, cfg, r) for s, r in zip(shapes, rates, strict=True))
        self.num_features = shapes[-1].dim_out
        self.norm = nn.LayerNorm(self.num_features, eps=1e-6)
        self.head_drop = nn.Dropout(cfg.dropout)
        self.head = nn.Linear(self.num_features, cfg.num_classes)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, PoolingAttention):
                for table in (module.rel_pos_t, module.rel_pos_h, module.rel_pos_w):
                    nn.init.trunc_normal_(table, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)

    def forward(self, clips: torch.Tensor) -> torch.Tensor:
        if clips.ndim == 4:  # (B, T*C, H, W) -> (B, C, T, H, W)
            b, _, h, w = clips.shape
            clips = clips.view(b, self.cfg.num_frames, self.cfg.in_chans, h, w).transpose(1, 2)
        x = self.patch_embed(clips).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        for block in self.blocks:
            x = block(x)
        return self.head(self.head_drop(self.norm(x)[:, 0]))

    def complexity(self, batch_size: int = 1) -> Complexity:
        return complexity(self.cfg, batch_size)

    def pretrained_state(self, state: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
        """`state` (vitrain's names, or torchvision's MViTv2 weights file) in this model's names, its relative-position
        tables resampled to this model's lengths where it was trained on another clip size (model.init_from). What
        still differs is for the caller to name (vitrain/weights.py), a classifier of another size among it."""
        if any(k.startswith("pos_encoding.") and k != "pos_encoding.class_token" for k in state):
            raise CheckpointError(
                f"{where} holds absolute position tables (MViTv1); model.name=mvit is MViTv2, with relative positions"
            )
        if "conv_proj.weight" in state:
            state = from_torchvision(state)
        own, out = self.state_dict(), dict(state)
        for key, table in state.items():
            mine = own.get(key)
            if re.search(r"\.attn\.rel_pos_[thw]$", key) and mine is not None and table.ndim == mine.ndim == 2:
                if table.shape[1] == mine.shape[1] and table.shape[0] != mine.shape[0]:
                    out[key] = resample_table(table, mine.shape[0])
        return out

    def parallel_plan(self, wrap: str) -> ParallelPlan:
        """Each block a sharding and checkpointing unit (sublayer: its attention and MLP too). The blocks differ by
        stage: a timing probe feeds one block of each shape its own input and weighs it by the blocks of that shape."""
        blocks = list(self.blocks)
        units: list[nn.Module] = [sub for b in blocks for sub in (b.attn, b.mlp)] if wrap == "sublayer" else []
        units += blocks if wrap in ("block", "sublayer") else []
        shapes = block_shapes(self.cfg)
        kinds: dict[BlockShape, list[int]] = {}
        for i, shape in enumerate(shapes):
            kinds.setdefault(shape, []).append(i)
        counted = tuple((found[0], len(found)) for found in kinds.values())

        def block_input_shape(n: int, i: int = 0) -> tuple[int, ...]:
            return (n, tokens(shapes[i].grid_in), shapes[i].dim_in)

        return ParallelPlan(units, blocks, *fp32_layers(self, blocks), block_input_shape, counted)


def from_torchvision(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A torchvision MViTv2 state dict in vitrain's names (its class token, a vector there, as vitrain's (1, 1, C))."""
    out = {}
    for key, tensor in state.items():
        for pattern, name in TORCHVISION_NAMES:
            key = re.sub(pattern, name, key)
        out[key] = tensor.reshape(1, 1, -1) if key == "cls_token" and tensor.ndim == 1 else tensor
    return out


def resample_table(table: torch.Tensor, rows: int) -> torch.Tensor:
    """A (L, C) relative-position table resampled linearly to (rows, C): what torchvision's MViT does to its tables
    at run time on a clip of another size, so that its weights compute the same function here."""
    line = table.detach().float().t().unsqueeze(0)  # (1, C, L)
    return F.interpolate(line, size=rows, mode="linear").squeeze(0).t().to(table.dtype)


def build_mvit(cfg: ModelConfig, embed_dim: int = 0) -> MViT:
    """The registry's `mvit`: a clip classifier over cfg.num_classes."""
    if embed_dim:
        raise ConfigError("model.name=mvit is a clip classifier; it has no embedding head: use task.name=video")
    return MViT(cfg)


def complexity(cfg: ModelConfig, batch_size: int = 1) -> Complexity:
    """Exact parameters and multiply-adds of the convolutions, linear layers and attention products (relative
    positions included) of one forward pass; activations: the elements a training step keeps for backward (what
    the memory model counts; a max pool's int64 indices as two elements each)."""
    t, p, d = cfg.tubelet_size, cfg.patch_size, cfg.width
    kernel = (2 * t - 1) * (2 * p - 1) ** 2
    shapes = block_shapes(cfg)
    n0 = tokens(embed_grid(cfg)) - 1
    params = cfg.in_chans * kernel * d + d + d  # embedding conv and bias, class token
    macs = n0 * cfg.in_chans * kernel * d
    acts = cfg.in_chans * cfg.num_frames * cfg.image_size**2  # the clip, kept by the embedding
    for s in shapes:
        hd, heads = s.head_dim, s.heads
        n_in, n_q, n_kv = tokens(s.grid_in), tokens(s.grid_q), tokens(s.grid_kv)
        tk, hk, wk = s.grid_kv
        qkv_bias = 3 * s.dim_out if cfg.qkv_bias else 0
        params += 2 * s.dim_in + s.dim_in * 3 * s.dim_out + qkv_bias + s.dim_out * s.dim_out + s.dim_out
        params += 3 * (27 * hd + 2 * hd) + (2 * s.table_size + 2 * s.grid_in[0] - 1) * hd
        params += 2 * s.dim_out + 2 * s.dim_out * s.hidden + s.hidden + s.dim_out
        macs += n_in * s.dim_in * 3 * s.dim_out
        macs += 27 * hd * heads * ((n_q - 1) + 2 * (n_kv - 1))
        macs += heads * (n_q - 1) * hd * (tk + hk + wk)  # relative positions: one product per axis
        macs += 2 * heads * n_q * n_kv * hd + n_q * s.dim_out * s.dim_out + 2 * n_q * s.dim_out * s.hidden
        # The block's input and first norm; each pooling's input copy, its norm's input and output; the scaled
        # queries, the softmax's output and the heads merged for the projection; the residual sum and the second
        # norm; the MLP's hidden layer before and after GELU; with drop path, the two branches it scales.
        acts += 2 * n_in * s.dim_in + 3 * (n_in - 1) * s.dim_out + 2 * (n_q + 2 * n_kv) * s.dim_out
        acts += heads * n_q * n_kv + 2 * n_q * s.dim_out + 2 * n_q * s.dim_out + 2 * n_q * s.hidden
        acts += 2 * n_q * s.dim_out if cfg.drop_path > 0 else 0
        acts += 2 * (n_in + heads * (n_q + 2 * n_kv) + n_q)  # each LayerNorm's mean and inverse deviation per token
        acts += (n_q - 1) * s.dim_out  # the queries the time axis's relative product reads, copied into its layout
        if s.dim_in != s.dim_out:
            params += s.dim_in * s.dim_out + s.dim_out
            macs += n_in * s.dim_in * s.dim_out
        if s.q_stride > 1:  # the residual's max pool: its input copy and the indices of its maxima
            acts += (n_in - 1) * s.dim_out + 2 * (n_q - 1) * s.dim_out
    last = shapes[-1].dim_out
    params += 2 * last + last * cfg.num_classes + cfg.num_classes
    macs += last * cfg.num_classes
    acts += tokens(shapes[-1].grid_q) * (2 * last + 2)  # the final norm's input, output and statistics
    return Complexity(params, macs * batch_size, 2 * macs * batch_size, acts * batch_size)


def check(m: ModelConfig) -> None:
    """What MViTv2 asks of the model section, one line per fault."""
    check_positive(
        m, ("image_size", "patch_size", "in_chans", "num_classes", "width", "heads", "num_frames", "tubelet_size")
    )
    if m.mlp_dim is not None and m.mlp_dim <= 0:
        raise ConfigError(f"model.mlp_dim={m.mlp_dim} must be positive (or null for 4 x width)")
    check_rates(m)
    if m.layout != "batch_first" or m.pos_embed != "learned" or m.patch_embed != "linear" or m.stem_channels:
        raise ConfigError(
            "model.name=mvit embeds clips with its own overlapping Conv3d and relative positions, batch first: leave "
            "model.layout, pos_embed, patch_embed and stem_channels at their defaults"
        )
    if not m.stages or any(n < 1 for n in m.stages):
        raise ConfigError(
            f"model.stages={list(m.stages)} must give each stage's blocks (MViTv2-S: [1, 2, 11, 2]); set "
            "model.preset=mvitv2_small or model.stages"
        )
    if sum(m.stages) != m.depth:
        raise ConfigError(
            f"model.depth={m.depth} must equal the blocks of model.stages={list(m.stages)} ({sum(m.stages)})"
        )
    if m.num_frames % m.tubelet_size or m.image_size % m.patch_size:
        raise ConfigError(
            f"model.num_frames={m.num_frames} must be a multiple of model.tubelet_size={m.tubelet_size} and "
            f"model.image_size={m.image_size} of model.patch_size={m.patch_size} (the embedding's strides)"
        )
    if m.width % m.heads:
        raise ConfigError(f"model.width={m.width} must be divisible by model.heads={m.heads}")
    side = m.image_size // m.patch_size
    if side < 1 << (len(m.stages) - 1):
        raise ConfigError(
            f"model.image_size={m.image_size} gives a {side}x{side} grid; {len(m.stages)} stages halve it "
            f"{len(m.stages) - 1} times: give at least {m.patch_size << (len(m.stages) - 1)} px or fewer stages"
        )
    if m.pool != "cls" or m.inflate_from:
        raise ConfigError(
            "model.name=mvit classifies from its class token and is not inflated from an image model: leave "
            "model.pool=cls and model.inflate_from empty (model.init_from takes an MViTv2's weights: vitrain's export "
            "or torchvision's mvit_v2_s file)"
        )
