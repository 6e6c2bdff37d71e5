"""Training loop and evaluation."""

from vitrain.engine.trainer import Trainer, resolve_device
from vitrain.tasks.evaluate import evaluate

__all__ = ["Trainer", "evaluate", "resolve_device"]
