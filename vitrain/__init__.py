"""vitrain: train Vision Transformers as fast as the hardware allows; the library's names (docs/library.md).

    import vitrain
    summary = vitrain.train("digits", ["train.epochs=2"])
    cfg = vitrain.load_config("digits", ["model.depth=6"]); trainer = vitrain.Trainer(cfg); trainer.fit()

Names are imported on first use, so `import vitrain` stays cheap and the package's layers keep pointing one way.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_NAMES = {
    "train": "vitrain.api",
    "Config": "vitrain.config",
    "Trainer": "vitrain.engine.trainer",
    "TrainStep": "vitrain.engine.step",
    "build_model": "vitrain.models",
    "create_model": "vitrain.models",
    "build_task": "vitrain.tasks",
    "register": "vitrain.registry",
    "export": "vitrain.weights",
}
__all__ = ["__version__", "load_config", *_NAMES]


def load_config(source: Any = None, overrides: list[str] | None = None) -> Any:
    """A validated Config from a recipe name, a YAML path, a dict of sections or a Config, with overrides."""
    return importlib.import_module("vitrain.api").config(source, overrides)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'vitrain' has no attribute {name!r}")
