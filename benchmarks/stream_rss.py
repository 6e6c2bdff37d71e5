"""Peak memory while streaming a shard set far larger than the loader's buffers (generated here, not committed).

    python benchmarks/stream_rss.py --gb 5 --out results/loader-sources/stream_rss.json

Writes --gb of ImageNet-like shards (real BCCD microscope photos re-encoded at 1024x768, ~100 KB each, repeated
under new keys) into a temporary folder, then trains' loader streams one whole epoch with 2 worker processes
(batch 256, 64 px, shuffle windows of 1,000) while a thread samples the resident memory of the process and all
its children: Rss summed (a page shared after fork counts once per process, so it overstates), the largest one
process's Rss, the main process's and the largest worker's, and Pss (each shared page divided among its sharers:
the tree's real footprint). Removes the shards at the end. The stream trims the heap every TRIM_EVERY batches
(vitrain/data/stream.py: glibc otherwise keeps the freed batches in the loader thread's arena); set
`vitrain.data.stream.TRIM_EVERY` very high to see the resident set without it, or run with
`MALLOC_MMAP_THRESHOLD_=4194304` in the environment (the value is recorded in the output).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import tempfile
import threading
import time
import zipfile
from pathlib import Path

import torch
from PIL import Image

from vitrain.config import load_config
from vitrain.data.pipeline import build_loaders
from vitrain.data.shards import FORMAT, INDEX, ShardWriter
from vitrain.device import cpu_description, reuse_freed_host_memory


def tree_memory(pid: int, field: str = "Rss") -> list[int]:
    """Rss (or Pss: shared pages divided among their sharers) of `pid` and of every descendant, in bytes."""
    sizes, stack = [], [pid]
    while stack:
        p = stack.pop()
        try:
            status = Path(f"/proc/{p}/smaps_rollup").read_text()
            sizes.append(
                int(next(line.split()[1] for line in status.splitlines() if line.startswith(field + ":"))) * 1024
            )
            for task in Path(f"/proc/{p}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, StopIteration, ProcessLookupError):
            continue
    return sizes


def tree_rss_bytes(pid: int, field: str = "Rss") -> int:
    """Rss (or Pss) of `pid` and every descendant, summed."""
    return sum(tree_memory(pid, field))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared" / "data"))
    parser.add_argument("--gb", type=float, default=5.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with zipfile.ZipFile(Path(args.data) / "bccd-detection.zip") as z:
        names = [n for n in z.namelist() if n.startswith("bccd/JPEGImages/") and n.endswith(".jpg")][:40]
        images = []
        for n in names:
            out = io.BytesIO()
            Image.open(io.BytesIO(z.read(n))).convert("RGB").resize((1024, 768)).save(out, "JPEG", quality=90)
            images.append(out.getvalue())
    folder = Path(tempfile.mkdtemp(prefix="vitrain-rss-"))
    try:
        target, written, n = args.gb * 1e9, 0, 0
        writer = ShardWriter(str(folder / "train-%06d.tar"), max_count=2000)
        started = time.perf_counter()
        while written < target:
            raw = images[n % len(images)]
            writer.write(f"{n:09d}", {"jpg": raw, "cls": str(n % 10).encode()})
            written += len(raw) + 1536
            n += 1
        shards = writer.close()
        (folder / INDEX).write_text(json.dumps({"format": FORMAT, "classes": [str(i) for i in range(10)],
                                                "counts": {Path(p).name: c for p, c in shards}}))  # fmt: skip
        on_disk = sum(p.stat().st_size for p in folder.glob("*.tar"))
        print(
            f"wrote {on_disk / 1e9:.2f} GB, {n} samples in {len(shards)} shards ({time.perf_counter() - started:.0f} s)"
        )
        cfg = load_config(overrides=[
            "model.image_size=64", "model.patch_size=8", "model.in_chans=3", "model.num_classes=10",
            "data.source=shards", f"data.root={folder}", "data.val_fraction=0.01", "train.batch_size=256",
            f"data.loader_workers={args.workers}", "data.shuffle_buffer=1000", "log.progress=false",
        ])  # fmt: skip
        if cfg.train.reuse_host_memory:  # as the trainer sets it before it builds the loader (vitrain/device.py)
            reuse_freed_host_memory()
        peak, pss, stop = [tree_rss_bytes(os.getpid())], [tree_rss_bytes(os.getpid(), "Pss")], threading.Event()
        baseline, largest, main_peak, worker_peak = peak[0], [0], [0], [0]

        def sample() -> None:
            while not stop.is_set():
                sizes = tree_memory(os.getpid())  # this process first, then its children
                peak.append(sum(sizes))
                largest.append(max(sizes))
                main_peak.append(sizes[0] if sizes else 0)
                worker_peak.append(max(sizes[1:], default=0))
                pss.append(tree_rss_bytes(os.getpid(), "Pss"))
                time.sleep(0.1)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        loader = build_loaders(cfg, torch.device("cpu"))[0]
        started, seen = time.perf_counter(), 0
        for x, _ in loader.epoch(0):
            seen += x.shape[0]
        elapsed = time.perf_counter() - started
        stop.set()
        sampler.join()
        result = {
            "cpu": cpu_description(), "shard_bytes": on_disk, "samples": n, "streamed_images": seen,
            "epoch_s": elapsed, "images_per_s": seen / elapsed, "workers": args.workers,
            "peak_rss_bytes": max(peak), "peak_pss_bytes": max(pss), "rss_before_loader_bytes": baseline,
            "peak_rss_one_process_bytes": max(largest), "peak_rss_main_bytes": max(main_peak),
            "peak_rss_one_worker_bytes": max(worker_peak),
            "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        }  # fmt: skip
        print(f"streamed {seen} images in {elapsed:.0f} s ({seen / elapsed:,.0f}/s); peak of the process tree: RSS "
              f"{max(peak) / 2**30:.2f} GiB summed, PSS {max(pss) / 2**30:.2f} GiB (before the loader "
              f"{baseline / 2**30:.2f} GiB)")  # fmt: skip
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
