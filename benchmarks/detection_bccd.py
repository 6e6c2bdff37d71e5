"""The detection-bccd recipe beside its baseline (the same pyramid and head over a frozen, randomly initialised
backbone): COCO AP, AP50, wall time; one predictions picture copied next to the JSON.

    python benchmarks/detection_bccd.py --out results/detection-bccd

Each run is `vitrain train detection-bccd` as a user runs it (plus task.freeze_backbone=true for the baseline), one
after the other on an otherwise idle machine; the figures are read from each run's summary.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from vitrain.device import cpu_description

RUNS = {"vitdet": [], "frozen-backbone baseline": ["task.freeze_backbone=true"]}
FIELDS = ("val_ap", "val_ap50", "val_ap75", "val_ap_small", "val_ap_medium", "wall_s", "images_per_s", "steps")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/detection-bccd"))
    parser.add_argument("--root", default="../shared/data/bccd-detection.zip")
    parser.add_argument("overrides", nargs="*", help="more config overrides for both runs")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for label, extra in RUNS.items():
        name = "detection-bccd-" + label.split()[0]
        command = [sys.executable, "-m", "vitrain", "train", "detection-bccd", f"name={name}", f"data.root={args.root}",
                   f"log.out_dir={args.out / 'runs'}", "log.progress=false", *extra, *args.overrides]  # fmt: skip
        subprocess.run(command, check=True)
        summary = json.loads((args.out / "runs" / name / "summary.json").read_text())
        rows[label] = {"overrides": extra + args.overrides} | {k: summary.get(k) for k in FIELDS}
        pictures = sorted((args.out / "runs" / name / "detections").glob("*.png"))
        if pictures and label == "vitdet":
            shutil.copy(pictures[0], args.out / "predictions.png")
    report = {"device": cpu_description(), "python": platform.python_version(), "runs": rows}
    (args.out / "summary.json").write_text(json.dumps(report, indent=2) + "\n")
    for label, row in rows.items():
        print(f"{label:<26} AP {row['val_ap']:.3f}  AP50 {row['val_ap50']:.3f}  wall {row['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
