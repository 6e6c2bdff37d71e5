"""A run's log: human lines to stderr and log.txt, machine records to metrics.jsonl and the trackers, rank 0 only."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from vitrain.engine.trackers import Sink, scalars


class RunLog:
    """Human lines to stderr and log.txt; machine records to metrics.jsonl and to the experiment trackers' sinks
    (vitrain/engine/trackers.py). Silent on ranks other than 0."""

    def __init__(self, run_dir: Path, enabled: bool = True, sinks: Sequence[Sink] = (), files: bool = True):
        """`files` off: the lines go to stderr only, and nothing in run_dir is written (a resume with nothing left to
        train)."""
        self.enabled = enabled
        self.sinks = list(sinks) if enabled else []
        self.text = self.jsonl = None
        if enabled and files:
            self.text = open(run_dir / "log.txt", "a")
            self.jsonl = open(run_dir / "metrics.jsonl", "a")

    def info(self, message: str, echo: bool = True) -> None:
        """A line for log.txt, and for stderr unless `echo` is off (the line is printed elsewhere)."""
        if not self.enabled:
            return
        if echo:
            tqdm.write(message, file=sys.stderr)
        if self.text is not None:
            self.text.write(message + "\n")
            self.text.flush()

    def record(self, **fields: Any) -> None:
        if not self.enabled:
            return
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(fields) + "\n")
            self.jsonl.flush()
        numbers = scalars(fields)
        for sink in self.sinks:
            sink.record(fields.get("step", 0), numbers)

    def summary(self, fields: dict[str, Any]) -> None:
        """summary.json's fields, for the trackers (the trainer writes the file)."""
        for sink in self.sinks:
            sink.summary(fields)

    def close(self, status: str = "finished") -> None:
        """Close the files and end the trackers' runs as `status`: finished, failed or stopped (a stop signal)."""
        if self.enabled:
            for handle in (self.text, self.jsonl):
                if handle is not None:
                    handle.close()
            self.enabled = False
            sinks, self.sinks = self.sinks, []
            with contextlib.ExitStack() as closing:  # every sink is closed even when one of them raises
                for sink in reversed(sinks):
                    closing.callback(sink.close, status)


def bars_render() -> bool:
    """Whether a progress bar's redraws render on stderr: a terminal or a Jupyter kernel's output. In a file or a CI
    log each redraw stays as text (about a kilobyte an epoch), with the next line glued onto it."""
    return sys.stderr.isatty() or "ipykernel" in sys.modules


def progress_bar(total: int, initial: int, desc: str, enabled: bool) -> tqdm:
    """One epoch's progress bar on stderr (off with log.progress=false and on ranks other than 0), drawn only where
    its redraws render (`bars_render`)."""
    drawn = enabled and bars_render()
    return tqdm(total=total, initial=initial, desc=desc, disable=not drawn, file=sys.stderr, dynamic_ncols=True,
                leave=False)  # fmt: skip


class Speed:
    """Images/s and time spent waiting for data: over the run's timed steps (the summary) and over the window of
    steps since the last log record. The first step of a process (warm-up, or torch.compile) is not timed; where a
    process ran no other, the summary reads that one (a resume with one step left)."""

    def __init__(self) -> None:
        self.train_s = self.wait_s = 0.0
        self.train_images = 0
        self.steps = 0
        self.untimed_s, self.untimed_images = 0.0, 0
        self.compile_s: float | None = None
        self.open_window()

    def open_window(self) -> None:
        self.window_start, self.window_images, self.window_wait_s, self.window_steps = time.perf_counter(), 0, 0.0, 0

    def add(self, step_s: float, images: int, wait_s: float) -> None:
        timed = self.steps > 0  # the process's first step is its warm-up (a resume's too)
        self.steps += 1
        if timed:
            self.train_s += step_s
            self.train_images += images
            self.wait_s += wait_s
        else:
            self.untimed_s += step_s
            self.untimed_images += images
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
        if self.train_s:
            return self.train_images / self.train_s
        return self.untimed_images / self.untimed_s if self.untimed_s else 0.0

    def data_wait(self) -> dict[str, float]:
        return {"data_wait_s": self.wait_s, "data_wait_frac": self.wait_s / self.train_s if self.train_s else 0.0}
