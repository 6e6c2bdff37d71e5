"""Benchmarks a reader can rerun: the training step (engine/step.py) timed, the ladder, peers, loaders, optimizers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any


def write_results(out: Path, stem: str, result: dict[str, Any], markdown: str) -> None:
    """A benchmark's figures as OUT/STEM.json and its table as OUT/STEM.md; the table is printed too."""
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{stem}.md").write_text(markdown)
    print(markdown)
    print(f"wrote {out / f'{stem}.md'} and {out / f'{stem}.json'}")


RUN_RECORD = ("summary.json", "config.yaml", "log.txt")


def keep_run_record(run: Path, kept: Path) -> None:
    """Copy a run folder's summary, config and log (those it has) into `kept`, emptied first: what a benchmark
    commits of a run whose folder (checkpoints and all) stays out of git."""
    shutil.rmtree(kept, ignore_errors=True)
    kept.mkdir(parents=True)
    for file in RUN_RECORD:
        if (run / file).exists():
            shutil.copy2(run / file, kept / file)
