"""Verification metrics: TPR at FAR, 10-fold accuracy, the report and the ROC plot."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from vitrain.metrics import (
    best_threshold,
    format_tpr_at_far,
    kfold_accuracy,
    plot_roc,
    roc,
    tpr_at_far,
    verification_report,
)

# Ten matched and ten mismatched pairs; pair k of each kind is in fold k. Sorted, the scores read
#   0.95M 0.90M 0.85M 0.80M 0.75D 0.70M 0.60M 0.55M 0.50D 0.45D 0.40M 0.35M 0.30D 0.25D 0.20M 0.15D ... 0.01D
MATCHED = [0.95, 0.90, 0.85, 0.80, 0.70, 0.60, 0.55, 0.40, 0.35, 0.20]
MISMATCHED = [0.75, 0.50, 0.45, 0.30, 0.25, 0.15, 0.10, 0.05, 0.02, 0.01]
SCORES = np.array(MATCHED + MISMATCHED)
SAME = np.array([True] * 10 + [False] * 10)
FOLDS = np.concatenate([np.arange(10), np.arange(10)])


def brute_force_tpr_at_far(scores, same, far):
    """Try every threshold; keep the best true-accept rate whose false-accept rate is within far."""
    best = 0.0
    for t in [*scores, np.inf]:
        accepted = scores >= t
        if accepted[~same].mean() <= far + 1e-12:
            best = max(best, accepted[same].mean())
    return best


def brute_force_kfold(scores, same, folds):
    accuracies = []
    for k in np.unique(folds):
        train = folds != k
        candidates = sorted(set(scores[train])) + [np.inf]
        # max() keeps the first of equals: candidates ascend, so ties go to the lowest threshold
        t = max(candidates, key=lambda c: ((scores[train] >= c) == same[train]).sum())
        accuracies.append(((scores[~train] >= t) == same[~train]).mean())
    return np.mean(accuracies), np.std(accuracies)


def test_tpr_at_far_on_the_hand_made_scores():
    # FAR 0.1 of 10 mismatched pairs allows 1 false accept (0.75): accept >= 0.55 takes 7 of 10 matched.
    r = tpr_at_far(SCORES, SAME, 0.1)
    assert r == {
        "far": 0.1,
        "tpr": 0.7,
        "threshold": 0.55,
        "negatives": 10,
        "false_accepts_allowed": 1,
        "measurable": True,
    }
    # 2 false accepts allowed (0.75, 0.50): still 7 matched, and the strictest threshold reaching them is kept.
    assert (tpr_at_far(SCORES, SAME, 0.2)["tpr"], tpr_at_far(SCORES, SAME, 0.2)["threshold"]) == (0.7, 0.55)
    # 3 allowed (0.75, 0.50, 0.45): accept >= 0.35 takes 9 of 10.
    assert (tpr_at_far(SCORES, SAME, 0.3)["tpr"], tpr_at_far(SCORES, SAME, 0.3)["threshold"]) == (0.9, 0.35)


def test_a_far_below_one_over_the_negatives_is_not_measurable():
    r = tpr_at_far(SCORES, SAME, 0.05)  # 10 mismatched pairs: the smallest non-zero FAR is 0.1
    assert r["measurable"] is False
    assert r["tpr"] is None and r["threshold"] is None
    assert r["false_accepts_allowed"] == 0
    assert format_tpr_at_far(r["tpr"], 0.05) == "n/a@0.05"


def test_tpr_at_far_equals_a_brute_force_search():
    rng = np.random.default_rng(3)
    same = rng.random(400) < 0.5
    scores = np.round(rng.normal(same.astype(float), 1.0), 1)  # rounding makes ties
    for far in (0.5, 0.1, 0.03, 0.01):
        assert tpr_at_far(scores, same, far)["tpr"] == pytest.approx(brute_force_tpr_at_far(scores, same, far))


def test_the_best_threshold_breaks_ties_towards_the_lowest():
    # On all 20 pairs 0.55 and 0.35 both classify 16 correctly.
    assert best_threshold(SCORES, SAME) == 0.35


def test_kfold_accuracy_on_the_hand_made_scores():
    # Threshold chosen on the other nine folds, then the fold's accuracy:
    #   folds 0,1,2,9: 0.35 -> the mismatched 0.75/0.50/0.45 are accepted, the matched 0.20 rejected: 0.5
    #   folds 3,4: 0.20 (ties with 0.35 and 0.55) -> mismatched 0.30/0.25 accepted: 0.5
    #   folds 5,6: 0.35 -> both right: 1.0
    #   folds 7,8: 0.55 -> matched 0.40/0.35 rejected: 0.5
    mean, std = kfold_accuracy(SCORES, SAME, FOLDS)
    assert mean == pytest.approx(0.6)  # (8 x 0.5 + 2 x 1.0) / 10
    assert std == pytest.approx(0.2)  # sqrt((8 x 0.1^2 + 2 x 0.4^2) / 10)


def test_kfold_accuracy_equals_a_brute_force_search():
    rng = np.random.default_rng(4)
    same = rng.random(300) < 0.5
    scores = np.round(rng.normal(same * 1.5, 1.0), 1)
    folds = rng.integers(0, 10, 300)
    assert kfold_accuracy(scores, same, folds) == pytest.approx(brute_force_kfold(scores, same, folds))


def test_kfold_accuracy_needs_two_folds():
    with pytest.raises(ValueError, match="at least 2 folds"):
        kfold_accuracy(SCORES, SAME, np.zeros(20, dtype=int))


def test_roc_has_one_point_per_distinct_score_and_starts_at_nothing_accepted():
    fpr, tpr, thresholds = roc(SCORES, SAME)
    assert len(thresholds) == 21
    assert (fpr[0], tpr[0], fpr[-1], tpr[-1]) == (0, 0, 1, 1)


def test_tpr_at_far_is_formatted_in_percent():
    assert format_tpr_at_far(0.96781, 0.01) == "96.78@0.01"
    assert format_tpr_at_far(1.0, 0.001) == "100.00@0.001"


def test_the_report_is_json_and_adds_up():
    report = verification_report(SCORES, SAME, FOLDS, fars=(0.1, 0.01))
    assert json.loads(json.dumps(report)) == report
    assert (report["pairs"], report["matched"], report["mismatched"]) == (20, 10, 10)
    assert report["accuracy"] == pytest.approx(0.6) and report["accuracy_std"] == pytest.approx(0.2)
    assert report["tpr@far"] == ["70.00@0.1", "n/a@0.01"]
    assert [r["measurable"] for r in report["tpr_at_far"]] == [True, False]
    # Of the 100 (matched, mismatched) combinations, 86 rank the matched pair higher.
    assert report["auc"] == pytest.approx(0.86)


def test_verification_needs_both_kinds_of_pairs():
    with pytest.raises(ValueError, match="both matched and mismatched"):
        tpr_at_far(SCORES[:10], SAME[:10], 0.1)


def test_plot_roc_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is the optional 'plot' extra")
    fpr, tpr, _ = roc(SCORES, SAME)
    path = plot_roc({"hand-made": (fpr, tpr)}, tmp_path / "plots" / "roc.png")
    assert path == tmp_path / "plots" / "roc.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_roc_without_matplotlib_returns_none(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    fpr, tpr, _ = roc(SCORES, SAME)
    assert plot_roc({"hand-made": (fpr, tpr)}, tmp_path / "roc.png") is None
    assert not (tmp_path / "roc.png").exists()
