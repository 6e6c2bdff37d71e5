"""Parallelism applied to a single-device model from outside: process groups, strategies, activation checkpointing."""

from vitrain.config import Config
from vitrain.errors import ConfigError
from vitrain.models.plan import check_stages
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
    "check",
    "init_distributed",
    "mean_over_ranks",
    "parallelize",
    "shutdown",
    "sum_over_ranks",
    "unwrap",
]


def check(cfg: Config) -> None:
    """The parallel section (and what pipeline stages ask of the others): one line naming the value and the fix."""
    p = cfg.parallel
    # (train.engine=deepspeed: its own check names ZeRO-3 alone)
    if p.offload == "params" and p.strategy not in ("zero2", "zero3") and cfg.train.engine != "deepspeed":
        raise ConfigError(f"parallel.offload=params needs parallel.strategy=zero2 or zero3 (FSDP2), got {p.strategy}")
    if p.checkpoint_every_k <= 0:
        raise ConfigError(f"parallel.checkpoint_every_k={p.checkpoint_every_k} must be positive")
    if p.sharded_init and p.strategy not in ("zero2", "zero3"):
        raise ConfigError(
            f"parallel.sharded_init=true draws FSDP2 shards, but parallel.strategy={p.strategy} keeps whole "
            "weights; use parallel.strategy=zero2 or zero3, or parallel.sharded_init=false"
        )
    if p.sharded_init and (cfg.model.init_from or p.pipeline_stages > 1):
        what = f"model.init_from={cfg.model.init_from}" if cfg.model.init_from else "parallel.pipeline_stages>1"
        raise ConfigError(f"parallel.sharded_init=true with {what} is not supported; set parallel.sharded_init=false")
    if p.pipeline_stages < 1:
        raise ConfigError(f"parallel.pipeline_stages={p.pipeline_stages} must be >= 1 (1: no pipelining)")
    if p.microbatches < 0:
        raise ConfigError(f"parallel.microbatches={p.microbatches} must be >= 0 (0: twice parallel.pipeline_stages)")
    if p.pipeline_stages == 1:
        return
    stages, depth = p.pipeline_stages, cfg.model.depth
    where = f"with parallel.pipeline_stages={stages}"
    check_stages(stages, depth)
    if p.strategy in ("single", "zero1"):
        raise ConfigError(
            f"parallel.strategy={p.strategy} {where}: the stages' replicas need parallel.strategy=ddp (gradients "
            "averaged; also for a single replica), zero2 or zero3 (FSDP2 over the replicas)"
        )
    if p.pipeline_schedule == "interleaved_1f1b":
        if stages % 2 or stages < 4:
            raise ConfigError(
                f"parallel.pipeline_schedule=interleaved_1f1b puts 2 stages on each pipeline process, so "
                f"parallel.pipeline_stages={stages} must be even and >= 4; use gpipe or 1f1b for {stages} stages"
            )
        if p.strategy != "ddp":
            raise ConfigError(
                f"parallel.strategy={p.strategy} does not combine with parallel.pipeline_schedule=interleaved_1f1b; "
                "use parallel.strategy=ddp or parallel.pipeline_schedule=1f1b"
            )
    micro = p.microbatches or 2 * stages
    micro_name = f"parallel.microbatches={p.microbatches}" + ("" if p.microbatches else f" (= {micro})")
    ranks = stages // 2 if p.pipeline_schedule == "interleaved_1f1b" else stages
    if p.pipeline_schedule == "1f1b" and micro < stages:
        raise ConfigError(f"{micro_name} must be >= parallel.pipeline_stages={stages} under 1f1b")
    if p.pipeline_schedule == "interleaved_1f1b" and micro % ranks:
        raise ConfigError(f"{micro_name} must be a multiple of the {ranks} pipeline processes under interleaved_1f1b")
    if cfg.train.batch_size % micro:
        raise ConfigError(
            f"train.batch_size={cfg.train.batch_size} is not divisible by {micro_name}; "
            f"use a batch size that is a multiple of {micro}"
        )
    if cfg.train.compile:
        raise ConfigError(f"train.compile=true {where} is not supported; set train.compile=false")
    if cfg.optim.layer_decay != 1.0:
        raise ConfigError(
            f"optim.layer_decay={cfg.optim.layer_decay} {where}: each stage would count only its own blocks; "
            "set optim.layer_decay=1"
        )
    if cfg.precision.mode == "pure" or (cfg.precision.mode == "amp_o2" and p.strategy not in ("zero2", "zero3")):
        raise ConfigError(
            f"precision.mode={cfg.precision.mode} {where} and parallel.strategy={p.strategy} is not supported (the "
            "stages compute on fp32 weights); use precision.mode=amp_o1 or fp32, or amp_o2 with parallel.strategy="
            "zero2 or zero3 (FSDP2 computes each stage in bf16 on fp32 shards)"
        )
