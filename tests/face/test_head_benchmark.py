"""benchmarks/face_head.py measures the three identity-head variants on 2 gloo ranks and writes a complete result."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.conftest import REPO

# A real run of the benchmark script (~20-30 s): `pytest -m slow` runs it, the default run stays under 10 minutes.
pytestmark = pytest.mark.slow

TINY = ["--identities", "2000", "--embed-dim", "32", "--batch", "8", "--steps", "2"]


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One tiny run of the benchmark (three variants, each in its own pair of processes; ~30 s on 2 cores)."""
    out = tmp_path_factory.mktemp("face_head") / "face_head.json"
    command = [sys.executable, str(REPO / "benchmarks" / "face_head.py"), *TINY, "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text())


def test_records_the_run_that_produced_it(result):
    assert result["command"].startswith("python benchmarks/face_head.py --identities 2000")
    assert result["cpu"].startswith("CPU: ")
    assert result["torch"]
    assert (result["identities"], result["embed_dim"], result["batch_per_rank"]) == (2000, 32, 8)
    assert (result["world_size"], result["threads_per_rank"]) == (2, 1)


def test_sharded_variants_hold_half_of_the_centres_per_rank(result):
    rows = {name: variant["rows_per_rank"] for name, variant in result["variants"].items()}
    assert rows == {"replicated": [2000, 2000], "sharded": [1000, 1000], "sharded_sampled": [1000, 1000]}


def test_every_variant_reports_time_memory_and_a_finite_loss(result):
    for name, variant in result["variants"].items():
        assert math.isfinite(variant["last_loss"]) and variant["last_loss"] > 0, name
        assert variant["median_step_s"] > 0, name
        assert variant["peak_rss_bytes"] >= variant["rss_increase_bytes"] > 0, name
        assert [len(rank["step_s"]) for rank in variant["ranks"]] == [2, 2], name


def test_replicated_and_sharded_heads_train_alike_on_the_same_batches(result):
    # Same initial centres on any world size, same embeddings and labels, and the same global-batch gradient:
    # only the layout differs, so the losses after the same steps agree up to rounding.
    variants = result["variants"]
    assert variants["sharded"]["last_loss"] == pytest.approx(variants["replicated"]["last_loss"], rel=1e-3)


def test_acceptance_ratios_and_their_verdicts(result):
    variants = result["variants"]
    memory_ratio = variants["sharded"]["rss_increase_bytes"] / variants["replicated"]["rss_increase_bytes"]
    speedup = variants["sharded"]["median_step_s"] / variants["sharded_sampled"]["median_step_s"]
    assert result["sharded_over_replicated_peak_increase"] == pytest.approx(memory_ratio)
    assert result["sampled_speedup"] == pytest.approx(speedup)
    assert result["sharded_peak_at_most_0.6x_replicated"] == (memory_ratio <= 0.6)
    assert result["sampled_at_least_2x_faster"] == (speedup >= 2.0)
