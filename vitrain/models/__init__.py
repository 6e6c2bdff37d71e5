"""Model factory: build a single-device ViT from the model config."""

from __future__ import annotations

from vitrain.config import ModelConfig
from vitrain.models.presets import PRESETS, Preset, find_preset
from vitrain.models.vit import Complexity, VisionTransformer, complexity, count_parameters

__all__ = [
    "PRESETS",
    "Complexity",
    "Preset",
    "VisionTransformer",
    "complexity",
    "count_parameters",
    "create_model",
    "find_preset",
]


def create_model(cfg: ModelConfig) -> VisionTransformer:
    return VisionTransformer(cfg)
