"""Scaling efficiency: one model and global batch as 1 process on every core, then as N processes (DDP, zero2, zero3).

    vitrain bench --scaling                                    # ViT-Ti/16 at 224 px, global batch 32, this machine
    vitrain bench --scaling model.preset=vit_small_patch16 --out results/scaling-vit_small-cpu

On a CPU with C cores the reference is 1 process x C threads (parallel.strategy=single) and each other row is
C processes x 1 thread (`--nproc`), each process a 1/C share of the global batch; on CUDA it is 1 GPU against N
GPUs. Every row is `vitrain bench` in its own processes (vitrain/bench/ladder.py's runner), every row in the same
precision (bf16 O2 where this CPU's bf16 GEMM measures faster than fp32, else fp32), rows taking turns for
`--repeats` rounds. A row's efficiency is its images/s over the reference's in the same round (median and spread);
its MFU is over its own processes' peaks (the GEMM peak measured with the threads each process has, times the
processes), so the two say whether a loss is the per-process GEMM size or what lies around it (collectives, gloo
latency, the optimizer step).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from vitrain.bench import write_results
from vitrain.bench.ladder import Row, peak_gib, run_row, settle, tune_first
from vitrain.bench.spread import format_spread, paired_ratio, spread
from vitrain.bench.step import IMAGENET_SHAPED
from vitrain.device import cpu_description, cpu_gemm_peaks
from vitrain.errors import ConfigError

DEFAULT_BASE = ["name=scaling", "model.preset=vit_tiny_patch16", *IMAGENET_SHAPED, "model.pool=gap"]
STRATEGIES = ("ddp", "zero2", "zero3")


def layouts(device: str, nproc: int, cores: int) -> list[tuple[str, str, int, int]]:
    """(row name, strategy, processes, threads per process): the one-process reference first."""
    one = f"1 process x {cores} threads" if device == "cpu" else "1 GPU"
    many = f"{nproc} processes x {max(1, cores // nproc)} thread(s)" if device == "cpu" else f"{nproc} GPUs"
    threads_each = max(1, cores // nproc) if device == "cpu" else 0
    return [(f"{one}, single", "single", 1, cores if device == "cpu" else 0)] + [
        (f"{many}, {strategy}", strategy, nproc, threads_each) for strategy in STRATEGIES
    ]


def main(name: str | None, overrides: list[str], args: argparse.Namespace) -> int:
    from vitrain.config import load_config, resolve_config_path, to_yaml

    cfg = load_config(resolve_config_path(name) if name else None, (DEFAULT_BASE if name is None else []) + overrides)
    device = "cuda" if torch.cuda.is_available() and cfg.train.device in ("auto", "cuda") else "cpu"
    cores = os.cpu_count() or 1
    nproc = args.nproc or (cores if device == "cpu" else torch.cuda.device_count())
    if nproc < 2:
        raise ConfigError(f"--scaling compares 1 process with several: --nproc={nproc} must be 2 or more")
    global_batch = cfg.train.batch_size if any(o.startswith("train.batch_size=") for o in overrides) else 32
    if global_batch % nproc:
        raise ConfigError(f"train.batch_size={global_batch} (the global batch) must divide by --nproc={nproc}")
    steps = args.steps or 3
    # As the ladder's: on a CPU the step after the one that compiles amp_o2's norms still runs slow under two ranks.
    warmup = (2 if device == "cpu" else 5) if args.warmup is None else args.warmup
    repeats = args.repeats or 3

    peaks: dict[int, dict[str, float]] = {}  # threads per process -> dtype -> FLOP/s of one process
    if device == "cpu":
        for threads in sorted({t for *_, t in layouts(device, nproc, cores)}):
            torch.set_num_threads(threads)
            peaks[threads] = cpu_gemm_peaks(torch.device("cpu"))[0]  # bf16 emulated: fp32 rows (below)
        fast_bf16 = peaks[cores]["bf16"] > 1.2 * peaks[cores]["fp32"]
    else:
        fast_bf16 = True
    precision = ["precision.mode=amp_o2", "precision.dtype=bf16"] if fast_bf16 else ["precision.mode=fp32"]
    samples = global_batch * (steps + warmup + 1) * 2  # every step of every row without a second epoch

    out = Path(args.out or Path(cfg.log.out_dir) / "bench-scaling")
    out.mkdir(parents=True, exist_ok=True)
    config = out / "scaling-config.yaml"
    config.write_text(to_yaml(cfg))
    plan = []
    for row_name, strategy, processes, threads in layouts(device, nproc, cores):
        row_overrides = [
            f"parallel.strategy={strategy}",
            f"train.batch_size={global_batch // processes}",
            f"data.synthetic_samples={samples}",
            "log.progress=false",
            *precision,
        ]
        peaks_arg = ""
        if device == "cpu":
            row_overrides.append(f"train.threads={threads}")
            peaks_arg = ",".join(f"{k}={v / 1e12:.6f}" for k, v in peaks[threads].items())
        plan.append((Row(row_name, "scaling", lambda ctx: []), row_overrides, processes, threads, peaks_arg))

    started = time.perf_counter()
    print(
        f"scaling: {len(plan)} rows, global batch {global_batch}, {' '.join(precision)}, {warmup} warm-up + "
        f"{steps} timed steps, {repeats} round(s) -> {out}",
        file=sys.stderr,
    )
    for row, row_overrides, processes, threads, peaks_arg in plan:
        tune_first(row, config, row_overrides, processes, peaks_arg, max(threads, 1), device)
    for round_ in range(repeats):
        for row, row_overrides, processes, threads, peaks_arg in plan:
            run_row(row, config, row_overrides, processes, steps, warmup, peaks_arg, max(threads, 1))
            got = f"{row.rounds[-1]['images_per_s']:.2f} img/s" if row.rounds else f"failed: {row.failures[-1]}"
            print(f"  [{round_ + 1}/{repeats}] {row.name}: {got} ({row.wall_s:.0f} s)", file=sys.stderr)
    for row, *_ in plan:
        settle(row, repeats)
    summary = _summary(
        [row for row, *_ in plan], device, cores, nproc, global_batch, precision, steps, warmup, repeats, peaks, cfg
    )
    summary["wall_s"] = time.perf_counter() - started
    summary["command"] = shlex.join(["vitrain", *sys.argv[1:]])
    write_results(out, "scaling", summary, to_markdown(summary))
    return 0


def _summary(rows, device, cores, nproc, global_batch, precision, steps, warmup, repeats, peaks, cfg):
    reference = rows[0]
    out_rows = []
    for row in rows:
        entry: dict[str, Any] = {"name": row.name, "status": row.status, "command": row.command}
        if row.result:
            rounds = [r["images_per_s"] for r in row.rounds]
            efficiency = None
            if reference.result and len(reference.rounds) == len(rounds):
                efficiency = paired_ratio(rounds, [r["images_per_s"] for r in reference.rounds])
            r = row.result
            entry.update(
                images_per_s=spread(rounds)["median"],
                images_per_s_spread=spread(rounds),
                efficiency=efficiency["median"] if efficiency else None,
                efficiency_spread=efficiency,
                mfu=r["mfu"],
                step_ms=r["step_s"] * 1e3,
                breakdown_ms={k: v * 1e3 for k, v in r["breakdown_s"].items()},
                peak_memory_gib=peak_gib(row),  # the largest over the rounds
                precision=r["precision"],
                optimizer=r["optimizer"],
                attention=r["attention"],  # the kernel each row ran (auto: autotune's pick under its own layout)
                wrap=r.get("wrap", ""),  # zero2/zero3: the FSDP unit
            )
        out_rows.append(entry)
    first = next((row.result for row in rows if row.result), None) or {}
    return {
        "model": first.get("model", str(cfg.model.preset)),
        "device": first.get("device") or (cpu_description() if device == "cpu" else torch.cuda.get_device_name()),
        "torch": torch.__version__,
        "cores": cores,
        "processes": nproc,
        "global_batch": global_batch,
        "precision": " ".join(precision),
        "steps": steps,
        "warmup": warmup,
        "repeats": repeats,
        "peaks_gflops_per_process": {str(t): {k: v / 1e9 for k, v in p.items()} for t, p in peaks.items()},
        "rows": out_rows,
    }


def to_markdown(summary: dict[str, Any]) -> str:
    peaks = "; ".join(
        f"{threads} thread(s): " + ", ".join(f"{k} {v:.0f}" for k, v in p.items())
        for threads, p in summary["peaks_gflops_per_process"].items()
    )
    lines = [
        f"# Scaling efficiency: {summary['model']}, global batch {summary['global_batch']}",
        "",
        f"- Device: {summary['device']}; torch {summary['torch']}; {summary['precision']}",
        f"- {summary['warmup']} warm-up + {summary['steps']} timed steps per row, each row in its own processes, "
        f"{summary['repeats']} round(s) of every row taking turns. images/s: median (min-max) over the rounds; "
        "efficiency: the row's images/s over the 1-process row's in the same round, median (min-max), `~` where "
        "the spread reaches across 1.0x.",
        "- MFU: the model's FLOP/s over the row's processes' GEMM peaks (GFLOP/s per process, "
        f"{peaks or 'datasheet'}).",
        f"- Command: `{summary.get('command', '')}` ({summary.get('wall_s', 0):.0f} s)",
        "",
        "| layout | images/s | efficiency | MFU | step ms | fwd / bwd / opt ms | peak GiB/process | precision | "
        "attention, FSDP unit |",
        "|---|---:|---:|---:|---:|---|---:|---|---|",
    ]
    for row in summary["rows"]:
        if "images_per_s" not in row:
            lines.append(f"| {row['name']} | {row['status']} | | | | | | | |")
            continue
        b = row["breakdown_ms"]
        spread_ = row["efficiency_spread"] or {"median": row["efficiency"], "n": 1}
        efficiency = format_spread(spread_, unit="x") if row["efficiency"] else "-"
        if spread_.get("overlaps_1x") and row is not summary["rows"][0]:
            efficiency += " ~"
        lines.append(
            f"| {row['name']} | {format_spread(row['images_per_s_spread'])} | {efficiency} | {row['mfu']:.3f} | "
            f"{row['step_ms']:.0f} | {b['forward']:.0f} / {b['backward']:.0f} / {b['optimizer']:.0f} | "
            f"{row['peak_memory_gib']:.2f} | {row['precision']} | "
            f"{', '.join(x for x in (row.get('attention'), row.get('wrap')) if x)} |"
        )
    return "\n".join(lines) + "\n"
