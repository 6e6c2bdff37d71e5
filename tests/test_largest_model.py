"""benchmarks/largest_model.py: the search finds the boundary of what fits, and a real probe is measured and judged."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys

import pytest

from tests.conftest import REPO
from vitrain.models import PRESETS, complexity
from vitrain.models.memory import estimate, ladder, largest_that_fits

GIB = 2**30


def _benchmark():
    spec = importlib.util.spec_from_file_location("largest_model", REPO / "benchmarks" / "largest_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_ladder_passes_through_every_preset_and_grows():
    models = ladder()
    shapes = {(m.width, m.depth, m.hidden_dim) for m in models}
    for p in PRESETS.values():
        assert (p.width, p.depth, p.mlp_dim) in shapes or p.stages, p.alias  # MViTv2's stages are not on it
    params = [complexity(m).params for m in models]
    assert params == sorted(params) and len(set(params)) == len(params)
    assert all(m.width % m.heads == 0 for m in models)


def test_the_largest_that_fits_is_the_last_model_under_the_budget():
    models = ladder({"image_size": 32, "patch_size": 16})
    setting = {"devices": 4, "strategy": "zero3", "ac": True, "baseline_bytes": GIB // 3}
    i = largest_that_fits(models, 5 * GIB, **setting)
    assert estimate(models[i], **setting).peak <= 5 * GIB < estimate(models[i + 1], **setting).peak
    assert largest_that_fits(models, GIB // 4, **setting) is None  # less than the baseline: nothing


@pytest.mark.parametrize("true_largest", [0, 7, 20, 29, 60])
def test_the_search_finds_the_boundary_from_any_prediction(monkeypatch, tmp_path, true_largest):
    """With a fake probe that fits up to a given model, the search ends on it in a few probes."""
    bench = _benchmark()
    models = ladder({"image_size": bench.IMAGE_SIZE, "patch_size": bench.PATCH_SIZE, "num_classes": 1000})
    limit = complexity(models[true_largest]).params
    probed = []

    def fake_probe(model, row, args, work):
        shape = (model["width"], model["depth"], model["mlp_dim"])
        params = next(complexity(m).params for m in models if (m.width, m.depth, m.hidden_dim) == shape)
        probed.append(params)
        return {"model": model, "fits": params <= limit, "peak_bytes": GIB, "stopped": None, "wall_s": 0.0}

    monkeypatch.setattr(bench, "probe", fake_probe)
    monkeypatch.setattr(bench, "measure_baseline", lambda row, args, work: GIB // 3)
    args = argparse.Namespace(processes=4, budget_gib=5.0, batch=1)
    result = bench.search("ddp", bench.ROWS["ddp"], args, tmp_path)  # predicts index 29 (ViT-L/16)
    assert result["largest"]["params"] == limit
    assert result["first_failing"]["params"] == complexity(models[true_largest + 1]).params
    assert len(probed) == len(set(probed)) <= 14  # each model once: a gallop (2 log2 of the distance), bisection


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory):
    """The ddp row on 2 processes with a 0.45 GiB budget: tiny ViTs (~40 s on 2 cores). Returns the JSON's path."""
    out = tmp_path_factory.mktemp("largest") / "largest.json"
    command = [sys.executable, str(REPO / "benchmarks" / "largest_model.py"), "--processes", "2"]
    command += ["--budget-gib", "0.45", "--rows", "ddp", "--results", str(out), "--work-dir", str(out.parent)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


@pytest.mark.slow  # a real 2-process search, ~20-40 s: pytest -m slow
def test_the_largest_measured_model_fits_and_the_next_does_not(written):
    result = json.loads(written.read_text())
    row = result["rows"]["ddp"]
    assert result["command"].startswith("python benchmarks/largest_model.py --processes 2 --budget-gib 0.45")
    assert row["largest"] is not None and row["measured_peak_bytes"] <= 0.45 * GIB
    probes = {p["index"]: p for p in row["probes"]}
    assert probes[row["first_failing"]["index"]]["fits"] is False
    assert all(len(p["ranks"]) == 2 for p in row["probes"] if p["fits"])


@pytest.mark.slow  # a real 2-process search, ~20-40 s: pytest -m slow
def test_the_estimate_is_within_fifteen_percent_of_the_measured_peak(written):
    assert abs(json.loads(written.read_text())["rows"]["ddp"]["error"]) <= 0.15


@pytest.mark.slow  # a real 2-process search, ~20-40 s: pytest -m slow
def test_a_markdown_table_is_written_beside_the_json(written):
    table = written.with_suffix(".md").read_text()
    assert "0.45 GiB per-process budget" in table
    assert "| ddp | " in table
