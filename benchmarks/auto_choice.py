"""Does `precision.mode=auto` pick as fast as the best fixed choice, without losing accuracy? Recipes side by side.

    python benchmarks/auto_choice.py                                  # digits and cifar10, results/auto_choice.*
    python benchmarks/auto_choice.py --recipes digits --rounds 5

Speed: `vitrain bench RECIPE --synthetic precision.mode=M` (the recipe's model, batch and step on random images of
its shape) for M in fp32, amp_o1, amp_o2 and auto, taking turns for `--rounds` rounds (each run a fresh process,
60 timed steps for digits, 10 for cifar10); the median images/s of each.
Every run keeps `model.attention=auto`, so only the precision differs; auto's first run pays its autotune, which is
cached for the rest (`vitrain bench` reports the step, not the tuning).
Accuracy: `vitrain train RECIPE` with fp32 and with auto on the same seed (cifar10 for `--cifar-epochs` epochs,
digits in full); auto's val_top1 minus fp32's in points.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODES = ("fp32", "amp_o1", "amp_o2", "auto")


def vitrain(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "vitrain", *args], capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        sys.exit(f"vitrain {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return done


def speed(recipe: str, extra: list[str], rounds: int, steps: int) -> dict:
    images_per_s: dict[str, list[float]] = {mode: [] for mode in MODES}
    precision: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(rounds):
            for mode in MODES:
                out = Path(scratch) / f"{mode}.json"
                vitrain(
                    "bench",
                    recipe,
                    f"precision.mode={mode}",
                    "model.attention=auto",
                    *extra,
                    "--synthetic",
                    "--steps",
                    str(steps),
                    "--json",
                    str(out),
                )
                result = json.loads(out.read_text())
                images_per_s[mode].append(result["images_per_s"])
                precision[mode] = result["precision"]
                device = result["device"]
            print(
                f"  {recipe} round {round_ + 1}: " + ", ".join(f"{m} {v[-1]:.1f}" for m, v in images_per_s.items()),
                file=sys.stderr,
            )
    medians = {mode: statistics.median(values) for mode, values in images_per_s.items()}
    fastest = max(("fp32", "amp_o1", "amp_o2"), key=medians.get)
    return {
        "device": device,
        "images_per_s": images_per_s,
        "median_images_per_s": medians,
        "auto_runs_as": precision["auto"],
        "fastest_fixed": fastest,
        "auto_vs_fastest_fixed": medians["auto"] / medians[fastest],
    }


def accuracy(recipe: str, extra: list[str], out_dir: Path) -> dict:
    top1 = {}
    for mode in ("fp32", "auto"):
        name = f"auto-choice-{recipe}-{mode}"
        started = time.perf_counter()
        done = vitrain(
            "train",
            recipe,
            f"precision.mode={mode}",
            "model.attention=auto",
            *extra,
            f"name={name}",
            f"log.out_dir={out_dir}",
            "log.progress=false",
        )
        summary = json.loads(done.stdout[done.stdout.index("{") :])
        top1[mode] = {
            "val_top1": summary["val_top1"],
            "precision": summary["precision"],
            "images_per_s": summary["images_per_s"],
            "wall_s": time.perf_counter() - started,
        }
        print(f"  {recipe} {mode}: val_top1 {summary['val_top1']:.4f} ({summary['precision']})", file=sys.stderr)
    return {"runs": top1, "auto_minus_fp32_points": 100 * (top1["auto"]["val_top1"] - top1["fp32"]["val_top1"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=["digits", "cifar10"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps per bench run (default: 60 for digits, 10 for others)"
    )
    parser.add_argument("--cifar-epochs", type=int, default=1, help="epochs of the cifar10 accuracy runs")
    parser.add_argument("--cifar-root", default=str(REPO.parent / "shared" / "data" / "cifar10-jpg.zip"))
    parser.add_argument("--out", default=str(REPO / "results" / "auto_choice"))
    args = parser.parse_args()
    started = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory() as runs:
        for recipe in args.recipes:
            extra = [f"data.root={args.cifar_root}"] if recipe == "cifar10" else []
            train_extra = extra + ([f"train.epochs={args.cifar_epochs}"] if recipe == "cifar10" else [])
            print(f"{recipe}: speed", file=sys.stderr)
            steps = args.steps or (60 if recipe == "digits" else 10)  # a digits step takes ~70 ms: time seconds
            results[recipe] = {"speed": speed(recipe, extra, args.rounds, steps)}
            print(f"{recipe}: accuracy", file=sys.stderr)
            results[recipe]["accuracy"] = accuracy(recipe, train_extra, Path(runs))
            results[recipe]["accuracy"]["train_overrides"] = train_extra
    report = {
        "command": " ".join(["python", "benchmarks/auto_choice.py", *sys.argv[1:]]),
        "wall_s": time.perf_counter() - started,
        "recipes": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(to_markdown(report))
    print(to_markdown(report))


def to_markdown(report: dict) -> str:
    lines = ["# precision.mode=auto against the fixed choices", ""]
    for recipe, r in report["recipes"].items():
        s, a = r["speed"], r["accuracy"]
        lines += [
            f"## {recipe}",
            "",
            f"- Device: {s['device']}",
            f"- Command: `{report['command']}`",
            f"- auto runs as **{s['auto_runs_as']}**; the fastest fixed choice is {s['fastest_fixed']}; auto / "
            f"fastest = **{s['auto_vs_fastest_fixed']:.3f}x**",
            "",
            "| precision.mode | images/s per round | median |",
            "|---|---|---:|",
        ]
        for mode, values in s["images_per_s"].items():
            lines.append(f"| {mode} | {', '.join(f'{v:.1f}' for v in values)} | {s['median_images_per_s'][mode]:.1f} |")
        runs = a["runs"]
        lines += [
            "",
            f"Accuracy (`vitrain train {recipe} {' '.join(a['train_overrides'])}`, same seed): fp32 val_top1 "
            f"{runs['fp32']['val_top1']:.4f}, auto ({runs['auto']['precision']}) {runs['auto']['val_top1']:.4f}: "
            f"**{a['auto_minus_fp32_points']:+.2f} points**.",
            "",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
