"""How long a checkpoint save blocks the step loop, synchronous vs train.checkpoint_async, on 2 ranks (torchrun).

    python benchmarks/checkpoint_stall.py --out results/checkpoint-stall/cpu.json

For each model (ViT-S/16, ViT-B/16) and mode (sync, async), in interleaved rounds: a 2-rank DDP run on synthetic
64 px images (the stall depends on the state's size, not the image size), AdamW, fp32, checkpoints every
--every steps. Each save's blocked time is the trainer's `checkpoint_blocked_s` record (metrics.jsonl): the whole
collective write under sync; under async the copy of the state to host memory, plus any wait for the previous save
still being written. Reported: median and spread over all saves of all rounds, and the async/sync ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vitrain.device import cpu_description
from vitrain.presets import find_preset

REPO = Path(__file__).resolve().parent.parent
MODELS = {"vit_small_patch16": "ViT-S/16", "vit_base_patch16": "ViT-B/16"}


def one_run(out_dir: Path, preset: str, mode: str, steps: int, every: int) -> dict:
    name = f"{preset}-{mode}"
    p = find_preset(preset)  # every field given: the default recipe's own model fields would override a preset's
    arch = [f"model.width={p.width}", f"model.depth={p.depth}", f"model.heads={p.heads}", f"model.mlp_dim={p.mlp_dim}",
            f"model.patch_size={p.patch_size}", "model.in_chans=3"]  # fmt: skip
    args = [
        f"model.preset={preset}", *arch, "model.image_size=64", "model.num_classes=10", "data.source=synthetic",
        f"data.synthetic_samples={steps * 4 + 64}", "train.batch_size=2", "train.epochs=1", f"train.max_steps={steps}",
        f"train.checkpoint_every_steps={every}", "train.keep_checkpoints=1", "train.threads=1", "precision.mode=fp32",
        "parallel.strategy=ddp", f"train.checkpoint_async={mode == 'async'}", "log.progress=false",
        f"log.out_dir={out_dir}", f"name={name}",
    ]  # fmt: skip
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "vitrain", "train", *args]  # fmt: skip
    env = {**os.environ, "VITRAIN_AUTOTUNE": "0"}
    began = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (out_dir / name / "metrics.jsonl").read_text().splitlines()]
    blocked = [r["checkpoint_blocked_s"] for r in records if "checkpoint_blocked_s" in r]
    size = sum(p.stat().st_size for p in (out_dir / name / "checkpoints").rglob("*") if p.is_file())
    return {"blocked_s": blocked, "wall_s": time.perf_counter() - began, "checkpoint_bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=8)
    args = parser.parse_args()
    runs: dict[str, dict[str, list]] = {p: {"sync": [], "async": []} for p in MODELS}
    with tempfile.TemporaryDirectory(prefix="vitrain-stall-") as tmp:
        for r in range(args.rounds):
            for preset in MODELS:
                for mode in ("sync", "async") if r % 2 == 0 else ("async", "sync"):  # interleaved, order alternating
                    result = one_run(Path(tmp) / f"round{r}", preset, mode, args.steps, args.every)
                    runs[preset][mode].append(result)
                    shown = ", ".join(f"{b:.2f}" for b in result["blocked_s"])
                    print(f"round {r} {MODELS[preset]} {mode}: blocked {shown} s", flush=True)
    report: dict = {
        "command": "python benchmarks/checkpoint_stall.py " + " ".join(sys.argv[1:]),
        "cpu": cpu_description(),
        "setup": "2 ranks (torchrun, gloo, DDP), 1 thread each, fp32 AdamW, 64 px synthetic images, batch 2 per rank, "
        f"{args.steps} steps, a checkpoint every {args.every} steps; {args.rounds} interleaved rounds",
        "models": {},
    }
    for preset, modes in runs.items():
        entry: dict = {"name": MODELS[preset]}
        for mode, results in modes.items():
            blocked = [b for result in results for b in result["blocked_s"]]
            entry[mode] = {
                "median_blocked_s": statistics.median(blocked),
                "min_blocked_s": min(blocked),
                "max_blocked_s": max(blocked),
                "saves": len(blocked),
                "blocked_s": blocked,
                "checkpoint_bytes": results[0]["checkpoint_bytes"],
            }
        entry["async_over_sync"] = entry["async"]["median_blocked_s"] / entry["sync"]["median_blocked_s"]
        report["models"][preset] = entry
        sync, asynchronous = entry["sync"]["median_blocked_s"], entry["async"]["median_blocked_s"]
        print(
            f"{MODELS[preset]}: sync {sync:.2f} s, async {asynchronous:.2f} s per save "
            f"(ratio {entry['async_over_sync']:.2f})"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
