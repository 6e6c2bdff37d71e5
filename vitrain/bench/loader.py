"""`vitrain bench loader`: training-loader images/s, fast prepared path vs per-sample PIL workers, same augmentations.

Both loaders yield normalized float batches on the device from the same seeded order; the timed loop only
pulls batches, so the figure is what the loader can feed a model that takes no time. Run it under the timing
lock on a shared machine: `flock /tmp/vitrain-timing.lock vitrain bench loader --prepared P --folder F`.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from vitrain.config import load_config, to_dict
from vitrain.data.pipeline import build_loaders
from vitrain.data.prepared import read_manifest
from vitrain.errors import ConfigError

# CIFAR-style training augmentation unless overridden: random crop after 4-pixel padding, flip, normalization.
DEFAULT_AUGMENT = ["data.crop_padding=4", "data.hflip=0.5", "data.mean=[0.49,0.48,0.45]", "data.std=[0.25,0.24,0.26]"]


def bench_loader(
    prepared: str, folder: str, overrides: list[str], batches: int = 60, warmup: int = 5, rounds: int = 3
) -> dict[str, Any]:
    """Alternate fast and plain for `rounds` rounds (each a fresh epoch) and report the median images/s of each.

    Alternating keeps a load change on a shared machine from favouring whichever loader ran first.
    """
    manifest = read_manifest(Path(prepared).expanduser())
    shape = [
        f"model.image_size={manifest['size']}",
        f"model.in_chans={manifest['channels']}",
        f"model.num_classes={len(manifest['classes'])}",
        "model.patch_size=1",
        "train.batch_size=256",
        "log.progress=false",
    ]
    common = shape + DEFAULT_AUGMENT + list(overrides)
    fast_cfg = load_config(overrides=common + ["data.source=prepared", f"data.root={prepared}", "data.loader=fast"])
    plain_cfg = load_config(overrides=common + ["data.source=folder", f"data.root={folder}", "data.loader=plain"])
    device = torch.device("cpu")
    result: dict[str, Any] = {
        "augmentation_overrides": DEFAULT_AUGMENT + list(overrides),
        "batch_size": fast_cfg.train.batch_size,
        "timed_batches": batches,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "plain_workers": plain_cfg.data.loader_workers,
        "fast_prefetch": fast_cfg.data.prefetch,
        "data": {k: v for k, v in to_dict(fast_cfg)["data"].items() if k not in ("source", "root", "loader")},
    }
    loaders = {name: build_loaders(cfg, device)[0] for name, cfg in (("fast", fast_cfg), ("plain", plain_cfg))}
    for name, loader in loaders.items():
        if len(loader) < warmup + batches:
            raise ConfigError(f"{name}: only {len(loader)} batches per epoch; lower --batches or train.batch_size")
    per_round: dict[str, list[float]] = {"fast": [], "plain": []}
    for epoch in range(rounds):
        for name, loader in loaders.items():
            per_round[name].append(_images_per_s(loader.epoch(epoch), batches, warmup))
    for name, figures in per_round.items():
        result[f"{name}_images_per_s"] = statistics.median(figures)
        result[f"{name}_images_per_s_rounds"] = figures
    result["speedup"] = result["fast_images_per_s"] / result["plain_images_per_s"]
    return result


def _images_per_s(batches, timed: int, warmup: int) -> float:
    for _ in range(warmup):
        next(batches)
    images = 0
    start = time.perf_counter()
    for _ in range(timed):
        x, _ = next(batches)
        images += x.shape[0]
    elapsed = time.perf_counter() - start
    batches.close()
    return images / elapsed


def format_result(result: dict[str, Any]) -> str:
    return (
        f"fast (prepared, batched, prefetch={result['fast_prefetch']}): {result['fast_images_per_s']:,.0f} images/s\n"
        f"plain (PIL per sample, {result['plain_workers']} DataLoader workers): "
        f"{result['plain_images_per_s']:,.0f} images/s\n"
        f"speedup: {result['speedup']:.1f}x  (medians of {len(result['fast_images_per_s_rounds'])} alternating rounds; "
        f"batch {result['batch_size']}, {result['timed_batches']} timed batches per round, "
        f"{result['torch_threads']} torch threads, {result['cpu_count']} CPUs)"
    )
