"""Evaluation under torch.inference_mode: loss, top-1 and top-5 over a whole split."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vitrain.data.loader import BatchLoader
from vitrain.metrics import topk_correct


def evaluate(model: nn.Module, loader: BatchLoader) -> dict[str, float]:
    was_training = model.training
    model.eval()
    total, loss_sum, top1, top5 = 0, 0.0, 0, 0
    with torch.inference_mode():
        for images, labels in loader.epoch(0):
            logits = model(images).float()
            loss_sum += float(F.cross_entropy(logits, labels, reduction="sum"))
            c1, c5 = topk_correct(logits, labels, (1, 5))
            top1, top5, total = top1 + c1, top5 + c5, total + labels.shape[0]
    model.train(was_training)
    if total == 0:
        return {"val_loss": float("nan"), "val_top1": 0.0, "val_top5": 0.0, "val_samples": 0}
    return {
        "val_loss": loss_sum / total,
        "val_top1": top1 / total,
        "val_top5": top5 / total,
        "val_samples": total,
    }
