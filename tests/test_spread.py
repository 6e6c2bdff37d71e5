"""Benchmark figures with their spread: medians, ranges and ratios paired round by round (vitrain/bench/spread.py)."""

from __future__ import annotations

import pytest

from vitrain.bench import peers
from vitrain.bench.spread import format_spread, paired_ratio, spread


def test_spread_is_the_median_and_range():
    assert spread([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0, "n": 4}
    with pytest.raises(ValueError, match="at least one value"):
        spread([])


def test_a_paired_ratio_cancels_a_drift_that_both_contenders_share():
    # Both slow down 2x by the third round; round by round the peer stays 1.2x vitrain's step time.
    vitrain = [1.0, 1.0, 2.0]
    peer = [1.2, 1.2, 2.4]
    ratio = paired_ratio(peer, vitrain)
    assert ratio["median"] == pytest.approx(1.2) and ratio["max"] - ratio["min"] < 1e-12
    assert not ratio["overlaps_1x"]


def test_a_ratio_whose_rounds_fall_on_both_sides_of_one_overlaps_1x():
    assert paired_ratio([0.9, 1.1, 1.05], [1.0, 1.0, 1.0])["overlaps_1x"]
    with pytest.raises(ValueError, match="3 numerators but 2 denominators"):
        paired_ratio([1.0, 1.0, 1.0], [1.0, 1.0])


def test_format_spread_gives_the_median_then_the_range():
    assert format_spread(spread([9.87, 10.13, 10.4])) == "10.13 (9.87-10.40)"
    assert format_spread(spread([1.2345]), digits=3, unit="x") == "1.234x"


def test_the_peers_table_marks_a_ratio_that_reaches_across_one():
    def row(name, ips, ratio_rounds):
        return {
            "name": name,
            "setting": "s",
            "images_per_s": ips,
            "images_per_s_spread": spread([ips, ips]),
            "vitrain_speedup": paired_ratio(ratio_rounds, [1.0] * len(ratio_rounds))["median"],
            "vitrain_speedup_spread": paired_ratio(ratio_rounds, [1.0] * len(ratio_rounds)),
            "model_gflops_per_s": 1.0,
            "compute_dtype": "fp32",
            "mfu": 0.5,
            "peak_source": "given",
        }

    result = {
        "model": "ViT",
        "batch": 4,
        "device": "CPU",
        "threads": 2,
        "torch": "x",
        "steps": 2,
        "warmup": 1,
        "peaks_gflops_per_s": {"fp32": 100.0},
        "rows": [row("vitrain", 10.0, [1.0, 1.0]), row("timm", 9.0, [0.95, 1.2]), row("hf", 8.0, [1.2, 1.3])],
        "missing": {},
        "wall_s": 1.0,
    }
    lines = {line.split("|")[1].strip(): line for line in peers.to_markdown(result).splitlines() if "|" in line}
    assert "1.07x (0.95-1.20) ~" in lines["timm"]
    assert "1.25x (1.20-1.30) |" in lines["hf"] and "~" not in lines["hf"]
    assert "(given)" in peers.to_markdown(result)
