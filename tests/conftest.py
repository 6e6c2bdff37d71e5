"""Shared fixtures: a tiny fast config, the real-data folder, and a CLI runner."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from vitrain.config import Config, load_config

# Runs compared value for value must not depend on timings: auto values follow their fixed rules in the suite
# (tests/test_tune.py turns autotune on where it is the subject), and nothing reads or fills the user's cache.
os.environ.setdefault("VITRAIN_AUTOTUNE", "0")
os.environ["VITRAIN_CACHE_DIR"] = tempfile.mkdtemp(prefix="vitrain-test-cache-")

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"

TINY = [
    "model.image_size=16",
    "model.patch_size=4",
    "model.in_chans=1",
    "model.num_classes=10",
    "model.width=32",
    "model.depth=2",
    "model.heads=2",
    "train.batch_size=64",
    "train.epochs=1",
    "log.progress=false",
    "log.every_steps=1",
    # Runs compared value for value must not depend on the CPU: auto picks bf16 O1 on AMX CPUs.
    "precision.mode=fp32",
]


def tiny_overrides(tmp_path: Path, *extra: str) -> list[str]:
    return [*TINY, f"log.out_dir={tmp_path / 'runs'}", *extra]


@pytest.fixture
def tiny_cfg(tmp_path: Path) -> Config:
    return load_config(None, tiny_overrides(tmp_path))


def run_cli(
    *args: str, cwd: Path | None = None, timeout: float = 300, warnings: str = "default"
) -> subprocess.CompletedProcess:
    """Run `python -m vitrain ARGS` as a user would; returns the finished process.

    warnings="default" shows every warning (tests look for ours); "" leaves Python's defaults, as a user has them.
    """
    env = {**os.environ, "PYTHONWARNINGS": warnings}
    return subprocess.run(
        [sys.executable, "-m", "vitrain", *args],
        capture_output=True,
        text=True,
        cwd=cwd or REPO,
        env=env,
        timeout=timeout,
    )


def shared_data(name: str) -> Path:
    path = SHARED_DATA / name
    if not path.exists():
        pytest.skip(f"real data {path} is absent (it lives in ../shared/data beside the repo)")
    return path
