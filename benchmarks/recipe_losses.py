"""Per-step training losses of shipped recipes (fp32, seed 0, fixed kernels): did a refactor change a number?

    python benchmarks/recipe_losses.py --out before.json                 # digits 20 steps, face-orl and cifar10-fast 10
    python benchmarks/recipe_losses.py --out after.json --compare before.json   # exit 1 if any loss moved > 1e-6

Each recipe runs as `vitrain train NAME precision.mode=fp32 train.seed=0 log.every_steps=1 train.max_steps=N` in
its own process with autotune off (attention is then sdpa) and the schedule on steps instead of the wall clock
(cifar10-fast's lr otherwise depends on how fast the machine is). The losses are read from the run's metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
RECIPES = {
    "digits": (20, []),
    "face-orl": (10, [f"data.root={DATA / 'orl-faces.zip'}"]),
    "cifar10-fast": (
        10,
        [
            f"data.root={DATA / 'cifar10-jpg.zip'}",
            "schedule.horizon=steps",
            "train.time_limit_s=0",
            "train.eval_at_s=[]",
        ],
    ),
}
TOLERANCE = 1e-6


def recipe_losses(name: str, steps: int, extra: list[str], out_dir: Path) -> list[float]:
    command = [
        sys.executable, "-m", "vitrain", "train", name, "precision.mode=fp32", "train.seed=0", "log.every_steps=1",
        f"train.max_steps={steps}", "log.progress=false", f"log.out_dir={out_dir}", *extra,
    ]  # fmt: skip
    env = {**os.environ, "VITRAIN_AUTOTUNE": "0"}
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in (out_dir / name / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r and not r.get("skipped")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--compare", type=Path, help="an earlier --out file: exit 1 where a loss differs by > 1e-6")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    args = parser.parse_args()
    losses = {}
    for name in args.recipes.split(","):
        steps, extra = RECIPES[name]
        with tempfile.TemporaryDirectory() as scratch:
            losses[name] = recipe_losses(name, steps, extra, Path(scratch))
        print(f"{name}: {len(losses[name])} steps, last loss {losses[name][-1]:.6f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(losses, indent=2) + "\n")
    if args.compare is None:
        return 0
    before = json.loads(args.compare.read_text())
    worst = 0.0
    for name, values in losses.items():
        if len(values) != len(before[name]):
            print(f"{name}: {len(values)} steps now, {len(before[name])} before")
            return 1
        diff = max(abs(a - b) for a, b in zip(values, before[name], strict=True))
        worst = max(worst, diff)
        print(f"{name}: max |loss now - loss before| over {len(values)} steps = {diff:.3g}")
    print(f"{'equal' if worst <= TOLERANCE else 'DIFFERENT'} within {TOLERANCE:g} (largest difference {worst:.3g})")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
