"""Optimizers, learning-rate schedules and the lr range test."""

from vitrain.optim.optimizers import build_head_optimizer, build_optimizer, param_groups, resolve_impl
from vitrain.optim.schedules import Schedule, scaled_lr, set_lr

__all__ = ["Schedule", "build_head_optimizer", "build_optimizer", "param_groups", "resolve_impl", "scaled_lr", "set_lr"]
