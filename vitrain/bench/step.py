"""Training-step benchmark: images/s (clips/s for video), where a step's time goes, peak memory and MFU of a real step.

    result = bench_step(cfg, steps=5, warmup=2)   # the trainer's own model, engine and data, timed phase by phase

The step is the trainer's own `TrainStep` (vitrain/engine/step.py), called as `fit` calls it, with a PhaseTimer
marking data, forward, backward and optimizer: the same model, precision policy, parallel strategy, engine and
loader a `vitrain train` of the config would build. MFU is model FLOPs (`complexity().train_flops`, a
multiply-add counted as 2, backward as twice the forward) per second over the peak of the dtype the step computes
in: on a CPU that peak is a large GEMM measured on the spot with this process's threads (times the processes), on
a known GPU the datasheet's dense figure.

A video model (model.num_frames > 1: its `sample_unit` is "clip") counts clips: `images_per_s` and
`train_gflops_per_image` keep their names (and count clips: one sample is one clip of num_frames frames), `unit` says
"clip", and `clips_per_s` repeats the rate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from vitrain.config import Config
from vitrain.data.loader import endless
from vitrain.device import PhaseTimer, device_name, peak_flops, peak_memory_bytes, reset_peak_memory
from vitrain.models import model_complexity
from vitrain.optim import optimizer_kernel
from vitrain.parallel import unwrap
from vitrain.parallel.distributed import max_over_ranks
from vitrain.precision import SHARDED

PHASES = ("data", "forward", "backward", "optimizer")
# Random ImageNet-shaped images at 224 px: the data of the ladder and the peers when no recipe is given.
IMAGENET_SHAPED = [
    "model.image_size=224",
    "model.in_chans=3",
    "model.num_classes=1000",
    "data.source=synthetic",
    "data.mean=[0.5,0.5,0.5]",
    "data.std=[0.5,0.5,0.5]",
    "data.prefetch=0",
    "train.epochs=1",
]


def dtype_key(precision_label: str) -> str:
    """The dtype the step's matmuls compute in, from an engine's precision label (`fp32`, `amp_o1 bfloat16`)."""
    if "bfloat16" in precision_label or "bf16" in precision_label:
        return "bf16"
    if "float16" in precision_label or "fp16" in precision_label:
        return "fp16"
    return "fp32"


def parse_peaks(text: str | None) -> dict[str, tuple[float, str]]:
    """`fp32=0.17,bf16=0.05` (TFLOP/s per device, as the ladder measured them) -> {dtype: (FLOP/s, source)}."""
    peaks = {}
    for item in (text or "").split(","):
        if item:
            dtype, _, tflops = item.partition("=")
            peaks[dtype] = (float(tflops) * 1e12, f"{dtype} peak measured once by the ladder before its rows")
    return peaks


@contextlib.contextmanager
def _profiler(out: Path | None):
    if out is None:
        yield None
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, record_shapes=True) as prof:
        yield prof
    out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out / "trace.json"))
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    (out / "ops.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=40) + "\n")


def bench_step(
    cfg: Config,
    steps: int = 5,
    warmup: int = 2,
    profile: Path | None = None,
    peaks: dict[str, tuple[float, str]] | None = None,
) -> dict[str, Any]:
    """Time `steps` optimizer steps of the trainer `cfg` builds, after `warmup` untimed ones; one dict of figures.

    Collective under torchrun: every rank steps; rank 0's phase times are reported, images/s counts every rank's
    images, peak memory is the largest rank's. `peaks` ({dtype: (FLOP/s of one device, source)}) skips measuring
    the computing dtype's peak here.
    """
    from vitrain.engine.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="vitrain-bench-") as scratch:
        cfg = dataclasses.replace(cfg, log=dataclasses.replace(cfg.log, out_dir=scratch, progress=False))
        trainer = Trainer(cfg)
        try:
            return _time_steps(trainer, trainer.cfg, steps, warmup, profile, peaks or {})
        finally:
            trainer.close()


def _time_steps(trainer, cfg: Config, steps: int, warmup: int, profile, peaks) -> dict[str, Any]:
    """The trainer's own step (`trainer.train_step`, what `fit` calls) with a PhaseTimer marking its phases."""
    device, dist, engine = trainer.device, trainer.dist, trainer.engine
    accum = cfg.train.accum_steps
    batches = endless(trainer.train_loader)
    pipelined = trainer.pipeline is not None
    seconds = dict.fromkeys(PHASES, 0.0)
    step_seconds: list[float] = []
    if profile is not None and dist.world_size > 1:  # one trace per rank
        profile = profile / f"rank{dist.rank}"
    # The peak of the steps (from what the model, optimizer and loader hold now), not of building them or of
    # autotune's candidates before them.
    from_steps = reset_peak_memory(device)
    try:
        for i in range(warmup + steps):
            timing = i >= warmup
            timer = PhaseTimer(device)
            with _profiler(profile if timing and i == warmup else None):
                start = time.perf_counter()
                trainer.train_step(itertools.islice(batches, accum), cfg.optim.lr, timer, steps_done=i)
                end = time.perf_counter()
            if timing:
                step_seconds.append(end - start)
                for key in PHASES:
                    seconds[key] += timer.seconds.get(key, 0.0)
    finally:
        batches.close()  # the loader's prefetch thread stops here, also when a step fails

    images_per_step = cfg.train.batch_size * accum * dist.data_size  # clips for a video model
    timed_s = sum(step_seconds)
    images_per_s = steps * images_per_step / timed_s
    peak_bytes, memory_kind = peak_memory_bytes(device)
    memory_kind += " of the steps" if from_steps else " since the process started"
    peak_bytes = int(max_over_ranks(peak_bytes, device))
    drop = trainer.train_step.token_drop  # train.token_drop: the blocks compute on the kept tokens only
    kept = drop.kept_patches((cfg.model.image_size // cfg.model.patch_size) ** 2) if drop is not None else None
    cost = model_complexity(unwrap(trainer.model), kept)
    precision = engine.precision_label
    dtype = dtype_key(precision)
    device_peak, peak_source = peaks[dtype] if dtype in peaks else peak_flops(device, dtype)
    devices = dist.world_size
    train_flops = cost.train_flops if cost is not None else 0  # 0: a model that does not count its FLOPs
    model_flops_per_s = train_flops * images_per_s
    result = {
        "config": cfg.name,
        "model": _model_label(cfg),
        "params": trainer.parameters,
        "image_size": cfg.model.image_size,
        "batch_per_rank": cfg.train.batch_size,
        "accum_steps": accum,
        "global_batch": images_per_step,
        "world_size": devices,
        "strategy": cfg.parallel.strategy,
        # FSDP2's unit (auto resolved); DeepSpeed keeps its own buckets
        "wrap": cfg.parallel.wrap if cfg.parallel.strategy in SHARDED and engine.name == "native" else "",
        "pipeline_stages": cfg.parallel.pipeline_stages,
        "engine": engine.name,
        "precision": precision,
        "attention": cfg.model.attention,
        "pool": cfg.model.pool,
        "layout": cfg.model.layout,
        "token_drop": cfg.train.token_drop,
        "distill": cfg.train.distill.type if cfg.train.distill.teacher else "",
        "compile": cfg.train.compile,
        "optimizer": f"{cfg.optim.name}[{optimizer_kernel(cfg, device)}]",
        "device": device_name(device),
        "threads": torch.get_num_threads(),
        "data": cfg.data.source,
        "steps": steps,
        "warmup": warmup,
        "images_per_s": images_per_s,
        "unit": cfg.model.sample_unit,
        "num_frames": cfg.model.num_frames,
        "step_s": timed_s / steps,
        "step_s_min": min(step_seconds),
        "step_s_max": max(step_seconds),
        "breakdown_s": {key: value / steps for key, value in seconds.items()},
        "breakdown_note": (
            "forward and backward together (the pipeline schedule interleaves them)"
            if pipelined
            else "backward includes the gradient communication that overlaps it"
            if devices > 1
            else ""
        ),
        "peak_memory_bytes": peak_bytes,
        "peak_memory_kind": memory_kind,
        "train_gflops_per_image": train_flops / 1e9,
        "model_tflops_per_s": model_flops_per_s / 1e12,
        "compute_dtype": dtype,
        "peak_tflops_per_device": device_peak / 1e12,
        "peak_source": peak_source,
        "mfu": model_flops_per_s / (device_peak * devices),
        "torch": torch.__version__,
    }
    if cfg.model.sample_unit == "clip":  # the trainer's summary's rule (engine/report.py), so the two agree
        result["clips_per_s"] = images_per_s
    if profile is not None:
        result["profile"] = str(profile)
    return result


def _model_label(cfg: Config) -> str:
    m = cfg.model
    if m.name == "mvit":  # MViTv2: its stages, from the first stage's width and heads
        name = m.preset or f"MViTv2 w{m.width} h{m.heads} stages {list(m.stages)}"
    else:
        name = m.preset or f"ViT w{m.width} d{m.depth} h{m.heads}"
    if cfg.task.name == "detection":  # the ViTDet backbone: its window and global blocks decide its speed
        attention = f"window {m.window_size}, global {list(m.global_blocks)}" if m.window_size else "every block global"
        return f"ViTDet ({name}, {attention})/{m.patch_size} @ {m.image_size}px"
    if m.num_frames > 1:
        return f"{name}/{m.patch_size}x{m.tubelet_size} @ {m.num_frames} frames x {m.image_size}px"
    return f"{name}/{m.patch_size} @ {m.image_size}px"


def format_result(result: dict[str, Any]) -> str:
    """A few human lines for one benchmark result."""
    gib = result["peak_memory_bytes"] / 2**30
    parts = "  ".join(f"{key} {value * 1e3:.1f} ms" for key, value in result["breakdown_s"].items())
    note = f" ({result['breakdown_note']})" if result["breakdown_note"] else ""
    unit = result.get("unit", "image")  # JSON written before video benches has no unit
    return "\n".join(
        [
            f"{result['model']}, {result['params'] / 1e6:.2f}M params, {result['precision']}, "
            f"{result['strategy']}{' wrap=' + result['wrap'] if result.get('wrap') else ''} x {result['world_size']} "
            f"({result['engine']}), attention={result['attention']}, "
            f"optimizer={result['optimizer']}, batch {result['global_batch']} ({result['batch_per_rank']}/rank)",
            f"{result['device']}; {result['threads']} thread(s) per process",
            f"{unit}s/s {result['images_per_s']:.2f}   step {result['step_s'] * 1e3:.1f} ms "
            f"(min {result['step_s_min'] * 1e3:.1f}, max {result['step_s_max'] * 1e3:.1f}; "
            f"{result['steps']} timed after {result['warmup']} warm-up)",
            f"step breakdown: {parts}{note}",
            f"peak memory {gib:.3f} GiB ({result['peak_memory_kind']}, largest rank)",
            f"model {result['model_tflops_per_s'] * 1e3:.1f} GFLOP/s ({result['train_gflops_per_image']:.2f} "
            f"GFLOP/{unit}) = MFU {result['mfu']:.3f} of {result['peak_tflops_per_device'] * 1e3:.1f} GFLOP/s "
            f"x {result['world_size']} ({result['peak_source']})",
        ]
    )


def write_json(result: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
