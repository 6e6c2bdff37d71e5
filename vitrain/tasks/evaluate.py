"""Evaluation under torch.inference_mode: loss, top-1 and top-5 over a whole split, sharded over the ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vitrain.data.loader import PAD_LABEL, BatchLoader
from vitrain.metrics import topk_correct
from vitrain.parallel import sum_over_ranks


def evaluate(model: nn.Module, loader: BatchLoader, flip: bool = False) -> dict[str, float]:
    """Each rank runs its share of the split (padding labelled PAD_LABEL counts nowhere); the sums are added.

    `flip`: also score the logits of each image plus those of its mirror image (test-time flip averaging), as
    val_*_flip fields beside the plain ones. Under pipelining `model` returns None on the ranks without the last
    stage: their replica's last stage counts.
    """
    was_training = model.training
    model.eval()
    sums = torch.zeros(2 if flip else 1, 4, dtype=torch.float64)  # rows: plain, flip; (loss, top1, top5, n)
    with torch.inference_mode():
        for images, labels in loader.epoch(0):
            output = model(images)
            # Every stage of a pipeline runs the mirror image's forward too, before a rank without the last stage
            # moves on: one that skipped it left the last stage reading the next batch's activations (a hang).
            mirrored = model(images.flip(-1)) if flip else None
            if output is None:
                continue
            logits = output.float()
            _count(sums[0], logits, labels)
            if mirrored is not None:
                _count(sums[1], logits + mirrored.float(), labels, scale=0.5)
    model.train(was_training)
    sums = sum_over_ranks(sums.to(loader.device)).cpu()
    metrics: dict[str, float] = {}
    for row, suffix in zip(sums.tolist(), ("", "_flip"), strict=False):
        loss_sum, top1, top5, total = row
        if total == 0:
            metrics |= {f"val_loss{suffix}": float("nan"), f"val_top1{suffix}": 0.0, f"val_top5{suffix}": 0.0}
        else:
            metrics |= {
                f"val_loss{suffix}": loss_sum / total,
                f"val_top1{suffix}": top1 / total,
                f"val_top5{suffix}": top5 / total,
            }
        if not suffix:
            metrics["val_samples"] = int(total)
    return metrics


def _count(into: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, scale: float = 1.0) -> None:
    """Add one batch's summed loss, top-1 and top-5 hits and sample count to `into` (logits x `scale` for the loss)."""
    loss = float(F.cross_entropy(logits * scale, labels, reduction="sum", ignore_index=PAD_LABEL))
    c1, c5 = topk_correct(logits, labels, (1, 5))  # a PAD_LABEL never matches a class index
    into += torch.tensor([loss, c1, c5, int((labels != PAD_LABEL).sum())], dtype=torch.float64)
