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
import time
from pathlib import Path

from vitrain.bench import keep_run_record
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
        begin = time.perf_counter()
        subprocess.run(command, check=True)
        command_wall = time.perf_counter() - begin
        run = args.out / "runs" / name
        summary = json.loads((run / "summary.json").read_text())
        keep_run_record(run, args.out / "metrics" / name)  # runs/ is ignored by git
        rows[label] = {"overrides": extra + args.overrides, "command": "vitrain " + " ".join(command[3:]),
                       "command_wall_s": command_wall} | {k: summary.get(k) for k in FIELDS}  # fmt: skip
        pictures = sorted((run / "detections").glob("*.png"))
        if pictures and label == "vitdet":
            shutil.copy(pictures[0], args.out / "predictions.png")
    report = {"device": cpu_description(), "python": platform.python_version(), "runs": rows}
    (args.out / "summary.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# BCCD (3 classes, the set's own val split): detection-bccd against its frozen-backbone baseline",
        "",
        f"{report['device']}. `python benchmarks/detection_bccd.py`, one run after the other. COCO AP from pycocotools",
        "on the val split after the last epoch; command wall: the whole `vitrain train` process.",
        "",
        "| run | AP | AP50 | AP75 | AP small | AP medium | images/s | steps | command wall |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, row in rows.items():
        aps = " | ".join(f"{row[key]:.3f}" for key in FIELDS[:5])
        minutes = row["command_wall_s"] / 60
        lines.append(f"| {label} | {aps} | {row['images_per_s']:.1f} | {row['steps']} | {minutes:.1f} min |")
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
