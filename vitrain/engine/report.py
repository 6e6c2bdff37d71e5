"""What a run tells its reader: the log's header lines and summary.json's fields, read from a built trainer."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from vitrain import checkpoint as ckpt
from vitrain.engine.autotune import KEPT
from vitrain.models import model_complexity
from vitrain.optim import optimizer_kernel
from vitrain.parallel import unwrap
from vitrain.tasks.distill import describe_distillation

if TYPE_CHECKING:
    from vitrain.engine.trainer import Trainer


def header_lines(trainer: Trainer) -> list[str]:
    """The model, device, optimizer, parallelism, batch and data of the run; then the engine's own lines."""
    cfg, dist = trainer.cfg, trainer.dist
    cost = model_complexity(unwrap(trainer.model))
    p = cfg.parallel
    global_batch = cfg.train.batch_size * dist.data_size * cfg.train.accum_steps
    impl = optimizer_kernel(cfg, trainer.device)
    unit = cfg.model.sample_unit  # a video model's sample is a clip
    gflops = f"{cost.flops / 1e9:.3f} GFLOPs/{unit}" if cost is not None else "no FLOP count for this model"
    lines = [
        f"vitrain: {trainer.parameters / 1e6:.2f}M params, {gflops}, "
        f"device={trainer.device}, optimizer={cfg.optim.name}[{impl}], "
        f"parallel={p.strategy} x {dist.world_size} (wrap={p.wrap}, offload={p.offload}, "
        f"activation checkpointing={p.activation_checkpointing}), "
        f"global batch={global_batch} ({cfg.train.batch_size} x {dist.data_size} replicas x "
        f"{cfg.train.accum_steps} accumulation), {trainer.steps_per_epoch} steps/epoch x {cfg.train.epochs} epochs, "
        f"{len(trainer.train_loader.data)} train {unit}s / {trainer.task.describe_data()}, run dir {trainer.run_dir}"
    ]
    if p.strategy != "single" and dist.world_size == 1 and "WORLD_SIZE" not in os.environ:
        lines.append(
            f"parallel.strategy={p.strategy} without a distributed launch runs as one process; launch with "
            "torchrun --nproc_per_node N to use N processes"
        )
    skipped = getattr(trainer.train_loader.data, "skipped", None)  # a folder source's undecodable and other files
    if skipped is not None:
        lines += skipped.lines()
    if trainer.head is not None:
        lines.append(f"head: {trainer.head.extra_repr()}")
    if trainer.pipeline is not None:
        lines.append(trainer.pipeline.describe())
    m, drop = cfg.model, trainer.train_step.token_drop
    if drop is not None:
        lines.append(drop.describe((m.image_size // m.patch_size) ** 2))
    if cfg.train.distill.teacher:
        lines.append(describe_distillation(cfg))
    tuned = trainer.tuned
    if tuned is not None:
        if tuned.from_cache:
            whose = "the run's own (kept on resume)" if tuned.reason.startswith(KEPT) else "its cache"
            lines.append(f"autotune: decision read from {whose}, {tuned.cached_at}")
        # The race's figures and the values it chose; where it chose the precision, the precision line gives them.
        if "precision.mode" not in tuned.values:
            lines.append(tuned.reason)
    return lines + trainer.engine.describe()


def summary(trainer: Trainer, wall_s: float, images_per_s: float, compile_s: float | None) -> dict[str, Any]:
    """summary.json: the last evaluation, the best metric, speed, size, where the checkpoints are."""
    cfg, task, engine = trainer.cfg, trainer.task, trainer.engine
    metric = task.best_metric
    fields = {
        "name": cfg.name,
        "task": task.name,
        **task.summary_defaults,
        **trainer.last_eval,
        f"best_{metric}": trainer.best_metric if trainer.best_metric is not None else -1.0,
        "images_per_s": images_per_s,  # clips/s for a video model, repeated as clips_per_s (as vitrain bench)
        **({"clips_per_s": images_per_s} if cfg.model.sample_unit == "clip" else {}),
        "wall_s": wall_s,
        "epochs": trainer.epoch,
        "steps": trainer.step,
        "params": trainer.parameters,
        "checkpoint": str(ckpt.latest(trainer.run_dir, warn=False)),
        "best_checkpoint": str(ckpt.best(trainer.run_dir) or ckpt.latest(trainer.run_dir, warn=False)),
        "device": str(trainer.device),
        "strategy": cfg.parallel.strategy,
        "world_size": trainer.dist.world_size,
        "global_batch": cfg.train.batch_size * trainer.dist.data_size * cfg.train.accum_steps,
        "engine": engine.name,
        "precision": engine.precision_label,
        **engine.scaler_fields(),
    }
    skipped = getattr(trainer.train_loader.data, "skipped", None)
    if skipped is not None:
        fields |= {"skipped_files": len(skipped.undecodable), "non_image_files": len(skipped.non_images)}
    bad = _bad_samples(trainer)
    if bad is not None:
        fields["skipped_samples"] = len(bad)
    if compile_s is not None:
        fields["compile_s"] = compile_s
    return fields


def _bad_samples(trainer: Trainer) -> dict[str, str] | None:
    """Samples a stream or RecordIO set replaced as it read them (data.skip_bad): where -> why; None elsewhere."""
    loader = trainer.train_loader
    found = getattr(loader, "skipped", None)
    return found if isinstance(found, dict) else getattr(getattr(loader, "data", None), "bad", None)


def skipped_samples(trainer: Trainer) -> list[str]:
    """One log line per sample data.skip_bad let the run skip (this rank's), then their count."""
    bad = _bad_samples(trainer) or {}
    lines = [f"data: skipped sample {where}: {why} (its place in the batch went to another sample)" for where, why
             in list(bad.items())[:20]]  # fmt: skip
    return lines + ([f"data: {len(bad)} bad sample(s) skipped on this rank (data.skip_bad)"] if bad else [])
