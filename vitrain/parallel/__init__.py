"""Parallelism applied to a single-device model from outside: process groups, strategies, activation checkpointing."""

from vitrain.parallel.activation_checkpoint import apply_activation_checkpointing
from vitrain.parallel.distributed import (
    DistInfo,
    broadcast_object,
    init_distributed,
    mean_over_ranks,
    shutdown,
    sum_over_ranks,
)
from vitrain.parallel.strategies import build_parallel_optimizer, parallelize, unwrap

__all__ = [
    "DistInfo",
    "apply_activation_checkpointing",
    "broadcast_object",
    "build_parallel_optimizer",
    "init_distributed",
    "mean_over_ranks",
    "parallelize",
    "shutdown",
    "sum_over_ranks",
    "unwrap",
]
