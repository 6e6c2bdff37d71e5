"""Optimizers and learning-rate schedules."""

from vitrain.optim.optimizers import build_optimizer, param_groups, resolve_impl
from vitrain.optim.schedules import lr_at, set_lr

__all__ = ["build_optimizer", "lr_at", "param_groups", "resolve_impl", "set_lr"]
