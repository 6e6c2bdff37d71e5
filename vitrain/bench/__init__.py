"""Benchmarks a reader can rerun: the training step (engine/step.py) timed, the ladder, peers, loaders, optimizers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_results(out: Path, stem: str, result: dict[str, Any], markdown: str) -> None:
    """A benchmark's figures as OUT/STEM.json and its table as OUT/STEM.md; the table is printed too."""
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{stem}.md").write_text(markdown)
    print(markdown)
    print(f"wrote {out / f'{stem}.md'} and {out / f'{stem}.json'}")
