"""Optimizers and learning-rate schedules."""

import torch

from vitrain.config import Config
from vitrain.errors import ConfigError
from vitrain.optim.optimizers import (
    GROUPED_BY,
    build_head_optimizer,
    build_optimizer,
    fused_refused_by,
    param_groups,
    resolve_impl,
)
from vitrain.optim.schedules import Schedule, scaled_lr, set_lr

__all__ = [
    "GROUPED_BY",
    "Schedule",
    "build_head_optimizer",
    "check",
    "optimizer_kernel",
    "build_optimizer",
    "param_groups",
    "resolve_impl",
    "scaled_lr",
    "set_lr",
]


def optimizer_kernel(cfg: Config, device: torch.device) -> str:
    """The kernel a run's optimizer steps with, for logs and benchmarks: `optim.impl` resolved on `device`, or
    `deepspeed` (DeepSpeed owns the step)."""
    if cfg.train.engine == "deepspeed":
        return "deepspeed"
    return resolve_impl(cfg.optim.impl, device, cfg.optim.name, cfg.parallel.strategy)


def check(cfg: Config) -> None:
    """The optim and schedule sections: one line naming the value and the fix."""
    if cfg.optim.lr <= 0:
        raise ConfigError(f"optim.lr={cfg.optim.lr} must be positive")
    if cfg.optim.clip_grad_norm < 0:
        raise ConfigError(f"optim.clip_grad_norm={cfg.optim.clip_grad_norm} must be >= 0 (0 turns it off)")
    if cfg.schedule.warmup_epochs < 0:
        raise ConfigError(f"schedule.warmup_epochs={cfg.schedule.warmup_epochs} must be >= 0")
    o, s = cfg.optim, cfg.schedule
    if o.weight_decay < 0 or (o.head_weight_decay is not None and o.head_weight_decay < 0):
        raise ConfigError("optim.weight_decay and optim.head_weight_decay must be >= 0")
    if o.head_lr_scale <= 0:
        raise ConfigError(f"optim.head_lr_scale={o.head_lr_scale} must be positive")
    if not 0.0 < o.layer_decay <= 1.0:
        raise ConfigError(f"optim.layer_decay={o.layer_decay} must be in (0, 1]; 1 turns layer-wise decay off")
    for name in ("eps", "trust_coefficient"):  # torch's optimizers refuse a negative one with a traceback
        if getattr(o, name) < 0:
            raise ConfigError(f"optim.{name}={getattr(o, name)} must be >= 0")
    for name in ("gamma", "cycle_decay"):  # factors on the lr: a negative one makes it negative
        if getattr(s, name) < 0:
            raise ConfigError(f"schedule.{name}={getattr(s, name)} must be >= 0 (it multiplies the lr)")
    if not 0.0 <= o.momentum < 1.0:
        raise ConfigError(f"optim.momentum={o.momentum} must be in [0, 1)")
    if not all(0.0 <= beta < 1.0 for beta in o.betas):  # torch's refusal is a traceback, muon's comes mid-run
        raise ConfigError(f"optim.betas=[{o.betas[0]}, {o.betas[1]}]: each beta must be in [0, 1), e.g. [0.9, 0.999]")
    if o.impl == "fused" and cfg.train.engine == "native" and fused_refused_by(o.name, cfg.parallel.strategy):
        raise ConfigError(
            f"optim.impl=fused with optim.name={o.name} under parallel.strategy={cfg.parallel.strategy}: torch's fused "
            f"{o.name} has no rule for FSDP2's sharded parameters; use optim.impl=foreach or auto"
        )
    if o.name in ("lamb", "lars") and o.impl in ("fused", "flat"):
        raise ConfigError(
            f"optim.impl={o.impl} is not available for optim.name={o.name} (it needs per-tensor norms); "
            "use optim.impl=foreach, loop or auto"
        )
    if o.name == "muon" and o.impl not in ("auto", "foreach"):
        raise ConfigError(f"optim.impl={o.impl} is not available for optim.name=muon (it has one kernel); use auto")
    if o.name == "muon" and not 0.0 <= o.muon_momentum < 1.0:
        raise ConfigError(f"optim.muon_momentum={o.muon_momentum} must be in [0, 1)")
    if o.name == "muon" and (
        cfg.parallel.strategy not in ("single", "ddp")
        or cfg.parallel.pipeline_stages > 1
        or cfg.train.engine != "native"
    ):
        raise ConfigError(
            "optim.name=muon orthogonalizes whole weight matrices, which zero1/zero2/zero3, pipeline stages and "
            "DeepSpeed split or own; use it with parallel.strategy=single or ddp and train.engine=native, "
            "or optim.name=adamw"
        )
    if s.name == "step" and not s.milestones:
        raise ConfigError("schedule.name=step needs schedule.milestones=[EPOCH,...], e.g. [30,60]")
    if any(m <= 0 for m in s.milestones):
        raise ConfigError(
            f"schedule.milestones={list(s.milestones)} must be epochs > 0 (one at 0 or below cuts the rate before "
            "training starts), e.g. [30,60]"
        )
    if list(s.milestones) != sorted(s.milestones):
        raise ConfigError(f"schedule.milestones={list(s.milestones)} must be in increasing order")
    if not 0.0 < s.onecycle_pct < 1.0:
        raise ConfigError(f"schedule.onecycle_pct={s.onecycle_pct} must be in (0, 1)")
    if s.cycle_epochs <= 0 or s.base_batch_size <= 0 or s.div_factor <= 0 or s.final_div_factor <= 0:
        raise ConfigError("schedule.cycle_epochs, base_batch_size, div_factor and final_div_factor must be positive")
    if s.min_lr < 0 or s.min_lr > o.lr:
        raise ConfigError(f"schedule.min_lr={s.min_lr} must be between 0 and optim.lr={o.lr}")
