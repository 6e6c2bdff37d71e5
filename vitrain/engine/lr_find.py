"""Learning-rate range test (Smith 2017): raise the lr geometrically each step, record the loss, suggest an lr."""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from pathlib import Path

from vitrain.config import Config
from vitrain.data.loader import endless
from vitrain.engine.trainer import Trainer
from vitrain.errors import ConfigError
from vitrain.files import check_output_folder
from vitrain.parallel.distributed import rank
from vitrain.precision import TrainingDiverged

OUTPUT_FILES = ("lr_find.csv", "lr_find.png")
SMOOTHING = 0.9  # exponential moving average of the loss, bias-corrected
DIVERGENCE_FACTOR = 4.0  # stop once the smoothed loss exceeds 4x its minimum


@dataclass
class LRFindResult:
    lrs: list[float]
    losses: list[float]
    smoothed: list[float]
    suggested_lr: float
    csv_path: Path
    plot_path: Path | None  # None when matplotlib is missing


def suggest_lr(lrs: list[float], smoothed: list[float]) -> float:
    """The lr where the smoothed loss falls fastest (steepest negative slope over log lr) before its minimum."""
    if len(lrs) < 3:
        raise ValueError("the range test needs at least 3 points to suggest an lr")
    end = min(range(len(smoothed)), key=smoothed.__getitem__)
    end = max(end, 2)
    slopes = [
        (smoothed[i + 1] - smoothed[i - 1]) / (math.log(lrs[i + 1]) - math.log(lrs[i - 1])) for i in range(1, end)
    ]
    steepest = min(range(len(slopes)), key=slopes.__getitem__)
    return lrs[steepest + 1]


def lr_range_test(
    cfg: Config, start_lr: float, end_lr: float, num_steps: int, out_dir: Path, overwrite: bool = False
) -> LRFindResult:
    """Train a fresh model from `cfg` for up to `num_steps` steps with lr from start_lr to end_lr (geometric).

    Collective under torchrun: every rank steps (the trainer's own step, so every engine and strategy works) and
    reads the loss averaged over ranks, so all stop together; rank 0 writes the CSV and the plot. An `out_dir` that
    is a file, or that holds an earlier test's files (without `overwrite`), is refused before anything trains.
    """
    if not 0 < start_lr < end_lr or num_steps < 3 or not math.isfinite(end_lr):
        raise ValueError("lr range test needs 0 < start_lr < end_lr < inf and at least 3 steps")
    check_output_folder(out_dir, overwrite, OUTPUT_FILES, "lr-find --out")
    # The Trainer builds data, model, engine and optimizer exactly as training would; its run folder is not written.
    trainer = Trainer(dataclasses.replace(cfg, log=dataclasses.replace(cfg.log, out_dir=str(out_dir))))
    try:
        lrs, losses, smoothed = _sweep(trainer, start_lr, end_lr, num_steps)
    finally:
        trainer.close()
    if len(lrs) < 3:
        raise ConfigError(
            f"lr-find stopped after {len(lrs)} usable step(s) of {num_steps} (the loss diverged or was not finite), "
            f"too few to suggest an lr from; lower --start={start_lr:g} and --end={end_lr:g}"
        )
    suggested = suggest_lr(lrs, smoothed)
    csv_path, plot_path = out_dir / "lr_find.csv", None
    if rank() == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        rows = [f"{lr:.6e},{loss:.6f},{smooth:.6f}" for lr, loss, smooth in zip(lrs, losses, smoothed, strict=True)]
        csv_path.write_text("lr,loss,smoothed_loss\n" + "\n".join(rows) + "\n")
        plot_path = _plot(lrs, losses, smoothed, suggested, out_dir / "lr_find.png")
    return LRFindResult(lrs, losses, smoothed, suggested, csv_path, plot_path)


def _sweep(trainer: Trainer, start_lr: float, end_lr: float, num_steps: int) -> tuple[list, list, list]:
    ratio = (end_lr / start_lr) ** (1.0 / (num_steps - 1))
    accum = trainer.cfg.train.accum_steps
    lrs, losses, smoothed = [], [], []
    average, best = 0.0, math.inf
    batches = endless(trainer.train_loader)
    try:
        for step in range(num_steps):
            lr = start_lr * ratio**step
            try:
                result = trainer.train_step(itertools.islice(batches, accum), lr, steps_done=step)
            except TrainingDiverged:
                break
            value = float(trainer.mean_loss(result.loss))  # the same on every rank: all stop at the same step
            if not math.isfinite(value) or result.skipped:
                break
            average = SMOOTHING * average + (1 - SMOOTHING) * value
            debiased = average / (1 - SMOOTHING ** (step + 1))
            lrs.append(lr)
            losses.append(value)
            smoothed.append(debiased)
            best = min(best, debiased)
            if debiased > DIVERGENCE_FACTOR * best:
                break
    finally:
        batches.close()
    return lrs, losses, smoothed


def _plot(lrs: list[float], losses: list[float], smoothed: list[float], suggested: float, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(lrs, losses, alpha=0.3, label="loss")
    ax.plot(lrs, smoothed, label="smoothed loss")
    ax.axvline(suggested, color="red", linestyle="--", label=f"suggested lr {suggested:.2e}")
    ax.set_xscale("log")
    # The divergence at the end would flatten everything else: show up to 1.5x the starting loss.
    ax.set_ylim(min(smoothed) * 0.95, max(smoothed[0] * 1.5, min(smoothed) * 1.1))
    ax.set_xlabel("learning rate")
    ax.set_ylabel("training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
