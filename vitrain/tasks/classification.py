"""Image classification: a linear classifier inside the model, cross-entropy, top-1/top-5; best = highest val_top1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vitrain.config import Config
from vitrain.data import build_loaders
from vitrain.models import build_model
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

    def build_data(self, device: torch.device, rank: int, world_size: int) -> Any:
        train, self.val_loader = build_loaders(self.cfg, device, rank, world_size, self.data)
        return train

    def build_model(self) -> nn.Module:
        return build_model(self.cfg.model, model=self.model)

    def build_head(self, device: torch.device) -> None:
        return None

    def loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.float(), labels, label_smoothing=self.cfg.train.label_smoothing)

    def evaluate(self, forward: nn.Module, final: bool, out_dir: Path) -> dict[str, Any]:
        return evaluate(forward, self.val_loader, flip=self.cfg.train.eval_flip)

    def eval_line(self, metrics: dict[str, Any]) -> str:
        top1, top5, loss = metrics["val_top1"], metrics["val_top5"], metrics["val_loss"]
        line = f"val_top1={top1:.4f} val_top5={top5:.4f} val_loss={loss:.4f}"
        return line + (f" val_top1_flip={metrics['val_top1_flip']:.4f}" if "val_top1_flip" in metrics else "")

    def describe_data(self) -> str:
        return f"{len(self.val_loader.data)} val images"
