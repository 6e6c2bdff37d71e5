"""Median and spread of repeated timings, and of ratios paired round by round, so a table says how sure it is."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def spread(values: Sequence[float]) -> dict[str, Any]:
    """{"median", "min", "max", "n"} of `values` (at least one)."""
    if not values:
        raise ValueError("spread() needs at least one value")
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def paired_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> dict[str, Any]:
    """The ratio of two contenders timed in the same rounds, round by round: its median and spread, and whether
    the spread reaches across 1.0 (then the table cannot say which of the two is faster).

    Pairing cancels what drifts between rounds (clock, other load): a ratio of two medians would not."""
    if len(numerators) != len(denominators):
        raise ValueError(f"paired_ratio(): {len(numerators)} numerators but {len(denominators)} denominators")
    figures = spread([n / d for n, d in zip(numerators, denominators, strict=True)])
    return figures | {"overlaps_1x": figures["min"] <= 1.0 <= figures["max"]}


def format_spread(figures: dict[str, Any], digits: int = 2, unit: str = "") -> str:
    """`median (min-max)`, e.g. `10.13 (9.87-10.40)`; the median alone for one value."""
    median = f"{figures['median']:.{digits}f}{unit}"
    if figures["n"] < 2:
        return median
    return f"{median} ({figures['min']:.{digits}f}-{figures['max']:.{digits}f})"
