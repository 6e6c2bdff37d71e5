"""Named ViT architectures: the standard timm family plus large presets up to ~120B parameters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    """Architecture of one named ViT; `mlp_dim` is the hidden width of each block's MLP."""

    name: str
    alias: str
    width: int
    depth: int
    heads: int
    mlp_dim: int
    patch_size: int
    image_size: int = 224
    # timm model that has exactly this architecture (None for vitrain's own large presets).
    timm_name: str | None = None
    num_frames: int = 1  # > 1: a space-time video ViT (model.name=video_vit) over clips of this many frames
    tubelet_size: int = 1  # video: frames per tubelet token
    stages: tuple[int, ...] = ()  # MViTv2 (model.name=mvit): blocks per stage; width and heads are the first stage's
    drop_path: float = 0.0  # MViTv2: the published stochastic depth (its head dropout is 0.5 for every size)

    @property
    def is_video(self) -> bool:
        return self.num_frames > 1


def _mvitv2(name: str, alias: str, stages: tuple[int, ...], num_frames: int, drop_path: float) -> Preset:
    """An MViTv2 as Li et al. 2022 size them for video: width 96 and one head in the first stage, a 4x MLP, 3x7x7
    tubes of stride 2x4x4 over 224 px frames."""
    return Preset(name, alias, 96, sum(stages), 1, 384, 4, num_frames=num_frames, tubelet_size=2, stages=stages,
                  drop_path=drop_path)  # fmt: skip


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset("vit_tiny_patch16", "ViT-Ti/16", 192, 12, 3, 768, 16, timm_name="vit_tiny_patch16_224"),
        Preset("vit_small_patch16", "ViT-S/16", 384, 12, 6, 1536, 16, timm_name="vit_small_patch16_224"),
        Preset("vit_base_patch16", "ViT-B/16", 768, 12, 12, 3072, 16, timm_name="vit_base_patch16_224"),
        Preset("vit_large_patch16", "ViT-L/16", 1024, 24, 16, 4096, 16, timm_name="vit_large_patch16_224"),
        Preset("vit_huge_patch14", "ViT-H/14", 1280, 32, 16, 5120, 14, timm_name="vit_huge_patch14_224"),
        # g/14 and G/14 use timm's non-4x MLP ratios (48/11 and 64/13), giving hidden widths 6144 and 8192.
        Preset("vit_giant_patch14", "ViT-g/14", 1408, 40, 16, 6144, 14, timm_name="vit_giant_patch14_224"),
        Preset("vit_gigantic_patch14", "ViT-G/14", 1664, 48, 16, 8192, 14, timm_name="vit_gigantic_patch14_224"),
        # Space-time ViTs as VideoMAE builds them (Tong et al. 2022): 16 frames of 224 px in 2x16x16 tubelets (1,568
        # tokens), joint space-time attention, mean pooling, fixed sine-cosine positions (tests/test_video.py).
        Preset("video_vit_tiny_patch16", "ViViT-Ti/16x2", 192, 12, 3, 768, 16, num_frames=16, tubelet_size=2),
        Preset("video_vit_small_patch16", "ViViT-S/16x2", 384, 12, 6, 1536, 16, num_frames=16, tubelet_size=2),
        Preset("video_vit_base_patch16", "ViViT-B/16x2", 768, 12, 12, 3072, 16, num_frames=16, tubelet_size=2),
        # MViTv2-S as Li et al. 2022 train it on Kinetics-400 (16 frames of 224 px, 3x7x7 embedding of stride 2x4x4,
        # stages of 1, 2, 11 and 2 blocks from width 96 and one head): vitrain/models/mvit.py, tests/test_mvit.py.
        _mvitv2("mvitv2_small", "MViTv2-S", (1, 2, 11, 2), num_frames=16, drop_path=0.2),
        # MViTv2-B on 32 frames (the paper's 32x3): stages of 2, 3, 16 and 3 blocks, the same widths and strides.
        _mvitv2("mvitv2_base", "MViTv2-B", (2, 3, 16, 3), num_frames=32, drop_path=0.3),
        # Large presets: 4x MLP, head dim 128, width a multiple of 1024 so that every matmul tiles well.
        Preset("vit_10b_patch14", "ViT-10B/14", 5120, 32, 40, 20480, 14),
        Preset("vit_22b_patch14", "ViT-22B/14", 6144, 48, 48, 24576, 14),
        Preset("vit_60b_patch14", "ViT-60B/14", 8192, 74, 64, 32768, 14),
        Preset("vit_120b_patch14", "ViT-120B/14", 12288, 66, 96, 49152, 14),
    ]
}

_BY_ALIAS = {p.alias.lower(): p for p in PRESETS.values()}


def find_preset(name: str) -> Preset | None:
    """Look a preset up by its name (`vit_base_patch16`) or alias (`ViT-B/16`), ignoring case."""
    key = name.strip().lower()
    return PRESETS.get(key) or _BY_ALIAS.get(key)


def preset_names() -> list[str]:
    return list(PRESETS)
