"""Learning-rate schedules as pure functions of the optimizer step, so a resume needs only the step."""

from __future__ import annotations

import math
from dataclasses import dataclass

from vitrain.config import ScheduleConfig


def scaled_lr(base_lr: float, cfg: ScheduleConfig, global_batch: int) -> float:
    """`schedule.scale_lr=linear`: lr x global_batch / base_batch_size (Goyal et al., 2017); otherwise `base_lr`."""
    if cfg.scale_lr == "linear":
        return base_lr * global_batch / cfg.base_batch_size
    return base_lr


@dataclass(frozen=True)
class Schedule:
    """lr(step) for one run: `peak_lr` is the (possibly batch-scaled) optim.lr."""

    cfg: ScheduleConfig
    peak_lr: float
    total_steps: int
    steps_per_epoch: int

    @property
    def warmup_steps(self) -> int:
        return int(self.cfg.warmup_epochs * self.steps_per_epoch)

    def __call__(self, step: int) -> float:
        cfg, peak = self.cfg, self.peak_lr
        if cfg.name == "constant":
            return peak
        if cfg.name == "onecycle":
            return self._onecycle(step)
        warmup = self.warmup_steps
        if step < warmup:
            return peak * (step + 1) / warmup
        if cfg.name == "warmup_cosine":
            progress = min(1.0, (step - warmup) / max(1, self.total_steps - warmup))
            return _cosine(peak, cfg.min_lr, progress)
        if cfg.name == "step":
            passed = sum(step >= m * self.steps_per_epoch for m in cfg.milestones)
            return peak * cfg.gamma**passed
        # cyclic: triangles peak -> min_lr -> peak (continuing from warmup), the peak shrinking by cycle_decay
        cycle_steps = max(2, int(cfg.cycle_epochs * self.steps_per_epoch))
        cycle, position = divmod(step - warmup, cycle_steps)
        top = cfg.min_lr + (peak - cfg.min_lr) * cfg.cycle_decay**cycle
        depth = 1.0 - abs(2.0 * position / cycle_steps - 1.0)  # 0 at the cycle's ends, 1 mid-cycle
        return top - (top - cfg.min_lr) * depth

    def _onecycle(self, step: float) -> float:
        """Smith's 1cycle as torch's OneCycleLR (cos, two phases): lr/div up to lr, then down to lr/div/final.

        Step for step torch's: `step` (0-based, as each optimizer step reads its lr before it runs) is its
        `last_epoch`. The ramp ends at step pct x T - 1 (a float, as torch's), the decay at step T - 1, where the
        last step runs at the final lr. Before, the ramp ran to int(pct x T) and the decay to T: the last of 66 steps
        ran at 2.24e-6, not 8e-9, and the ramp 0.5-2% low."""
        cfg = self.cfg
        start = self.peak_lr / cfg.div_factor
        end = start / cfg.final_div_factor
        up_end, last = cfg.onecycle_pct * self.total_steps - 1, self.total_steps - 1
        if step <= up_end:  # torch divides 0 by 0 at a one-step ramp (pct x T = 1): its first step is lr/div
            return _cosine(start, self.peak_lr, step / up_end if up_end > 0 else 0.0)
        # A ramp under one step long (pct x T < 1) ends before step 0: the decay starts there, as torch's does.
        return _cosine(self.peak_lr, end, min(1.0, (step - up_end) / (last - up_end)))


def _cosine(first: float, last: float, progress: float) -> float:
    """`first` at progress 0, `last` at progress 1, half a cosine in between (torch's _annealing_cos)."""
    return last + 0.5 * (first - last) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
