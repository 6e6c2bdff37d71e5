"""Classification metrics computed from logits."""

from __future__ import annotations

import torch


def topk_correct(logits: torch.Tensor, labels: torch.Tensor, ks: tuple[int, ...] = (1, 5)) -> list[int]:
    """Number of samples whose label is among the k highest logits, for each k (k capped at the class count)."""
    k_max = min(max(ks), logits.shape[1])
    top = logits.topk(k_max, dim=1).indices
    hits = top == labels[:, None]
    return [int(hits[:, : min(k, k_max)].any(dim=1).sum()) for k in ks]
