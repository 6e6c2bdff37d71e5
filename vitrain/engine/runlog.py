"""A run's log: human lines to stderr and log.txt, machine records to metrics.jsonl (and TensorBoard), rank 0 only."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from vitrain.errors import ConfigError


class RunLog:
    """Human lines to stderr and log.txt; machine records to metrics.jsonl. Silent on ranks other than 0."""

    def __init__(self, run_dir: Path, enabled: bool = True, tensorboard: bool = False):
        self.enabled = enabled
        self.events = None
        if enabled:
            self.text = open(run_dir / "log.txt", "a")
            self.jsonl = open(run_dir / "metrics.jsonl", "a")
            if tensorboard:
                self.events = tensorboard_writer(run_dir / "tensorboard")

    def info(self, message: str, echo: bool = True) -> None:
        """A line for log.txt, and for stderr unless `echo` is off (the line is printed elsewhere)."""
        if not self.enabled:
            return
        if echo:
            tqdm.write(message, file=sys.stderr)
        self.text.write(message + "\n")
        self.text.flush()

    def record(self, **fields: Any) -> None:
        if not self.enabled:
            return
        self.jsonl.write(json.dumps(fields) + "\n")
        self.jsonl.flush()
        if self.events is not None:  # the step is the x axis; each other number a scalar (eval ones under val/)
            step = fields.get("step", 0)
            for name, value in fields.items():
                if name not in ("step", "epoch") and isinstance(value, int | float) and not isinstance(value, bool):
                    group = "val" if name.startswith(("val_", "ema_val_")) else "train"
                    self.events.add_scalar(f"{group}/{name}", value, step)
            self.events.flush()

    def close(self) -> None:
        if self.enabled:
            self.text.close()
            self.jsonl.close()
            if self.events is not None:
                self.events.close()
            self.enabled = False


def tensorboard_writer(folder: Path):
    """torch's SummaryWriter (it needs the tensorboard package; log.tensorboard=true says how to get it)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(
            "log.tensorboard=true needs the tensorboard package: pip install 'vitrain[tensorboard]' "
            "(or set log.tensorboard=false; `vitrain plot RUN` draws the curves without it)"
        ) from None
    return SummaryWriter(log_dir=str(folder))


def progress_bar(total: int, initial: int, desc: str, enabled: bool) -> tqdm:
    """One epoch's progress bar on stderr (off with log.progress=false and on ranks other than 0)."""
    return tqdm(total=total, initial=initial, desc=desc, disable=not enabled, file=sys.stderr, dynamic_ncols=True,
                leave=False)  # fmt: skip


class Speed:
    """Images/s and time spent waiting for data: over the run's timed steps (the summary) and over the window of
    steps since the last log record. The first step of a process (warm-up, or torch.compile) is not timed."""

    def __init__(self) -> None:
        self.train_s = self.wait_s = 0.0
        self.train_images = 0
        self.compile_s: float | None = None
        self.open_window()

    def open_window(self) -> None:
        self.window_start, self.window_images, self.window_wait_s, self.window_steps = time.perf_counter(), 0, 0.0, 0

    def add(self, step_s: float, images: int, wait_s: float, timed: bool) -> None:
        if timed:
            self.train_s += step_s
            self.train_images += images
            self.wait_s += wait_s
        self.window_images += images
        self.window_wait_s += wait_s
        self.window_steps += 1

    def window(self) -> dict[str, float]:
        """The window's images/s, mean data wait per step and share of its time spent waiting; opens a new one."""
        elapsed = max(time.perf_counter() - self.window_start, 1e-9)
        fields = {
            "images_per_s": self.window_images / elapsed,
            "data_wait_s": self.window_wait_s / max(self.window_steps, 1),  # mean per step over the window
            "data_wait_frac": self.window_wait_s / elapsed,  # share of the window's step time spent waiting for data
        }
        self.open_window()
        return fields

    def images_per_s(self) -> float:
        return self.train_images / self.train_s if self.train_s else 0.0

    def data_wait(self) -> dict[str, float]:
        return {"data_wait_s": self.wait_s, "data_wait_frac": self.wait_s / self.train_s if self.train_s else 0.0}
