"""`vitrain bench` for video models: synthetic clips of model.num_frames frames, clips/s, the video model's FLOPs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY, model_overrides
from tests.distributed_helpers import gpu_free_env
from tests.video_helpers import VIDEO_OVERRIDES
from vitrain.cli import main
from vitrain.config import ModelConfig, load_config
from vitrain.data import build_datasets
from vitrain.models import complexity

BENCH = [*VIDEO_OVERRIDES, "train.batch_size=4", "data.synthetic_samples=16", "precision.mode=fp32", "train.threads=1"]


def bench(tmp_path: Path, capsys, *extra: str) -> tuple[str, dict]:
    out = tmp_path / "bench.json"
    argv = ["bench", "run", *BENCH, *extra, "--synthetic", "--steps", "2", "--warmup", "1", "--json", str(out)]
    assert main(argv) == 0
    return capsys.readouterr().out, json.loads(out.read_text())


def test_synthetic_data_for_a_video_model_is_clips_of_its_frames():
    cfg = load_config(None, [*BENCH, "data.source=synthetic"])
    train, val = build_datasets(cfg)
    clips, labels = train.read(torch.tensor([0, 1, 2]), torch.Generator().manual_seed(0))
    assert clips.shape == (3, 4 * 3, 16, 16) and clips.dtype == torch.uint8  # (B, T*C, H, W), as data.source=video
    assert (train.num_frames, train.channels, len(train) + len(val)) == (4, 3, 16)
    assert labels.max() < 2


def test_bench_times_the_video_step_in_clips_per_second_with_the_video_models_flops(tmp_path, capsys):
    text, result = bench(tmp_path, capsys)
    assert "clips/s" in text and "GFLOP/clip" in text and "images/s" not in text
    assert "4 frames x 16px" in result["model"]
    assert (result["unit"], result["num_frames"]) == ("clip", 4)
    assert result["clips_per_s"] == result["images_per_s"] > 0  # the image benches' key stays, counting clips
    # 2 x 4 x 4 tubelets of the video model, not the 16 patches of one 16 px frame:
    cfg = load_config(None, BENCH)
    assert result["train_gflops_per_image"] * 1e9 == pytest.approx(complexity(cfg.model).train_flops)
    assert complexity(cfg.model).train_flops > 1.9 * complexity(load_config(None, model_overrides()).model).train_flops
    assert 0 < result["mfu"] < 1


def test_bench_under_activation_checkpointing_reports_the_peak_memory_of_the_video_step(tmp_path, capsys):
    text, result = bench(tmp_path, capsys, "parallel.activation_checkpointing=block")
    assert "clips/s" in text and "peak memory" in text
    assert result["peak_memory_bytes"] > 0 and result["clips_per_s"] > 0


def test_an_image_bench_keeps_its_units(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "run", *TINY, "train.batch_size=4", "data.synthetic_samples=16", "train.threads=1"]
    assert main([*argv, "--synthetic", "--steps", "1", "--warmup", "0", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert "images/s" in capsys.readouterr().out
    assert (result["unit"], result["num_frames"]) == ("image", 1) and "clips_per_s" not in result


def test_bench_repeats_the_rate_as_clips_per_s_by_the_models_sample_unit_as_the_trainers_summary(tmp_path, monkeypatch):
    # One rule for "this model counts clips": ModelConfig.sample_unit, which the trainer's summary.json reads too; the
    # bench once asked num_frames > 1 itself, a second spelling that would drift from the first.
    monkeypatch.setattr(ModelConfig, "sample_unit", property(lambda self: "clip"))
    out = tmp_path / "bench.json"
    argv = ["bench", "run", *TINY, "train.batch_size=4", "data.synthetic_samples=16", "train.threads=1"]
    assert main([*argv, "--synthetic", "--steps", "1", "--warmup", "0", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["unit"], result["num_frames"]) == ("clip", 1) and result["clips_per_s"] == result["images_per_s"]


def test_estimate_counts_a_video_presets_activations_over_its_space_time_tokens(capsys):
    assert main(["estimate", "ViViT-B/16x2", "--batch", "8", "--precision", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "tokens per clip 1,568 = 16/2 frames x 224/16 x 224/16 patches" in out
    n, d, heads, classes = 1568, 768, 12, 1000  # 16/2 x 14 x 14 tubelets; VideoMAE's mean pooling: no class token
    per_clip = 12 * (16 * n * d + heads * n * n) + n * d + n * d + classes  # blocks, embedding, final norm, logits
    activations = next(line for line in out.splitlines() if line.startswith("activations"))
    assert float(activations.split()[1]) == pytest.approx(8 * per_clip * 2 / 2**30, abs=0.01)  # bf16: 2 bytes


@pytest.mark.slow  # torchrun with 2 ranks: the single-process bench tests above cover the clip counting
def test_bench_times_the_video_step_under_zero3_on_two_ranks_as_the_docs_run_it(tmp_path):
    out = tmp_path / "zero3.json"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "vitrain",
            "bench", "run", *BENCH, "parallel.strategy=zero3", "parallel.activation_checkpointing=block", "--synthetic",
            "--steps", "1", "--warmup", "1", "--json", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", **gpu_free_env(2)}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert (result["strategy"], result["world_size"], result["global_batch"]) == ("zero3", 2, 8)
    assert result["clips_per_s"] > 0 and result["peak_memory_bytes"] > 0 and 0 < result["mfu"] < 1
    assert "clips/s" in done.stdout
