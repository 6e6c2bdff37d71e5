"""Train the digits recipe in fp32 and in each bf16 mode for several seeds and compare final val_top1 per seed.

    python benchmarks/precision_digits.py --seeds 0 1 2            # fp32, amp_o1, amp_o2, pure (bf16)

Every run is `vitrain train digits` with `train.seed=S precision.mode=M precision.dtype=bf16`;
`--jobs` runs go at once, each with `train.threads=1` (the default 2 fills this machine's 2 cores). bf16 is
slow on a CPU without bf16 matmul units (about 2-3x fp32's time per run here). The table gives each mode's
val_top1 minus fp32's for the same seed, in points; the results go to results/precision_digits.json.
This measures accuracy, not speed: wall times are printed for planning only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODES = ("fp32", "amp_o1", "amp_o2", "pure")


def train(mode: str, seed: int, args: argparse.Namespace) -> dict:
    name = f"digits-{mode}-seed{seed}"
    run_dir = Path(args.out_dir) / name
    command = [
        sys.executable, "-m", "vitrain", "train", "digits",
        f"name={name}", f"log.out_dir={args.out_dir}", "log.progress=false", f"train.threads={args.threads}",
        f"train.seed={seed}", f"precision.mode={mode}", "precision.dtype=bf16", *args.overrides,
    ]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{name} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    print(f"{name:<26} val_top1 {summary['val_top1']:.4f}  {seconds:6.0f} s", flush=True)
    return {"mode": mode, "seed": seed, "val_top1": summary["val_top1"], "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--jobs", type=int, default=2, help="runs at once")
    parser.add_argument("--threads", type=int, default=1, help="train.threads of each run")
    parser.add_argument("--out-dir", default="/tmp/vitrain-precision-digits")
    parser.add_argument("--results", default=str(REPO / "results" / "precision_digits.json"))
    parser.add_argument("overrides", nargs="*", help="more config overrides for every run, key=value")
    args = parser.parse_args()
    if "fp32" not in args.modes:
        args.modes.insert(0, "fp32")
    out = Path(args.out_dir)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"--out-dir {out} is not empty; remove it or pass another folder")

    jobs = [(mode, seed) for seed in args.seeds for mode in args.modes]
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda job: train(*job, args), jobs))
    top1 = {(r["mode"], r["seed"]): r["val_top1"] for r in rows}
    low_modes = [m for m in args.modes if m != "fp32"]
    print("\nval_top1 minus fp32's, same seed, in points (1 point = 1% of the validation images)")
    print("seed  fp32    " + "  ".join(f"{m:>7}" for m in low_modes))
    worst = 0.0
    for seed in args.seeds:
        reference = top1[("fp32", seed)]
        gaps = [100 * (top1[(m, seed)] - reference) for m in low_modes]
        worst = max([worst, *map(abs, gaps)])
        print(f"{seed:>4}  {reference:.4f}  " + "  ".join(f"{g:+7.2f}" for g in gaps))
    print(f"largest gap: {worst:.2f} points")
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(
        json.dumps(
            {"threads": args.threads, "overrides": args.overrides, "rows": rows, "largest_gap_points": worst}, indent=2
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
