"""`vitrain bench RECIPE` of two source trees of vitrain, interleaved: did a change alter the step's speed?

    git worktree add /tmp/before 8101ab0
    python benchmarks/bench_two_trees.py --before /tmp/before --after . --recipe digits --out results/refactor-bench

Each repeat runs the before tree's and the after tree's `python -m vitrain bench RECIPE` once, the order swapped
every repeat (ABBA), in fresh processes (each tree first on PYTHONPATH, run from an empty folder so that the
installed copy is not picked), autotune off so that both run the same precision and attention. Reported: images/s
of each run, the median and spread per tree, and the ratio of the medians. Run one benchmark at a time: nothing
else should use the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def bench_once(tree: Path, recipe: str, steps: int, warmup: int, overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "bench.json"
        command = [sys.executable, "-m", "vitrain", "bench", recipe, *overrides, "--steps", str(steps),
                   "--warmup", str(warmup), "--json", str(out)]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(tree.resolve()), "VITRAIN_AUTOTUNE": "0"}
        subprocess.run(command, check=True, env=env, cwd=scratch, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="a source tree of vitrain (holds vitrain/)")
    parser.add_argument("--after", type=Path, required=True)
    parser.add_argument("--recipe", default="digits")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("overrides", nargs="*", help="section.key=value for both trees")
    args = parser.parse_args()
    runs: dict[str, list[float]] = {"before": [], "after": []}
    first = {}
    for repeat in range(args.repeats):
        pair = [("before", args.before), ("after", args.after)]
        for name, tree in pair if repeat % 2 == 0 else pair[::-1]:  # ABBA: neither tree always runs second
            result = bench_once(tree, args.recipe, args.steps, args.warmup, args.overrides)
            runs[name].append(result["images_per_s"])
            first.setdefault(name, result)
            print(f"repeat {repeat + 1}: {name} {result['images_per_s']:.1f} images/s", flush=True)
    medians = {name: statistics.median(values) for name, values in runs.items()}
    ratio = medians["after"] / medians["before"]
    meta = first["after"]
    summary = {
        "recipe": args.recipe,
        "overrides": args.overrides,
        "device": meta["device"],
        "threads": meta["threads"],
        "precision": {name: first[name]["precision"] for name in runs},
        "attention": {name: first[name]["attention"] for name in runs},
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "images_per_s": runs,
        "median_images_per_s": medians,
        "after_over_before": ratio,
        "command": " ".join(sys.argv),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_two_trees.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [
        f"# `vitrain bench {args.recipe}`: before and after, interleaved",
        "",
        f"{meta['device']}; {meta['threads']} thread(s); {args.steps} timed steps after {args.warmup} warm-up, "
        f"{args.repeats} interleaved repeats; precision {first['after']['precision']}, attention "
        f"{first['after']['attention']} (autotune off).",
        "",
        "| tree | median images/s | min | max | runs |",
        "|---|---:|---:|---:|---|",
    ]
    for name, values in runs.items():
        listed = ", ".join(f"{v:.0f}" for v in values)
        lines.append(f"| {name} | {medians[name]:.1f} | {min(values):.1f} | {max(values):.1f} | {listed} |")
    lines += ["", f"after / before (medians): {ratio:.3f}", "", f"command: `{summary['command']}`", ""]
    (args.out / "bench_two_trees.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
