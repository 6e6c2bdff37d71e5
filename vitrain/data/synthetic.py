"""data.source=synthetic: random images, or random clips for a model that takes clips, for throughput benchmarks."""

from __future__ import annotations

from typing import Any

from vitrain.config import Config
from vitrain.data.sources import synthetic_images
from vitrain.data.video import synthetic_clips


def synthetic_source(cfg: Config) -> tuple[Any, Any]:
    """(train, val) of random samples shaped like the model's input: clips of model.num_frames frames, else images."""
    return synthetic_clips(cfg) if cfg.model.num_frames > 1 else synthetic_images(cfg)
