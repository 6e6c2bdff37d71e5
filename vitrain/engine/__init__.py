"""Training loop and evaluation."""

from vitrain.engine.evaluate import evaluate
from vitrain.engine.trainer import Trainer, resolve_device

__all__ = ["Trainer", "evaluate", "resolve_device"]
