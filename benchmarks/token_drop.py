"""Token dropping's step time: ViT-S/16 at 224 px with train.token_drop=0.5 against every token, interleaved.

    python benchmarks/token_drop.py --out results/token-drop/cpu.json

Both trainers are built first in this one process, from the same config but for train.token_drop (synthetic
ImageNet-shaped images, fp32, AdamW, one process; what `vitrain train` builds). Each takes --warmup untimed steps;
then in each of --rounds rounds each takes --steps timed optimizer steps in turn (the trainer's own step,
vitrain/engine/step.py, as `fit` and `vitrain bench` call it), so a load passing over the machine slows both alike.
Reported: each one's median step time and its spread (min, quartiles, max) over all its timed steps, the ratio of
the medians, the median of the per-round ratios, and the ratio the model's FLOP count predicts.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from vitrain.bench.step import IMAGENET_SHAPED
from vitrain.config import load_config
from vitrain.data.loader import endless
from vitrain.device import cpu_description
from vitrain.engine import Trainer
from vitrain.models import model_complexity


def build(drop: float, args: argparse.Namespace, scratch: str):  # noqa: ANN201 (the trainer and its batches)
    overrides = [
        f"name=token-drop-{drop}",
        f"model.preset={args.preset}",
        *IMAGENET_SHAPED,
        f"train.batch_size={args.batch}",
        f"data.synthetic_samples={4 * args.batch}",
        f"train.threads={args.threads}",
        "precision.mode=fp32",  # what auto picks on a CPU without AMX; fixed, so that nothing races first
        "model.attention=sdpa",
        f"train.token_drop={drop}",
        "log.progress=false",
        f"log.out_dir={scratch}",
    ]
    trainer = Trainer(load_config(None, overrides))
    return trainer, endless(trainer.train_loader)


def quartiles(values: list[float]) -> dict[str, float]:
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"min": min(values), "q1": q1, "median": median, "q3": q3, "max": max(values)}


def lscpu_model() -> str:
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return platform.processor()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name")), "unknown")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="vit_small_patch16")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--drop", type=float, default=0.5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    os.environ["VITRAIN_AUTOTUNE"] = "0"

    with tempfile.TemporaryDirectory(prefix="vitrain-token-drop-") as scratch:
        runs = {"every token": build(0.0, args, scratch), f"token_drop={args.drop:g}": build(args.drop, args, scratch)}
        seconds: dict[str, list[float]] = {label: [] for label in runs}
        counter = dict.fromkeys(runs, 0)

        def step(label: str) -> float:
            trainer, batches = runs[label]
            begin = time.perf_counter()
            trainer.train_step(itertools.islice(batches, 1), trainer.cfg.optim.lr, steps_done=counter[label])
            counter[label] += 1
            return time.perf_counter() - begin

        for label in runs:
            for _ in range(args.warmup):
                step(label)
        began = time.perf_counter()
        for _ in range(args.rounds):
            for label in runs:
                seconds[label] += [step(label) for _ in range(args.steps)]
        wall_s = time.perf_counter() - began
        full, dropped = (runs[label][0] for label in runs)
        patches = (full.cfg.model.image_size // full.cfg.model.patch_size) ** 2
        kept = dropped.train_step.token_drop.kept_patches(patches)
        flops = {
            "every token": model_complexity(full.model).train_flops,
            f"token_drop={args.drop:g}": model_complexity(dropped.model, kept).train_flops,
        }
        for trainer, batches in runs.values():
            batches.close()
            trainer.close()

    full_label, drop_label = list(runs)
    spread = {label: quartiles(values) for label, values in seconds.items()}
    per_round = [
        statistics.median(seconds[drop_label][r * args.steps : (r + 1) * args.steps])
        / statistics.median(seconds[full_label][r * args.steps : (r + 1) * args.steps])
        for r in range(args.rounds)
    ]
    result = {
        "command": shlex.join(["python", *sys.argv]),
        "model": f"{args.preset} @ 224 px, batch {args.batch}, fp32, AdamW, one process x {args.threads} thread(s)",
        "patch_tokens": patches,
        "kept_patch_tokens": kept,
        "device": cpu_description(),
        "lscpu_model_name": lscpu_model(),
        "torch": torch.__version__,
        "warmup_steps_each": args.warmup,
        "rounds": args.rounds,
        "timed_steps_per_round_each": args.steps,
        "wall_s": wall_s,
        "step_s": seconds,
        "step_s_spread": spread,
        "ratio_of_medians": spread[drop_label]["median"] / spread[full_label]["median"],
        "per_round_ratios": per_round,
        "median_per_round_ratio": statistics.median(per_round),
        "flops_ratio": flops[drop_label] / flops[full_label],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# Token dropping: {result['model']}",
        "",
        f"- {result['device']} (lscpu: {result['lscpu_model_name']}); torch {result['torch']}",
        f"- Command: `{result['command']}` ({wall_s:.0f} s of timed rounds)",
        f"- {args.rounds} interleaved rounds x {args.steps} timed steps each, after {args.warmup} warm-up steps each; "
        f"{kept} of {patches} patch tokens kept",
        "",
        "| run | median step s | min | q1 | q3 | max |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, s in spread.items():
        lines.append(
            f"| {label} | {s['median']:.3f} | {s['min']:.3f} | {s['q1']:.3f} | {s['q3']:.3f} | {s['max']:.3f} |"
        )
    lines += [
        "",
        f"Step time with token dropping: **{result['ratio_of_medians']:.3f}x** the step with every token (ratio of "
        f"medians; per-round ratios {min(per_round):.3f}-{max(per_round):.3f}, median "
        f"{result['median_per_round_ratio']:.3f}). "
        f"The model's FLOP count predicts {result['flops_ratio']:.3f}x.",
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
