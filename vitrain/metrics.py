"""Metrics: classification accuracy from logits; face verification (TPR at FAR, 10-fold accuracy, ROC)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch


def topk_correct(logits: torch.Tensor, labels: torch.Tensor, ks: tuple[int, ...] = (1, 5)) -> list[int]:
    """Number of samples whose label is among the k highest logits, for each k (k capped at the class count)."""
    k_max = min(max(ks), logits.shape[1])
    top = logits.topk(k_max, dim=1).indices
    hits = top == labels[:, None]
    return [int(hits[:, : min(k, k_max)].any(dim=1).sum()) for k in ks]


# ---------------------------------------------------------------------------------------------- verification
# A pair is accepted (called "same person") when its score >= threshold.


def _checked(scores: np.ndarray, same: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    scores = np.asarray(scores, dtype=np.float64).ravel()
    same = np.asarray(same, dtype=bool).ravel()
    if scores.shape != same.shape:
        raise ValueError(f"{len(scores)} scores but {len(same)} same flags")
    if same.all() or not same.any():
        raise ValueError("verification needs both matched and mismatched pairs")
    return scores, same


def roc(scores: np.ndarray, same: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(false-accept rates, true-accept rates, thresholds), one operating point per distinct score, plus +inf."""
    from sklearn.metrics import roc_curve

    scores, same = _checked(scores, same)
    return roc_curve(same, scores, drop_intermediate=False)


def tpr_at_far(scores: np.ndarray, same: np.ndarray, far: float) -> dict:
    """The highest true-accept rate among thresholds whose false-accept rate is <= `far`.

    With `negatives` mismatched pairs the smallest non-zero false-accept rate is 1/negatives, so a `far` below
    that cannot be told apart from zero: it is reported as not measurable (tpr None).
    """
    fpr, tpr, thresholds = roc(scores, same)
    negatives = int((~np.asarray(same, dtype=bool)).sum())
    # The epsilon keeps far * negatives = 29 from flooring to 28 when it is computed as 28.999999999999996.
    allowed = math.floor(far * negatives + 1e-9)
    result = {
        "far": far,
        "tpr": None,
        "threshold": None,
        "negatives": negatives,
        "false_accepts_allowed": allowed,
        "measurable": allowed >= 1,
    }
    if not result["measurable"]:
        return result
    false_accepts = np.rint(fpr * negatives)
    best = tpr[false_accepts <= allowed].max()
    # The strictest threshold that reaches that rate: it accepts the fewest mismatched pairs.
    point = int(np.flatnonzero(tpr == best)[0])
    result["tpr"] = float(best)
    result["threshold"] = float(thresholds[point]) if np.isfinite(thresholds[point]) else None
    return result


def kfold_accuracy(scores: np.ndarray, same: np.ndarray, folds: np.ndarray) -> tuple[float, float]:
    """LFW protocol: each fold is scored with the threshold that is most accurate on the other folds.

    Candidate thresholds are every distinct score of the other folds and +inf; ties go to the lowest threshold.
    Returns the mean and the (population) standard deviation of the per-fold accuracies.
    """
    scores, same = _checked(scores, same)
    folds = np.asarray(folds).ravel()
    fold_ids = np.unique(folds)
    if len(fold_ids) < 2:
        raise ValueError("k-fold accuracy needs at least 2 folds")
    accuracies = []
    for k in fold_ids:
        held_out = folds == k
        threshold = best_threshold(scores[~held_out], same[~held_out])
        accuracies.append(float(((scores[held_out] >= threshold) == same[held_out]).mean()))
    return float(np.mean(accuracies)), float(np.std(accuracies))


def best_threshold(scores: np.ndarray, same: np.ndarray) -> float:
    """The lowest threshold among the distinct scores and +inf that classifies the most pairs correctly."""
    order = np.argsort(scores, kind="stable")
    scores, same = scores[order], same[order]
    candidates, first = np.unique(scores, return_index=True)
    # Accepting score >= candidates[c] rejects exactly the pairs before index first[c] in sorted order.
    matched_below = np.concatenate([[0], np.cumsum(same)])
    mismatched_below = np.concatenate([[0], np.cumsum(~same)])
    cut = np.append(first, len(scores))  # the last cut is the +inf threshold: everything rejected
    correct = (matched_below[-1] - matched_below[cut]) + mismatched_below[cut]
    best = int(np.argmax(correct))  # first maximum = lowest threshold
    return float(candidates[best]) if best < len(candidates) else math.inf


def format_tpr_at_far(tpr: float | None, far: float) -> str:
    """`96.78@0.01`: TPR in percent at the given FAR; `n/a@0.001` when not measurable."""
    return f"{'n/a' if tpr is None else f'{tpr * 100:.2f}'}@{far:g}"


def verification_report(
    scores: np.ndarray, same: np.ndarray, folds: np.ndarray, fars: tuple[float, ...] = (0.1, 0.01, 0.001)
) -> dict:
    """Everything reported about a verification run, JSON-able."""
    from sklearn.metrics import auc

    scores, same = _checked(scores, same)
    mean, std = kfold_accuracy(scores, same, folds)
    at_far = [tpr_at_far(scores, same, far) for far in fars]
    fpr, tpr, _ = roc(scores, same)
    return {
        "pairs": len(scores),
        "matched": int(same.sum()),
        "mismatched": int((~same).sum()),
        "accuracy": mean,
        "accuracy_std": std,
        "tpr_at_far": at_far,
        "tpr@far": [format_tpr_at_far(r["tpr"], r["far"]) for r in at_far],
        "auc": float(auc(fpr, tpr)),
    }


def plot_roc(curves: dict[str, tuple[np.ndarray, np.ndarray]], path: str | Path) -> Path | None:
    """ROC curves (name -> (fpr, tpr)) on a log false-accept axis, as a PNG; None when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone
    except ImportError:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(6, 4.5))
    ax = fig.add_subplot()
    lowest = 0.1  # a log axis cannot show fpr=0: start at the smallest non-zero rate of any curve
    for name, (fpr, tpr) in curves.items():
        fpr = np.asarray(fpr)
        ax.plot(fpr, tpr, label=name)
        if (fpr > 0).any():
            lowest = min(lowest, float(fpr[fpr > 0].min()))
    ax.set_xscale("log")
    ax.set_xlim(lowest, 1)
    ax.set_ylim(0, 1.01)
    ax.set_xlabel("false accept rate")
    ax.set_ylabel("true accept rate")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path
