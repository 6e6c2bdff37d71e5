"""Model factory: build a single-device ViT from the model config."""

from __future__ import annotations

from vitrain.config import ModelConfig
from vitrain.models.presets import PRESETS, Preset, find_preset
from vitrain.models.vit import Complexity, EmbeddingNeck, VisionTransformer, complexity, count_parameters

__all__ = [
    "PRESETS",
    "Complexity",
    "EmbeddingNeck",
    "Preset",
    "VisionTransformer",
    "complexity",
    "count_parameters",
    "create_model",
    "find_preset",
]


def create_model(cfg: ModelConfig, embed_dim: int = 0) -> VisionTransformer:
    """A classifier over cfg.num_classes, or with `embed_dim > 0` an embedding model (the face task's backbone)."""
    return VisionTransformer(cfg, embed_dim)
