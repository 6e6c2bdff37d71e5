"""Parallel strategies applied to a single-device model: single, ddp, zero1 (ZeRO-1), zero2/zero3 (FSDP2)."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from vitrain.config import OptimConfig, ParallelConfig
from vitrain.errors import ConfigError
from vitrain.optim import build_optimizer, param_groups, resolve_impl
from vitrain.optim.optimizers import optimizer_class_and_kwargs
from vitrain.parallel.activation_checkpoint import apply_activation_checkpointing
from vitrain.parallel.sync_batchnorm import sync_batchnorm


def parallelize(model: nn.Module, cfg: ParallelConfig, device: torch.device) -> nn.Module:
    """Activation checkpointing first (inside each FSDP unit), BatchNorm over all ranks, then the strategy's wrapper.

    Returns the module to call for forward/backward. For ddp/zero1 that is a DistributedDataParallel
    wrapper around `model`; for zero2/zero3 `model` itself, whose parameters become sharded DTensors.
    """
    plan = model.parallel_plan(cfg.wrap)  # the model names its units (vitrain/models/parallel_plan.py)
    apply_activation_checkpointing(plan.checkpoint_units, cfg.activation_checkpointing, cfg.checkpoint_every_k)
    if cfg.strategy == "single":
        return model
    if cfg.sync_batchnorm and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        sync_batchnorm(model, device)
    if cfg.strategy in ("ddp", "zero1"):
        # Gradients as views into the all-reduce buckets: no second copy of the gradients.
        return DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=True,
        )
    return _fully_shard(model, plan.shard_units, cfg, device)


def _fully_shard(model: nn.Module, units: list[nn.Module], cfg: ParallelConfig, device: torch.device) -> nn.Module:
    from torch.distributed import get_world_size
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (get_world_size(),))
    # Pinned host memory needs an accelerator; on a CPU-only machine the offload is a plain CPU copy.
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cfg.offload == "params" else OffloadPolicy()
    # zero3 frees each unit's gathered parameters after its forward (gathered again in backward);
    # zero2 keeps them until backward: less communication, full parameters resident between the two.
    reshard_after_forward = cfg.strategy == "zero3"
    if cfg.wrap == "sublayer":
        # FSDP2 warns when a unit returns a view (in-place ops on it would skip its backward hook); the blocks
        # only ever add the attention and MLP outputs out of place.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    for unit in [*units, model]:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward, offload_policy=offload)
    if not cfg.backward_prefetch:
        # An explicit prefetch list replaces FSDP2's default (the next unit); listing the unit itself, which is
        # already gathered when its backward starts, prefetches nothing.
        for unit in [*units, model]:
            unit.set_modules_to_backward_prefetch([unit])
    return model


def unwrap(module: nn.Module) -> nn.Module:
    """The single-device model inside a DDP wrapper (FSDP2 keeps the model itself)."""
    return module.module if isinstance(module, DistributedDataParallel) else module


def build_parallel_optimizer(
    model: nn.Module, optim_cfg: OptimConfig, cfg: ParallelConfig, device: torch.device
) -> torch.optim.Optimizer:
    """The configured optimizer over the (possibly sharded) parameters; zero1 shards its state across ranks."""
    model = unwrap(model)
    if cfg.strategy != "zero1":
        return build_optimizer(model, optim_cfg, device, cfg.strategy)
    impl = resolve_impl(optim_cfg.impl, device, optim_cfg.name, cfg.strategy)
    if impl == "flat":
        raise ConfigError("optim.impl=flat cannot be used with parallel.strategy=zero1; use optim.impl=fused or auto")
    optimizer_class, kwargs = optimizer_class_and_kwargs(optim_cfg, impl)
    return ZeroRedundancyOptimizer(param_groups(model, optim_cfg), optimizer_class=optimizer_class, **kwargs)
