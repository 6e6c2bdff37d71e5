"""`vitrain bench` rows: the video and detection models (AC, zero3) and the data sources; rates, memory, rounds.

    python benchmarks/task_bench.py video       --out results/video-bench       # ViViT-S/16x2, 8 frames of 112 px
    python benchmarks/task_bench.py detection   --out results/detection-bench   # ViTDet of detection-bccd at 512 px
    python benchmarks/task_bench.py sources     --out results/loader-sources/train-step   # CIFAR-10 from each source

Every row is `vitrain bench run RECIPE overrides` in its own processes (vitrain/bench/ladder.py's runner: a row's
peak memory is its own; 2-rank rows run under torchrun, 1 thread per rank on a CPU, the 1-process rows with every
core), rows taking turns for `--repeats` rounds so that a drift of the machine touches every row alike. A row gives
its median clips/s (images/s) with the spread over the rounds, its ratio to the first row taken round by round, and
the largest peak memory over its rounds (process peak RSS on a CPU, the allocator's peak on a GPU; the largest rank's).

video: the space-time ViT-S/16 (tubelets 2x16x16), 8 frames of 112 px (4 x 7 x 7 = 196 tokens), batch 4 per
process, fp32, synthetic clips (`--synthetic`: the step, not the decoder): plain, activation checkpointing per block,
zero3 on 2 ranks with and without it.
detection: the `detection-bccd` recipe's ViTDet (width 192, depth 6, window 8, global blocks 2 and 5; FCOS head)
on the BCCD images at 512 px (a 32 x 32 map), batch 2 per process, fp32: windowed attention, the same with
activation checkpointing, every block global (`model.window_size=0`), zero3 on 2 ranks; and the recipe's own
256 px step. Needs ../shared/data/bccd-detection.zip (or --bccd).
sources: the CIFAR-10 recipe's training step (`cifar10-fast`'s model, batch 256, fp32, 10 timed steps after 3) fed
by each data source: the zip decoded into memory at start (`folder`, the recipe's own), WebDataset shards streamed
by 2 worker processes (`cifar10-shards`' data settings), and MXNet RecordIO read per batch; the loader's wait
counts in the step (the trainer's own `data` phase). Packs the shards and the RecordIO file under --packed first
when they are not there (`vitrain data pack`, the commands docs/data.md gives).

Writes OUT/table.json and OUT/table.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from vitrain.bench import write_results
from vitrain.bench.ladder import Row, peak_gib, run_row, settle
from vitrain.bench.spread import format_spread, paired_ratio, spread
from vitrain.device import cpu_description

REPO = Path(__file__).resolve().parent.parent
BCCD = REPO.parent / "shared" / "data" / "bccd-detection.zip"

VIDEO = [
    "model.preset=video_vit_small_patch16",
    "model.num_frames=8",
    "model.image_size=112",
    "model.num_classes=400",
    "train.batch_size=4",
    "precision.mode=fp32",
    "train.ema=0",  # the recipe's weight average is refused under zero3
    "--synthetic",
]
# name, processes, overrides beyond the set's own
VIDEO_ROWS = [
    ("plain", 1, []),
    ("activation checkpointing (block)", 1, ["parallel.activation_checkpointing=block"]),
    ("zero3, 2 ranks", 2, ["parallel.strategy=zero3"]),
    ("zero3 + activation checkpointing, 2 ranks", 2, ["parallel.strategy=zero3",
                                                      "parallel.activation_checkpointing=block"]),
]  # fmt: skip
DETECTION = ["model.image_size=512", "train.batch_size=2", "precision.mode=fp32", "data.prefetch=0"]
DETECTION_ROWS = [
    ("windowed (window 8, global blocks 2 and 5), 512 px", 1, []),
    ("windowed + activation checkpointing (block), 512 px", 1, ["parallel.activation_checkpointing=block"]),
    ("every block global (window_size=0), 512 px", 1, ["model.window_size=0"]),
    ("windowed, zero3, 2 ranks, 512 px", 2, ["parallel.strategy=zero3"]),
    ("the recipe's step: 256 px, batch 8", 1, ["model.image_size=256", "train.batch_size=8"]),
]

CIFAR = REPO.parent / "shared" / "data" / "cifar10-jpg.zip"
SOURCES = ["train.batch_size=256", "precision.mode=fp32", "train.ema=0"]


def source_rows(cifar: Path, packed: Path) -> list[tuple[str, int, list[str]]]:
    """The sources set's rows; packs the CIFAR-10 zip into shards and a RecordIO file under `packed` if missing."""
    if not cifar.exists():
        sys.exit(f"--cifar {cifar} not found: pass the path of cifar10-jpg.zip")
    shards, rec = packed / "cifar10-shards", packed / "cifar10-rec"
    for target, extra in ((shards, ["--format", "shards", "--shard-samples", "5000"]), (rec, ["--format", "recordio"])):
        if not target.exists():
            command = [sys.executable, "-m", "vitrain", "data", "pack", str(cifar), str(target), *extra]
            print("packing:", " ".join(command[1:]), flush=True)
            subprocess.run(command, check=True, cwd=REPO)
    return [
        ("folder: the zip decoded into memory at start", 1, [f"data.root={cifar.resolve()}"]),
        ("shards: streamed, 2 worker processes decode each batch", 1,
         ["data.source=shards", f"data.root={shards.resolve()}", "data.loader_workers=2", "data.shuffle_buffer=2000"]),
        ("recordio: read and decoded per batch", 1, ["data.source=recordio", f"data.root={rec.resolve()}"]),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("set", choices=("video", "detection", "sources"))
    parser.add_argument("--out", type=Path, help="default results/<set>-bench")
    parser.add_argument("--repeats", type=int, default=3, help="rounds, rows taking turns (default 3)")
    parser.add_argument("--steps", type=int, help="timed steps per round (default 3; sources: 10)")
    parser.add_argument("--warmup", type=int, help="untimed steps per round (default 1; sources: 3)")
    parser.add_argument("--bccd", type=Path, default=BCCD, help="the BCCD zip (detection)")
    parser.add_argument("--cifar", type=Path, default=CIFAR, help="cifar10-jpg.zip (sources)")
    parser.add_argument("--packed", type=Path, default=REPO / "runs" / "data", help="where the packed sets go")
    args = parser.parse_args()
    out = args.out or REPO / "results" / f"{args.set}-bench"
    args.steps = args.steps or (10 if args.set == "sources" else 3)
    args.warmup = args.warmup if args.warmup is not None else (3 if args.set == "sources" else 1)
    out.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    if args.set == "video":
        recipe, base, rows_spec, unit = "video-weizmann", VIDEO, VIDEO_ROWS, "clips/s"
    elif args.set == "detection":
        if not args.bccd.exists():
            sys.exit(f"--bccd {args.bccd} not found: pass the path of bccd-detection.zip")
        recipe, rows_spec, unit = "detection-bccd", DETECTION_ROWS, "images/s"
        base = [f"data.root={args.bccd.resolve()}", *DETECTION]
    else:
        recipe, rows_spec, unit, base = "cifar10-fast", source_rows(args.cifar, args.packed), "images/s", SOURCES
    # `vitrain bench run` takes the config overrides before its flags (--synthetic)
    rows = [
        (Row(name, args.set, lambda ctx: []), nproc, sorted(base + extra, key=lambda o: o.startswith("--")))
        for name, nproc, extra in rows_spec
    ]
    for round_ in range(args.repeats):
        for row, nproc, overrides in rows:
            threads = cores if nproc == 1 else max(1, cores // nproc)
            print(f"[{time.strftime('%H:%M:%S')}] round {round_ + 1}/{args.repeats}: {row.name}", flush=True)
            run_row(row, recipe, overrides, nproc, args.steps, args.warmup, "", threads)
    for row, _, _ in rows:
        settle(row, args.repeats)

    cpu = cpu_description()
    reference = rows[0][0]
    lines = [
        f"# `vitrain bench` rows: {args.set}",
        "",
        f"{cpu}; {cores} cores. `python benchmarks/task_bench.py {args.set}`: {args.repeats} rounds, rows taking",
        f"turns, {args.warmup} warm-up + {args.steps} timed steps per round. Rate: median (min-max) over the rounds;",
        "ratio: to the first row, round by round (`~`: the spread reaches across 1.0x); memory: the largest peak over",
        "the rounds (process peak RSS on a CPU: the whole process, not the activations alone; the largest rank's).",
        "",
        f"| row | processes | {unit} | vs first row | step ms | peak memory GiB | command |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    table_rows = []
    for row, nproc, _ in rows:
        if row.result is None:
            lines.append(f"| {row.name} | {nproc} | {row.status} | | | | `{row.command}` |")
            table_rows.append({"row": row.name, "processes": nproc, "status": row.status, "command": row.command})
            continue
        rates = [r["images_per_s"] for r in row.rounds]
        figures = spread(rates)
        paired = len(row.rounds) == len(reference.rounds)
        ratio = paired_ratio(rates, [r["images_per_s"] for r in reference.rounds]) if paired else None
        if row is reference:
            ratio_text = "1.00x (reference)"
        else:
            ratio_text = "" if ratio is None else ("~" if ratio["overlaps_1x"] else "") + format_spread(ratio, 2, "x")
        memory = peak_gib(row)
        step_ms = 1000 * row.result["step_s"]
        lines.append(
            f"| {row.name} | {nproc} | {format_spread(figures, 2)} | {ratio_text} | {step_ms:.0f} | {memory:.2f} | "
            f"`{row.command}` |"
        )
        table_rows.append({"row": row.name, "processes": nproc, "status": row.status, "command": row.command,
                           "rate": figures, "ratio_to_first": ratio, "median_round": row.result,
                           "rounds": row.rounds})  # fmt: skip
    figures = {"cpu": cpu, "set": args.set, "unit": unit, "rows": table_rows}
    write_results(out, "table", figures, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
