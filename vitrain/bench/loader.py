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
GREY_NORMALIZE = ["data.mean=[0.47]", "data.std=[0.25]"]  # grey prepared data: one channel, DEFAULT_AUGMENT's average


def bench_loader(
    prepared: str, folder: str, overrides: list[str], batches: int = 60, warmup: int = 5, rounds: int = 3
) -> dict[str, Any]:
    """Alternate fast and plain for `rounds` rounds (each a fresh epoch) and report the median images/s of each.

    Alternating keeps a load change on a shared machine from favouring whichever loader ran first.
    """
    manifest = read_manifest(Path(prepared).expanduser(), "--prepared")
    shape = [
        f"model.image_size={manifest['size']}",
        f"model.in_chans={manifest['channels']}",
        f"model.num_classes={len(manifest['classes'])}",
        "model.patch_size=1",
        "train.batch_size=256",
        "log.progress=false",
    ]
    augment = DEFAULT_AUGMENT + (GREY_NORMALIZE if manifest["channels"] == 1 else [])  # the later value wins
    common = shape + augment + list(overrides)
    fast_cfg = load_config(overrides=common + ["data.source=prepared", f"data.root={prepared}", "data.loader=fast"])
    plain_cfg = load_config(overrides=common + ["data.source=folder", f"data.root={folder}", "data.loader=plain"])
    device = torch.device("cpu")
    result: dict[str, Any] = {
        "augmentation_overrides": augment + list(overrides),
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


def bench_sources(
    sources: dict[str, str],
    workers: list[int],
    overrides: list[str],
    batches: int = 40,
    warmup: int = 5,
    rounds: int = 3,
    shape: list[str] | None = None,
) -> dict[str, Any]:
    """Images/s of each data source's training loader (folder, prepared, shards, recordio: whichever `sources` names,
    source -> data.root) at each worker count, rows taking turns round by round; medians and every round kept.

    Workers mean: shards, DataLoader processes decoding the stream; recordio, threads decoding each batch; folder
    with the plain loader, DataLoader processes with PIL. The folder's fast loader decodes everything at start
    (`setup_s`) and then serves memory; prepared serves a memory map. `source_bytes_per_image`: the data's size on
    disk over its images (what a stream reads per image).
    """
    from vitrain.data.decode import decoder_name

    base = (shape or []) + ["train.batch_size=256", "log.progress=false"] + DEFAULT_AUGMENT + list(overrides)
    plans = []
    for source, root in sources.items():
        if source == "folder":
            plans.append(("folder", "fast (decoded once at start)", 2, [f"data.root={root}", "data.source=folder"]))
            plans += [("folder", "plain (PIL per sample)", w, [f"data.root={root}", "data.source=folder",
                       "data.loader=plain", f"data.loader_workers={w}"]) for w in workers]  # fmt: skip
        elif source == "prepared":
            plans.append(("prepared", "fast (memory map)", 0, [f"data.root={root}", "data.source=prepared"]))
        elif source == "shards":
            plans += [("shards", "stream", w, [f"data.root={root}", "data.source=shards", f"data.loader_workers={w}"])
                      for w in workers]  # fmt: skip
        elif source == "recordio":
            plans += [("recordio", "random access", w, [f"data.root={root}", "data.source=recordio",
                       f"data.decode_workers={max(w, 1)}"]) for w in workers]  # fmt: skip
    device = torch.device("cpu")
    rows = []
    for source, loader_name, w, extra in plans:
        cfg = load_config(overrides=base + extra)
        start = time.perf_counter()
        loader = build_loaders(cfg, device)[0]
        setup = time.perf_counter() - start
        if len(loader) < warmup + batches:
            raise ConfigError(f"{source}: only {len(loader)} batches per epoch; lower --batches or train.batch_size")
        row = {"source": source, "loader": loader_name, "workers": w, "setup_s": setup, "rounds": []}
        row["source_bytes_per_image"] = _bytes_per_image(source, cfg.data.root, len(loader.data), cfg)
        rows.append((row, loader))
    for epoch in range(rounds):
        for row, loader in rows:
            row["rounds"].append(_images_per_s(iter(loader.epoch(epoch)), batches, warmup))
    out = []
    for row, _ in rows:
        row["images_per_s"] = statistics.median(row["rounds"])
        row["spread"] = [min(row["rounds"]), max(row["rounds"])]
        out.append(row)
    return {"decoder": decoder_name(), "batch_size": 256, "timed_batches": batches, "rounds": rounds,
            "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "overrides": base, "rows": out}  # fmt: skip


def _bytes_per_image(source: str, root: str, images: int, cfg: Any) -> float:
    path = Path(root).expanduser()
    if source == "prepared":
        return cfg.model.in_chans * cfg.model.image_size**2
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files if source != "recordio" or p.suffix == ".rec")
    if source == "folder" and path.is_file():  # a zip holds the test split too: share it out by images
        import zipfile

        with zipfile.ZipFile(path) as archive:
            sizes = [i.compress_size for i in archive.infolist() if not i.is_dir()]
        return sum(sizes) / max(len(sizes), 1)
    return total / max(images, 1) if source != "shards" else total / max(_shard_images(path), 1)


def _shard_images(path: Path) -> int:
    import json

    counts = json.loads((path / "index.json").read_text())["counts"]
    return sum(counts.values())


def format_rows(result: dict[str, Any]) -> str:
    lines = [f"decoder: {result['decoder']}; batch {result['batch_size']}, {result['timed_batches']} timed batches, "
             f"medians of {result['rounds']} rounds taking turns, {result['torch_threads']} torch threads"]  # fmt: skip
    for row in result["rows"]:
        low, high = row["spread"]
        lines.append(f"{row['source']:<9} {row['loader']:<30} workers={row['workers']}: {row['images_per_s']:>8,.0f} "
                     f"images/s ({low:,.0f}-{high:,.0f}), setup {row['setup_s']:.1f} s, "
                     f"{row['source_bytes_per_image']:,.0f} source bytes/image")  # fmt: skip
    return "\n".join(lines)


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
