"""CIFAR-10 time to accuracy: vitrain's recipe, the usual timm-style baseline and the recipe less one switch at a time,
each under the same wall-clock budget on this machine, one after the other.

    python benchmarks/cifar_time_to_accuracy.py                         # every row, 20 minutes each
    python benchmarks/cifar_time_to_accuracy.py --rows recipe,baseline  # the two the plot compares
    python benchmarks/cifar_time_to_accuracy.py --rows no-ema --out DIR # add a row to an earlier table

Each row is one `vitrain train` command (its own process, timed whole: Python start, data decoding, autotune and
evaluations included), the recipe's own: both recipes carry the 20-minute budget (`train.time_limit_s`) and
evaluations at 5, 10 and 15 minutes (`train.eval_at_s`); the script adds only where the run goes, and for an
ablation its one changed switch. Top-1 at 5 and 10 minutes is the evaluation made at the first step past the mark;
at 20 minutes it is the run's last evaluation, and the command's whole wall time is in the table to show it fits.
Plain test top-1 throughout (no test-time flip). `--budget-min` other than 20 rescales the budget and the marks.

Writes OUT/table.md, OUT/results.json (rows from an earlier run in OUT that were not rerun are kept) and
OUT/curves.png (`vitrain plot` of the recipe and the baseline); OUT defaults to results/cifar_time_to_accuracy. The
run folders are OUT/runs/ROW (ignored by git); each row's summary, config, autotune choice and log are copied to
OUT/metrics/ROW. The per-step metrics.jsonl is kept only for the rows the plot draws, compacted (training records
keep step, epoch, wall_s, loss, lr and image size to 5 significant digits; evaluation records whole), as
OUT/metrics/ROW/metrics.jsonl, which `vitrain plot` reads; every other row's figures are in results.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA = REPO.parent / "shared" / "data" / "cifar10-jpg.zip"
MARKS_MIN = (5, 10, 20)
DEFAULT_BUDGET_S = 1200.0
TRAIN_IMAGES = 50_000  # CIFAR-10's training split
PLOTTED = ("recipe", "baseline")  # the rows curves.png draws: only these keep their per-step metrics
TRAIN_KEYS = ("step", "epoch", "wall_s", "loss", "lr", "image_size")  # what a compact training record keeps

HALF_WIDTH = [
    "model.width=64",
    "model.heads=2",
    "model.mlp_dim=128",
    "model.stem_channels=[16,32,64]",
    "model.pool=cls",
]

# name -> (recipe, overrides, what the row shows). The ablations take one switch of the recipe back to the plain
# choice; the baseline is the usual recipe of another library.
ROWS: dict[str, tuple[str, list[str], str]] = {
    "recipe": ("cifar10-fast", [], "vitrain's recipe: vitrain train cifar10-fast"),
    "baseline": ("cifar10-baseline", [], "timm-style ViT-Ti/4, AdamW 1e-3, cosine, batch 128, flip + crop, fp32"),
    "adamw": ("cifar10-fast", ["optim.name=adamw"], "recipe with AdamW for every tensor instead of Muon for matrices"),
    "mlp-512": ("cifar10-fast", ["model.mlp_dim=512"], "recipe with the usual 4 x width MLP (512) instead of 256"),
    "no-conv-stem": ("cifar10-fast", ["model.patch_embed=linear"], "recipe with the linear patch embedding"),
    "no-progressive-resizing": ("cifar10-fast", ["data.min_size=0"], "recipe at 32 px throughout"),
    "cosine": (
        "cifar10-fast",
        ["schedule.name=warmup_cosine", "schedule.warmup_epochs=1"],
        "recipe with warmup + cosine (over the same time budget) instead of 1cycle",
    ),
    "no-label-smoothing": ("cifar10-fast", ["train.label_smoothing=0"], "recipe without label smoothing"),
    "no-flip": ("cifar10-fast", ["data.hflip=0"], "recipe without horizontal flips"),
    "with-crop": ("cifar10-fast", ["data.crop_padding=4"], "recipe plus random crops (padding 4)"),
    "with-ema": ("cifar10-fast", ["train.ema=0.995"], "recipe plus a weight average (EMA top-1 in brackets)"),
    "fp32": (
        "cifar10-fast",
        ["precision.mode=fp32", "model.attention=sdpa"],
        "recipe in fp32 with sdpa instead of what autotune picks",
    ),
    # Issue 31's switches, each added to the recipe alone (timm/DeiT defaults).
    "randaugment": ("cifar10-fast", ["data.randaugment=rand-m9-mstd0.5-inc1"], "recipe plus RandAugment (DeiT's)"),
    "three-augment": ("cifar10-fast", ["data.three_augment=true"], "recipe plus DeiT III's 3-Augment"),
    "random-erasing": ("cifar10-fast", ["data.random_erasing=0.25"], "recipe plus random erasing (DeiT's 0.25)"),
    "repeated-aug": ("cifar10-fast", ["data.repeated_aug=3"], "recipe plus repeated augmentation (3 copies)"),
    "no-token-drop": (
        "cifar10-fast",
        ["train.token_drop=0", "train.epochs=30"],
        "recipe on every patch token throughout (the recipe before issue 31: 84.17% on the Zen 5)",
    ),
    # A student half the recipe's width (DeiT's distillation needs a class token), taught by the recipe row's run
    # ({runs}/recipe: run that row first), and the same student without a teacher.
    "student": ("cifar10-fast", HALF_WIDTH, "a ViT half the recipe's width, class token, no teacher"),
    "student-distilled": (
        "cifar10-fast",
        [*HALF_WIDTH, "train.distill.teacher={runs}/recipe", "train.distill.type=hard"],
        "the half-width student with DeiT's hard distillation from the recipe row's model",
    ),
}


def cpu_line() -> str:
    done = subprocess.run(
        [sys.executable, "-c", "from vitrain.device import cpu_description; print(cpu_description())"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    return done.stdout.strip() or "CPU: unknown"


def compact_metrics(source: Path, dest: Path) -> None:
    """`source` (a run's metrics.jsonl) as `dest`, smaller: evaluation records whole, training records only the
    fields the plot and the docs use, floats to 5 significant digits."""
    lines = []
    for line in source.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if "loss" in record and not any(k.startswith(("val_", "ema_val_")) for k in record):
            record = {k: float(f"{v:.5g}") if isinstance(v, float) else v for k, v in record.items() if k in TRAIN_KEYS}
        lines.append(json.dumps(record))
    dest.write_text("\n".join(lines) + "\n")


def run_row(name: str, budget_s: float, data: Path, out: Path) -> dict:
    recipe, overrides, what = ROWS[name]
    run_dir = out / "runs"
    command = [
        sys.executable,
        "-m",
        "vitrain",
        "train",
        recipe,
        f"data.root={data}",
        f"log.out_dir={run_dir}",
        f"name={name}",
        "log.progress=false",
        *(o.replace("{runs}", str(run_dir)) for o in overrides),
    ]
    if budget_s != DEFAULT_BUDGET_S:  # the recipes' own budget and marks are for 20 minutes
        scale = budget_s / DEFAULT_BUDGET_S
        marks = ",".join(f"{m * 60 * scale:g}" for m in (5, 10, 15))
        # The recipes leave 30 s of the 20 minutes for the process's start and exit, which do not shrink with it.
        command += [f"train.time_limit_s={budget_s - 30:g}", f"train.eval_at_s=[{marks}]"]
    shutil.rmtree(run_dir / name, ignore_errors=True)  # the row starts fresh (a rerun replaces it)
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {' '.join(command[2:])}", flush=True)
    begin = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - begin
    folder = run_dir / name
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "logs" / f"{name}.txt").write_text(done.stderr)
    row = {"row": name, "what": what, "command": "vitrain " + " ".join(command[3:]), "command_wall_s": wall}
    kept = out / "metrics" / name  # what git keeps of the run (runs/ holds checkpoints and is ignored)
    shutil.rmtree(kept, ignore_errors=True)
    kept.mkdir(parents=True)
    for file in ("summary.json", "config.yaml", "autotune.json", "log.txt"):
        if (folder / file).exists():
            shutil.copy2(folder / file, kept / file)
    if name in PLOTTED and (folder / "metrics.jsonl").exists():
        compact_metrics(folder / "metrics.jsonl", kept / "metrics.jsonl")
    if done.returncode != 0:
        row["error"] = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        return row
    evals = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if "val_top1" in line]
    summary = json.loads(done.stdout[done.stdout.index("{") :])
    for minutes in MARKS_MIN:
        mark = minutes * 60 * budget_s / DEFAULT_BUDGET_S
        if mark >= budget_s:  # the budget's end: the run's last evaluation
            point = evals[-1] if evals and wall <= budget_s else None
        else:  # the evaluation made at the first step past the mark
            point = next((e for e in evals if e["wall_s"] >= mark), None)
        row[f"top1_{minutes}min"] = point["val_top1"] if point else None
        row[f"ema_top1_{minutes}min"] = point.get("ema_val_top1") if point else None
    row |= {
        "final_top1": summary["val_top1"],
        "final_ema_top1": summary.get("ema_val_top1"),
        "images_per_s": summary["images_per_s"],
        "epochs_seen": summary["steps"] * summary["global_batch"] / TRAIN_IMAGES,
        "steps": summary["steps"],
        "precision": summary["precision"],
        "curve": [(e["wall_s"], e["val_top1"]) for e in evals],
        "run_dir": str(kept.relative_to(out)),
    }
    return row


def pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.2f}"


def table(rows: list[dict], budget_s: float, cpu: str) -> str:
    lines = [
        f"# CIFAR-10 time to accuracy ({budget_s / 60:g}-minute budget per row; columns at 1/4, 1/2 and all of it)",
        "",
        f"{cpu}. torch threads: the machine's default. Plain test top-1 (%) of the 10,000 test images; in brackets the",
        "weight average (EMA) where the row keeps one. Command wall: the whole `vitrain train` process.",
        "",
        "| row | 5 min | 10 min | 20 min | command wall | images/s | epochs | precision | what |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['row']} | failed: {row['error']} | | | | | | | {row['what']} |")
            continue
        cells = []
        for minutes in MARKS_MIN:
            plain, ema = row.get(f"top1_{minutes}min"), row.get(f"ema_top1_{minutes}min")
            cells.append(pct(plain) + (f" ({pct(ema)})" if ema is not None else ""))
        lines.append(
            f"| {row['row']} | {' | '.join(cells)} | {row['command_wall_s']:.0f} s | {row['images_per_s']:.0f} | "
            f"{row.get('epochs_seen', 0):.1f} | {row['precision']} | {row['what']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, from: {', '.join(ROWS)}")
    parser.add_argument("--budget-min", type=float, default=20.0, help="wall-clock budget per row (default 20)")
    parser.add_argument("--data", type=Path, default=DATA, help="the CIFAR-10 JPEG tree or zip")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "cifar_time_to_accuracy")
    args = parser.parse_args()
    names = [n for n in args.rows.split(",") if n]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        sys.exit(f"--rows: unknown row {unknown[0]}; choose from {', '.join(ROWS)}")
    if not args.data.exists():
        sys.exit(f"--data {args.data} not found: pass the CIFAR-10 JPEG zip (../shared/data/cifar10-jpg.zip)")
    args.out.mkdir(parents=True, exist_ok=True)
    budget_s = args.budget_min * 60
    results_file = args.out / "results.json"
    earlier = json.loads(results_file.read_text()) if results_file.exists() else {"rows": []}
    cpu = cpu_line()
    rows = {row["row"]: row for row in earlier["rows"]}
    for name in names:
        row = run_row(name, budget_s, args.data, args.out)
        row["cpu"] = cpu
        rows[name] = row
        ordered = [rows[n] for n in ROWS if n in rows]
        results_file.write_text(json.dumps({"budget_s": budget_s, "rows": ordered}, indent=2) + "\n")
        (args.out / "table.md").write_text(table(ordered, budget_s, cpu))
        print(table([row], budget_s, cpu).splitlines()[-1], flush=True)
    plotted = [n for n in PLOTTED if n in rows and "error" not in rows[n]]
    if plotted:
        subprocess.run(
            [sys.executable, "-m", "vitrain", "plot", *(str(args.out / rows[n]["run_dir"]) for n in plotted)]
            + ["--names", ",".join(plotted), "--out", str(args.out / "curves.png")],
            cwd=REPO,
        )  # without matplotlib this says how to get it; the table and results.json are written already
    print((args.out / "table.md").read_text())


if __name__ == "__main__":
    main()
