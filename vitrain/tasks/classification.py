"""Image classification: a linear classifier inside the model, cross-entropy, top-1/top-5; best = highest val_top1.

With train.distill.teacher the ViT gains DeiT's distillation token and head, the task a teacher (vitrain/tasks/
distill.py) and its loss the teacher's term."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vitrain.config import Config
from vitrain.data import build_loaders
from vitrain.errors import ConfigError
from vitrain.models import VisionTransformer, build_model
from vitrain.tasks.distill import Taught, Teacher, distillation_loss, load_teacher
from vitrain.tasks.evaluate import evaluate


class ClassificationTask:
    name = "classification"
    best_metric = "val_top1"
    higher_is_better = True
    summary_defaults = {"val_top1": 0.0, "val_top5": 0.0}  # summary.json's fields before any evaluation

    def __init__(self, cfg: Config, model: Any = None, data: Any = None):
        self.cfg = cfg
        self.model = model  # a module or factory from the library caller; None: the one model.name names
        self.data = data  # (train, val) datasets or a function of the config making them; None: data.source's
        self.val_loader: Any = None
        self.classes: list[str] | None = None  # the training data's class names (checkpoints and exports keep them)

    def build_data(self, device: torch.device, rank: int, world_size: int) -> Any:
        train, self.val_loader = build_loaders(self.cfg, device, rank, world_size, self.data)
        self.classes = getattr(train.data, "classes", None)
        return train

    def build_model(self) -> nn.Module:
        if not self.cfg.train.distill.teacher:
            return build_model(self.cfg.model, model=self.model)
        if self.model is not None:
            raise ConfigError(
                "train.distill.teacher gives vitrain's ViT a distillation token; a model handed to the library has "
                "none: leave the model to model.name=vit or drop train.distill.teacher"
            )
        return VisionTransformer(self.cfg.model, distilled=True)

    def build_head(self, device: torch.device) -> None:
        return None

    def teacher(self, engine: Any) -> Teacher | None:
        """train.distill.teacher loaded and set up by `engine` (its precision and sharding); None without one."""
        if not self.cfg.train.distill.teacher:
            return None
        return Teacher(engine.frozen(load_teacher(self.cfg)))

    def loss(self, output: Any, labels: torch.Tensor | Taught) -> torch.Tensor:
        if isinstance(labels, Taught):  # the step added the teacher's logits (train.distill)
            return distillation_loss(output, labels, self.cfg)
        check_logits(output, labels.shape[0], self.cfg.model.num_classes)
        return F.cross_entropy(output.float(), labels, label_smoothing=self.cfg.train.label_smoothing)

    def evaluate(self, forward: nn.Module, final: bool, out_dir: Path) -> dict[str, Any]:
        return evaluate(forward, self.val_loader, flip=self.cfg.train.eval_flip)

    def eval_line(self, metrics: dict[str, Any]) -> str:
        top1, top5, loss = metrics["val_top1"], metrics["val_top5"], metrics["val_loss"]
        line = f"val_top1={top1:.4f} val_top5={top5:.4f} val_loss={loss:.4f}"
        return line + (f" val_top1_flip={metrics['val_top1_flip']:.4f}" if "val_top1_flip" in metrics else "")

    def describe_data(self) -> str:
        return f"{len(self.val_loader.data)} val images"


def check_logits(output: Any, batch: int, num_classes: int) -> None:
    """A model's output is a tensor of logits (batch, model.num_classes), else one ConfigError line: a few Python
    comparisons per step (top-5 over another number of classes would otherwise train silently)."""
    shape = tuple(output.shape) if isinstance(output, torch.Tensor) else None
    if shape != (batch, num_classes):
        got = f"shape {shape}" if shape is not None else f"a {type(output).__name__}"
        raise ConfigError(
            f"the model's output is {got}, but classification takes logits of shape (batch, model.num_classes) = "
            f"({batch}, {num_classes}): set model.num_classes to the model's number of outputs, or make it return one "
            "tensor of that shape"
        )
