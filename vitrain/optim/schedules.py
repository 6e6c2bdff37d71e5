"""Learning-rate schedules as pure functions of the optimizer step, so a resume needs only the step."""

from __future__ import annotations

import math

from vitrain.config import ScheduleConfig


def lr_at(step: int, total_steps: int, warmup_steps: int, base_lr: float, cfg: ScheduleConfig) -> float:
    if cfg.name == "constant":
        return base_lr
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return cfg.min_lr + 0.5 * (base_lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
