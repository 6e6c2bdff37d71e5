"""Shared fixtures: the tiny ViT, a tiny fast config, the real-data folder, and a CLI runner."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from vitrain.config import Config, ModelConfig, load_config
from vitrain.models import create_model

# Runs compared value for value must not depend on timings: auto values follow their fixed rules in the suite
# (tests/test_tune.py turns autotune on where it is the subject), and nothing reads or fills the user's cache.
os.environ.setdefault("VITRAIN_AUTOTUNE", "0")
os.environ["VITRAIN_CACHE_DIR"] = tempfile.mkdtemp(prefix="vitrain-test-cache-")

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"

# The suite's one tiny ViT: 16x16 grey images in 4x4 patches, 10 classes, 2 blocks of width 32 with 2 heads. A test
# needing another shape derives it, dataclasses.replace(TINY_MODEL, depth=3), rather than writing its own.
TINY_MODEL = ModelConfig(image_size=16, patch_size=4, in_chans=1, num_classes=10, width=32, depth=2, heads=2)
TINY_FIELDS = ("image_size", "patch_size", "in_chans", "num_classes", "width", "depth", "heads")  # what makes it tiny
TRUNK_FIELDS = ("width", "depth", "heads")  # the transformer's size alone, on the default images


def model_section(model: ModelConfig = TINY_MODEL, fields: Iterable[str] = TINY_FIELDS) -> dict[str, Any]:
    """`fields` of `model` as a config's model section: {"image_size": 16, ...}."""
    return {field: getattr(model, field) for field in fields}


def model_overrides(model: ModelConfig = TINY_MODEL, fields: Iterable[str] = TINY_FIELDS) -> list[str]:
    """The same as overrides for load_config and the CLI: ["model.image_size=16", ...]."""
    return [f"model.{field}={value}" for field, value in model_section(model, fields).items()]


@pytest.fixture
def tiny_model_cfg() -> ModelConfig:
    """A fresh copy of TINY_MODEL: a test may change it."""
    return dataclasses.replace(TINY_MODEL)


@pytest.fixture
def tiny_model(tiny_model_cfg: ModelConfig) -> nn.Module:
    """The tiny ViT, built with fresh random weights."""
    return create_model(tiny_model_cfg)


TINY = [
    *model_overrides(),
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


def reseal_with_checksums(step_dir: Path, leave_out: Iterable[str] = ()) -> None:
    """Rewrite a step folder's COMPLETE marker with the sizes and checksums of its files as they are now (subfolders
    too), as someone who hands out a whole changed folder would: vitrain's own checks must then find what changed."""
    from vitrain import checkpoint as ckpt

    files = {p.relative_to(step_dir).as_posix(): p.stat().st_size for p in sorted(step_dir.rglob("*")) if p.is_file()}
    files = {name: size for name, size in files.items() if name != ckpt.COMPLETE_FILE and name not in leave_out}
    sums = ckpt.file_checksums(step_dir, sorted(files))
    (step_dir / ckpt.COMPLETE_FILE).write_text(json.dumps({"step": 1, "files": files, ckpt.CHECKSUM: sums}))


def shared_data(name: str) -> Path:
    path = SHARED_DATA / name
    if not path.exists():
        pytest.skip(f"real data {path} is absent (it lives in ../shared/data beside the repo)")
    return path


def graph_names(t: torch.Tensor) -> set[str]:
    """The names of the autograd nodes behind tensor `t` (which functions its backward runs)."""
    names, todo = set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node.name() not in names:
            names.add(node.name())
            todo += [n for n, _ in node.next_functions]
    return names
