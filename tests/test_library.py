"""vitrain as a library: the names `import vitrain` offers, and the example that trains from Python."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import vitrain
from tests.conftest import REPO, tiny_overrides


def test_the_library_names_load_on_first_use():
    for name in vitrain.__all__:
        assert getattr(vitrain, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'Trainr'"):
        vitrain.Trainr  # noqa: B018


def test_train_returns_the_summary_and_trainer_fit_the_same(tmp_path):
    summary = vitrain.train(None, tiny_overrides(tmp_path, "train.max_steps=2", "name=lib"))
    assert summary["steps"] == 2 and summary["name"] == "lib"
    cfg = vitrain.load_config({"name": "again"}, tiny_overrides(tmp_path, "train.max_steps=2"))
    trainer = vitrain.Trainer(cfg)
    try:
        again = trainer.fit()
    finally:
        trainer.close()
    assert again["steps"] == 2 and cfg.model.width == 32


def test_the_example_trains_digits_from_python_and_prints_the_summary(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "examples" / "train_from_python.py"),
            "train.epochs=1",
            "train.max_steps=4",
            f"log.out_dir={tmp_path}",
            "precision.mode=fp32",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    first, last = done.stdout.strip().splitlines()[0], done.stdout.strip().splitlines()[-1]
    assert first == "training digits: 4 blocks of width 128, 1 epochs"
    summary = json.loads(last)
    assert summary["steps"] == 4 and 0.0 <= summary["val_top1"] <= 1.0
    assert (tmp_path / "digits" / "summary.json").is_file()
