"""Training curves of one or more runs (loss, lr, top-1 against steps and wall-clock seconds) as one PNG."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from vitrain.errors import ConfigError

METRICS_FILE = "metrics.jsonl"


@dataclass
class Curves:
    """What a run's metrics.jsonl holds, as columns: training records and evaluation records."""

    name: str
    train: dict[str, list[float]] = field(default_factory=dict)  # step, wall_s, loss, lr
    evals: dict[str, list[float]] = field(default_factory=dict)  # step, wall_s, val_top1, ema_val_top1, ...


def read_curves(run: str | Path, name: str | None = None) -> Curves:
    """A run folder's metrics.jsonl; a damaged or missing file is an error naming it."""
    path = Path(run)
    metrics = path / METRICS_FILE if path.is_dir() else path
    if not metrics.is_file():
        raise ConfigError(f"{metrics} not found: pass run folders that `vitrain train` wrote (with {METRICS_FILE})")
    rows: dict[str, list[dict[str, float]]] = {"train": [], "evals": []}
    for number, line in enumerate(metrics.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise ConfigError(f"{metrics} line {number} is not JSON; is this a vitrain metrics file?") from None
        if not isinstance(record, dict) or "step" not in record:
            continue
        kind = "evals" if any(k.startswith(("val_", "ema_val_")) for k in record) else "train"
        if kind == "train" and "loss" not in record:
            continue  # a skipped-step record
        rows[kind].append({k: float(v) for k, v in record.items() if isinstance(v, int | float)})
    # Columns; a record without a key (older runs have no wall_s) leaves NaN there, which the plot skips.
    curves = Curves(name or (path.name if path.is_dir() else path.parent.name))
    for kind, table in rows.items():
        keys = dict.fromkeys(k for row in table for k in row)
        setattr(curves, kind, {k: [row.get(k, math.nan) for row in table] for k in keys})
    if not curves.train and not curves.evals:
        raise ConfigError(f"{metrics} holds no training or evaluation records yet")
    return curves


def plot_runs(runs: list[Curves], out: str | Path, metric: str = "val_top1") -> Path:
    """Loss, lr and `metric` against steps (top row) and wall-clock seconds (bottom row), every run in each panel."""
    try:
        from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone
    except ImportError:
        raise ConfigError("vitrain plot draws with matplotlib: pip install 'vitrain[plot]'") from None
    fig = Figure(figsize=(15, 8))
    axes = fig.subplots(2, 3)
    panels = [("loss", "train", "training loss"), ("lr", "train", "learning rate"), (metric, "evals", metric)]
    colors = [f"C{i}" for i in range(10)]
    for row, (x_key, x_label) in enumerate([("step", "optimizer steps"), ("wall_s", "wall-clock seconds")]):
        for col, (key, table, label) in enumerate(panels):
            ax = axes[row][col]
            for i, run in enumerate(runs):
                data = getattr(run, table)
                color = colors[i % len(colors)]
                if key in data and x_key in data:
                    style = "o-" if table == "evals" else "-"
                    ax.plot(data[x_key], data[key], style, color=color, label=run.name, markersize=3, linewidth=1.2)
                ema = f"ema_{key}"
                if table == "evals" and ema in data and x_key in data:
                    ax.plot(data[x_key], data[ema], "s--", color=color, label=f"{run.name} (EMA)", markersize=3)
            ax.set_xlabel(x_label)
            ax.set_ylabel(label)
            if key == "lr":
                ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
            if col == 2:
                ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(" vs ".join(run.name for run in runs))
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out
