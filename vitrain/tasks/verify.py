"""Face verification: embed the images of pair sets (sharded over ranks, gathered), score pairs by cosine, report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from vitrain.data.augment import BatchAugment
from vitrain.data.faces import Pairs
from vitrain.data.loader import epoch_order
from vitrain.metrics import format_tpr_at_far, plot_roc, roc, verification_report
from vitrain.parallel.distributed import rank, world_size

FARS = (0.1, 0.01, 0.001)


def embed_images(
    forward: torch.nn.Module,
    images: torch.Tensor,
    normalize: BatchAugment,
    batch_size: int,
    device: torch.device,
    flip_fusion: bool = True,
) -> torch.Tensor:
    """L2-normalized fp32 embeddings (M, D) of uint8 images (M, C, H, W), the same tensor on every rank.

    Each rank embeds its share (padded to equal shares: a sharded model's forward is collective); the shares are
    all-gathered. Flip fusion adds the embedding of the mirrored image before normalizing.
    """
    was_training = forward.training
    forward.eval()
    n, ranks = images.shape[0], world_size()
    shares = [epoch_order(n, 0, 0, False, r, ranks, drop_last=False) for r in range(ranks)]
    mine, parts = shares[rank()], []
    with torch.inference_mode():
        for start in range(0, mine.numel(), batch_size):
            rows = mine[start : start + batch_size]
            x, _ = normalize(images[rows].to(device), rows)
            out = forward(x).float()
            if flip_fusion:
                out = out + forward(x.flip(-1)).float()
            parts.append(out)
    forward.train(was_training)
    local = torch.cat(parts)
    if ranks > 1:
        gathered = [torch.empty_like(local) for _ in range(ranks)]
        torch.distributed.all_gather(gathered, local.contiguous())
        local = torch.cat(gathered)
    embeddings = torch.empty(n, local.shape[1], device=local.device)
    embeddings[torch.cat(shares).to(local.device)] = local  # padding repeats a row with the same value
    return F.normalize(embeddings, dim=1).cpu()


def pixel_embeddings(images: torch.Tensor, normalize: BatchAugment) -> torch.Tensor:
    """The raw-pixel baseline: each normalized image as one flat vector, L2-normalized."""
    x, _ = normalize(images, torch.zeros(images.shape[0], dtype=torch.long))
    return F.normalize(x.flatten(1).float(), dim=1)


def pair_scores(embeddings: torch.Tensor, row_of: dict[str, int], pairs: Pairs) -> np.ndarray:
    """Cosine similarity of each pair (embeddings are L2-normalized)."""
    left = torch.tensor([row_of[name] for name in pairs.left])
    right = torch.tensor([row_of[name] for name in pairs.right])
    return (embeddings[left] * embeddings[right]).sum(dim=1).double().numpy()


def score_pair_sets(
    pair_sets: list[Pairs], row_of: dict[str, int], models: dict[str, torch.Tensor]
) -> tuple[dict[str, dict[str, Any]], dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Reports keyed "<pair set>" (the first model) or "<pair set> <model>", and their ROC curves."""
    reports, curves = {}, {}
    for i_model, (model_name, embeddings) in enumerate(models.items()):
        for pairs in pair_sets:
            key = pairs.name if i_model == 0 else f"{pairs.name} {model_name}"
            scores = pair_scores(embeddings, row_of, pairs)
            reports[key] = verification_report(scores, pairs.same, pairs.folds, FARS)
            fpr, tpr, _ = roc(scores, pairs.same)
            curves[key] = (fpr, tpr)
    return reports, curves


def summary_line(name: str, report: dict[str, Any]) -> str:
    """e.g. `generated: 10-fold accuracy 0.9533 +- 0.0212, TPR@FAR 91.11@0.1 80.00@0.01 n/a@0.001 (450 negatives)`."""
    tprs = " ".join(format_tpr_at_far(t["tpr"], t["far"]) for t in report["tpr_at_far"])
    return (
        f"{name}: 10-fold accuracy {report['accuracy']:.4f} +- {report['accuracy_std']:.4f}, TPR@FAR {tprs} "
        f"({report['mismatched']} negatives, {report['matched']} positives)"
    )


def write_report(out_dir: Path, reports: dict[str, Any], curves: dict[str, Any], extra: dict[str, Any]) -> Path:
    """verification.json and verification_roc.png (when matplotlib is installed) in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plot = plot_roc(curves, out_dir / "verification_roc.png")
    payload = {**extra, "reports": reports, "roc_plot": str(plot) if plot else None}
    path = out_dir / "verification.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
