"""What checkpoints' per-file checksums (XXH3-64) cost: a ViT-S/16 training state saved, its checksums timed alone.

    python benchmarks/checkpoint_checksum.py --out results/checkpoint-checksum

A ViT-S/16 (224 px, fp32, AdamW: weights and two moments, ~265 MB) takes one training step, then `--repeats`
saves through the trainer (`Trainer.save`: DCP shards, fsync, meta.json, COMPLETE with the XXH3-64 of every file).
After each save the same files' checksums are computed again on their own (`checkpoint.file_checksums`), as the
save computes them: right after writing, with the files in the page cache. Reported: the median save time, the
median checksum time, and the checksums' share of the rest of the save.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from vitrain import checkpoint as ckpt
from vitrain.config import load_config
from vitrain.device import cpu_description
from vitrain.engine import Trainer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="vit_small_patch16")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vitrain-checksum-") as scratch:
        cfg = load_config(
            base={
                "name": "checksum",
                "model": {"preset": args.preset, "num_classes": 1000},
                "data": {"source": "synthetic", "synthetic_samples": 8, "mean": [0.5], "std": [0.5]},
                "train": {"batch_size": 2, "epochs": 1, "max_steps": 1, "keep_checkpoints": 2},
                "precision": {"mode": "fp32"},
                "optim": {"name": "adamw"},
                "log": {"out_dir": scratch, "progress": False},
            }
        )
        trainer = Trainer(cfg)
        try:
            trainer.fit()  # one step: the optimizer's moments exist; the fit's own save warms the page cache up
            save_s, checksum_s, sizes = [], [], []
            for _ in range(args.repeats):
                trainer.step += 1
                start = time.perf_counter()
                folder = trainer.save()
                save_s.append(time.perf_counter() - start)
                listed = json.loads((folder / ckpt.COMPLETE_FILE).read_text())["files"]
                start = time.perf_counter()
                ckpt.file_checksums(folder, list(listed))
                checksum_s.append(time.perf_counter() - start)
                sizes.append(sum(listed.values()))
        finally:
            trainer.close()
    save, checksum = statistics.median(save_s), statistics.median(checksum_s)
    result = {
        "preset": args.preset,
        "cpu": cpu_description(),
        "checkpoint_bytes": sizes[0],
        "repeats": args.repeats,
        "save_s": save_s,
        "checksum_s": checksum_s,
        "median_save_s": save,
        "median_checksum_s": checksum,
        "checksum_share_of_save_without_it": checksum / (save - checksum),
        "checksum_gb_per_s": sizes[0] / checksum / 1e9,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "checksum.json").write_text(json.dumps(result, indent=2) + "\n")
    text = "\n".join(
        [
            f"# Checkpoint checksum (XXH3-64) cost: {args.preset}, fp32 AdamW state ({sizes[0] / 2**20:.0f} MiB)",
            "",
            f"{result['cpu']}; {args.repeats} saves through Trainer.save (fsynced), median.",
            "",
            "| | median s | min | max |",
            "|---|---:|---:|---:|",
            f"| whole save (checksums included) | {save:.3f} | {min(save_s):.3f} | {max(save_s):.3f} |",
            f"| XXH3-64 of the saved files | {checksum:.3f} | {min(checksum_s):.3f} | {max(checksum_s):.3f} |",
            "",
            f"checksums / (save without them): {result['checksum_share_of_save_without_it']:.1%}; "
            f"{result['checksum_gb_per_s']:.1f} GB/s, {checksum / (sizes[0] / 1e9) * 1e3:.0f} ms per GB "
            "(xxhash.xxh3_64 over mmap, 2 threads)",
            "",
            f"command: `python {' '.join(sys.argv)}`",
            "",
        ]
    )
    (args.out / "checksum.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
