"""Weizmann actions, held-out actors 6-8: the space-time ViT against the frame-averaged image baseline, several seeds.

    python benchmarks/video_weizmann.py                                  # seeds 0-4; the .mp4 files
    python benchmarks/video_weizmann.py --seeds 0 --frames 0             # and the video model from the frame folders
    python benchmarks/video_weizmann.py --models baseline,video,mvit     # and MViTv2 (video-weizmann-mvit)

For each seed: `vitrain train video-weizmann-baseline train.seed=S` (an image ViT on single frames, 16 frames' logits
averaged per video), then `vitrain train video-weizmann train.seed=S task.baseline_run=<that run>`, whose summary
carries the baseline's top-1 under `baseline` (and `vitrain train video-weizmann-mvit ...` the same way, with
`--models` naming mvit). Every run is its own process, one after the other, timed whole.
`--frames SEEDS` adds the video model read from the extracted JPEG frames (`data.video_frames=true`) for those seeds.

Writes OUT/results.json and OUT/table.md (OUT defaults to results/video-weizmann); run folders under OUT/runs
(ignored by git); each run's summary.json, config.yaml and log.txt are kept under OUT/metrics/RUN.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from vitrain.bench import keep_run_record
from vitrain.bench.spread import spread
from vitrain.device import cpu_description

REPO = Path(__file__).resolve().parent.parent
DATA = REPO.parent / "shared" / "data" / "weizmann4-video.zip"


def train(recipe: str, name: str, out: Path, data: Path, *overrides: str) -> dict:
    runs = out / "runs"
    shutil.rmtree(runs / name, ignore_errors=True)
    command = [sys.executable, "-m", "vitrain", "train", recipe, f"data.root={data}", f"log.out_dir={runs}"]
    command += [f"name={name}", "log.progress=false", *overrides]
    print(f"[{time.strftime('%H:%M:%S')}] {name}: vitrain {' '.join(command[3:])}", flush=True)
    begin = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - begin
    keep_run_record(runs / name, out / "metrics" / name)
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        raise SystemExit(f"{name} failed: {last}")
    summary = json.loads((runs / name / "summary.json").read_text())
    row = {
        "run": name,
        "recipe": recipe,
        "command": "vitrain " + " ".join(command[3:]),
        "command_wall_s": wall,
        "val_video_top1": summary["val_video_top1"],
        "val_top1": summary["val_top1"],
        "best_val_video_top1": summary.get("best_val_video_top1"),
        "ema_val_video_top1": summary.get("ema_val_video_top1"),
        "epochs": summary.get("epochs"),
        "precision": summary.get("precision"),
        "steps": summary.get("steps"),
    }
    if "baseline" in summary:
        row["baseline"] = summary["baseline"]
    print(f"    video top-1 {100 * row['val_video_top1']:.2f}%, clip top-1 {100 * row['val_top1']:.2f}%, {wall:.0f} s")
    return row


def table(rows: list[dict], cpu: str) -> str:
    lines = [
        "# Weizmann actions (4 classes), actors 6-8 held out: video models vs frame-averaged image baseline",
        "",
        f"{cpu}. Video top-1: each held-out video's clips (task.eval_clips) averaged; clip top-1: single clips. The",
        "last evaluation of each run (after its last epoch). Command wall: the whole `vitrain train` process.",
        "",
        "| run | video top-1 | clip top-1 | EMA video top-1 | epochs | command wall | precision |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        ema = "" if row.get("ema_val_video_top1") is None else f"{100 * row['ema_val_video_top1']:.2f}"
        lines.append(
            f"| {row['run']} | {100 * row['val_video_top1']:.2f} | {100 * row['val_top1']:.2f} | {ema} | "
            f"{row.get('epochs')} | {row['command_wall_s']:.0f} s | {row['precision']} |"
        )
    groups: dict[str, list[float]] = {}
    for row in rows:
        groups.setdefault(row["run"].rsplit("-seed", 1)[0], []).append(row["val_video_top1"])
    lines += ["", "| model | seeds | video top-1 median (min-max) |", "|---|---:|---:|"]
    for group, values in groups.items():
        figures = spread([100 * v for v in values])  # the range written out for one seed too
        lines.append(
            f"| {group} | {len(values)} | {figures['median']:.2f} ({figures['min']:.2f}-{figures['max']:.2f}) |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds (default 0-4)")
    parser.add_argument("--frames", default="", help="seeds that also read the frame folders")
    parser.add_argument(
        "--models", default="baseline,video", help="of baseline, video (space-time ViT) and mvit (MViTv2), in order"
    )
    parser.add_argument("--data", type=Path, default=DATA, help="weizmann4-video.zip or its unpacked tree")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "video-weizmann")
    args = parser.parse_args()
    if not args.data.exists():
        sys.exit(f"--data {args.data} not found: pass ../shared/data/weizmann4-video.zip")
    args.out.mkdir(parents=True, exist_ok=True)
    cpu = cpu_description()
    models = args.models.split(",")
    unknown = sorted(set(models) - {"baseline", "video", "mvit"})
    if unknown:
        sys.exit(f"--models {unknown[0]} is not one of baseline, video, mvit")
    rows = []
    for seed in [int(s) for s in args.seeds.split(",") if s]:
        link = []  # the video runs carry this seed's baseline where it ran
        if "baseline" in models:
            base = train("video-weizmann-baseline", f"baseline-seed{seed}", args.out, args.data, f"train.seed={seed}")
            rows.append(base)
            link = [f"task.baseline_run={args.out / 'runs' / base['run']}"]
        if "video" in models:
            rows.append(train("video-weizmann", f"video-seed{seed}", args.out, args.data, f"train.seed={seed}", *link))
        if "mvit" in models:
            recipe = "video-weizmann-mvit"
            rows.append(train(recipe, f"mvit-seed{seed}", args.out, args.data, f"train.seed={seed}", *link))
        if str(seed) in args.frames.split(","):
            rows.append(
                train(
                    "video-weizmann",
                    f"video-frames-seed{seed}",
                    args.out,
                    args.data,
                    f"train.seed={seed}",
                    "data.video_frames=true",
                )  # fmt: skip
            )
        (args.out / "results.json").write_text(json.dumps({"cpu": cpu, "rows": rows}, indent=2) + "\n")
        (args.out / "table.md").write_text(table(rows, cpu))
    print((args.out / "table.md").read_text())


if __name__ == "__main__":
    main()
