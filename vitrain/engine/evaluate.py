"""Evaluation under torch.inference_mode: loss, top-1 and top-5 over a whole split, sharded over the ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vitrain.data.loader import PAD_LABEL, BatchLoader
from vitrain.metrics import topk_correct
from vitrain.parallel import sum_over_ranks


def evaluate(model: nn.Module, loader: BatchLoader) -> dict[str, float]:
    """Each rank runs its share of the split (padding labelled PAD_LABEL counts nowhere); the sums are added.

    Under pipelining `model` returns None on the ranks without the last stage: their replica's last stage counts.
    """
    was_training = model.training
    model.eval()
    total, loss_sum, top1, top5 = 0, 0.0, 0, 0
    with torch.inference_mode():
        for images, labels in loader.epoch(0):
            output = model(images)
            if output is None:
                continue
            logits = output.float()
            loss_sum += float(F.cross_entropy(logits, labels, reduction="sum", ignore_index=PAD_LABEL))
            c1, c5 = topk_correct(logits, labels, (1, 5))  # a PAD_LABEL never matches a class index
            top1, top5, total = top1 + c1, top5 + c5, total + int((labels != PAD_LABEL).sum())
    model.train(was_training)
    sums = torch.tensor([loss_sum, top1, top5, total], dtype=torch.float64, device=loader.device)
    loss_sum, top1, top5, total = sum_over_ranks(sums).tolist()
    if total == 0:
        return {"val_loss": float("nan"), "val_top1": 0.0, "val_top5": 0.0, "val_samples": 0}
    return {
        "val_loss": loss_sum / total,
        "val_top1": top1 / total,
        "val_top5": top5 / total,
        "val_samples": int(total),
    }
