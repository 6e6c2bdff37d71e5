"""Parallel strategies applied to a single-device model: single, ddp, zero1 (ZeRO-1), zero2/zero3 (FSDP2)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from vitrain.config import OptimConfig, ParallelConfig
from vitrain.errors import ConfigError
from vitrain.models.plan import plan_of
from vitrain.optim import build_optimizer, param_groups, resolve_impl
from vitrain.optim.optimizers import optimizer_class_and_kwargs
from vitrain.parallel.activation_checkpoint import apply_activation_checkpointing
from vitrain.parallel.materialize import is_on_meta, materialize_shards
from vitrain.parallel.overlap import all_reduce_on, overlap_collectives
from vitrain.parallel.sync_batchnorm import sync_batchnorm

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from vitrain.precision import ParallelPrecision


def parallelize(
    model: nn.Module,
    cfg: ParallelConfig,
    device: torch.device,
    precision: ParallelPrecision | None = None,
    overlap: bool = False,
) -> nn.Module:
    """Activation checkpointing first (inside each FSDP unit), BatchNorm over all ranks, then the strategy's wrapper.

    Returns the module to call for forward/backward. For ddp/zero1 that is a DistributedDataParallel
    wrapper around `model`; for zero2/zero3 `model` itself, whose parameters become sharded DTensors.
    `precision` (amp_o2, pure): `model` computes in its low dtype; gradients are averaged in its reduce dtype.
    `overlap` (zero2/zero3 on a CPU; the native engine's `deferrable(cfg)`): FSDP2's collectives beside compute
    (vitrain/parallel/overlap.py); the caller then runs `finish_reductions(model)` after each backward.
    """
    if cfg.block:  # a name that is not the model's block is refused even where nothing below reads it
        plan_of(model, "block", cfg.block)
    prepare_layers(model, cfg, device)
    if cfg.strategy == "single":
        return model
    if cfg.strategy in ("ddp", "zero1"):
        # Gradients as views into the all-reduce buckets: no second copy of the gradients.
        ddp = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=True,
        )
        if precision is not None and precision.reduce_dtype != precision.param_dtype:
            ddp.register_comm_hook(None, _average_in(precision.reduce_dtype))
        return ddp
    return fully_shard_model(model, cfg, device, precision, overlap=overlap)


def prepare_layers(model: nn.Module, cfg: ParallelConfig, device: torch.device) -> None:
    """What every engine does to the model's layers before wrapping it: activation checkpointing on the blocks the
    model's plan names (vitrain/models/plan.py) and, on several ranks, BatchNorm over the global batch."""
    if cfg.activation_checkpointing != "none":
        plan = plan_of(model, cfg.wrap, cfg.block)
        if not plan.checkpoint_units:
            raise ConfigError(
                f"parallel.activation_checkpointing={cfg.activation_checkpointing} recomputes repeated blocks, and "
                "this model has no ModuleList of one class; name its block class with parallel.block=NAME"
            )
        apply_activation_checkpointing(plan.checkpoint_units, cfg.activation_checkpointing, cfg.checkpoint_every_k)
    if cfg.strategy == "single" or not cfg.sync_batchnorm:
        return
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        sync_batchnorm(model, device)


def _average_in(dtype: torch.dtype):
    """A DDP communication hook that averages each gradient bucket in `dtype` (e.g. bf16 gradients in fp32)."""

    # No annotations: DDP checks them against the real classes, which `from __future__ import annotations` hides.
    def hook(group, bucket):  # noqa: ANN001, ANN202
        buffer = bucket.buffer()
        wide = buffer.to(dtype).div_(dist.get_world_size(group))
        reduced = dist.all_reduce(wide, group=group, async_op=True).get_future()

        def store(future: torch.futures.Future) -> torch.Tensor:
            buffer.copy_(future.value()[0])
            return buffer

        return reduced.then(store)

    return hook


def fully_shard_model(
    model: nn.Module,
    cfg: ParallelConfig,
    device: torch.device,
    precision: ParallelPrecision | None = None,
    mesh: DeviceMesh | None = None,
    overlap: bool = False,
) -> nn.Module:
    """zero2/zero3: FSDP2 over `mesh` (every rank by default; a pipeline stage's replicas under pipelining) with the
    model's own units (its plan), offload, prefetch and, for low-precision weights, mixed-precision units.
    `overlap`: on a CPU, reduce-scatters deferred and all-gathers prefetched (vitrain/parallel/overlap.py)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    from vitrain.precision import fp32_between

    plan = plan_of(model, cfg.wrap, cfg.block, precision.fp32_modules if precision is not None else ())
    mesh = mesh if mesh is not None else init_device_mesh(device.type, (dist.get_world_size(),))
    # Pinned host memory needs an accelerator; on a CPU-only machine the offload is a plain CPU copy.
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cfg.offload == "params" else OffloadPolicy()
    # zero3 frees each unit's gathered parameters after its forward (gathered again in backward);
    # zero2 keeps them until backward: less communication, full parameters resident between the two.
    reshard_after_forward = cfg.strategy == "zero3"
    if cfg.wrap == "sublayer" or hasattr(model, "parallel_plan"):
        # FSDP2 warns when a unit returns a view (in-place ops on it would skip its backward hook); the blocks
        # only ever add the attention and MLP outputs out of place, and vitrain's tasks read a model's output out of
        # place (the root's output reaches FSDP2 as a view in low precision: the warning came with every such run).
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    shard = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, offload_policy=offload)
    if precision is None:
        policy = root_policy = MixedPrecisionPolicy()
    else:
        policy = MixedPrecisionPolicy(param_dtype=precision.param_dtype, reduce_dtype=precision.reduce_dtype)
        # The loss and the task's head outside the model see fp32 outputs; inputs are cast to the compute dtype.
        root_policy = MixedPrecisionPolicy(
            param_dtype=precision.param_dtype, reduce_dtype=precision.reduce_dtype, output_dtype=torch.float32
        )
        # Every norm of the model is one fp32 unit (gathered, computed and reduced in fp32), kept gathered from
        # forward to backward under zero3 too: norms hold a few thousand values per block, and one unit is one
        # all-gather and one reduce-scatter per step instead of one of each per block, each of which waits for the
        # slowest rank (the step breakdown in docs/performance.md). Each norm hands its output on in the compute
        # dtype of the unit around it. FSDP2 would cast a group's inputs only where the group's forward starts, so
        # the norms' unit casts none and every norm upcasts its own (a CUDA LayerNorm refuses bf16 inputs with fp32
        # weights, and a CPU one would run on bf16 inputs): under precision.compile_norms a plain LayerNorm inside
        # its compiled kernel, else a pre-hook. Other modules kept fp32 (precision.fp32_modules) may be large: their
        # groups follow the strategy's resharding, and FSDP2 also casts their keyword tensors (the pre-hook casts
        # positional ones).
        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        norms_policy = MixedPrecisionPolicy(
            param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
        groups = [(plan.norms, norms_policy, {**shard, "reshard_after_forward": False})] if plan.norms else []
        groups += [(group, fp32, shard) for group in plan.fp32_groups]
        for group, mp_policy, how in groups:
            for module in group:  # before FSDP2 subclasses it: a compiled norm is picked by its exact class
                fp32_between(module, precision.param_dtype, precision.compile_norms)
            fully_shard(group, mp_policy=mp_policy, **how)
    kept_fp32 = {id(m) for group in plan.fp32_groups for m in group} if precision is not None else set()
    for unit in plan.shard_units:
        if id(unit) not in kept_fp32:  # a block named in precision.fp32_modules is its own fp32 unit already
            fully_shard(unit, mp_policy=policy, **shard)
    fully_shard(model, mp_policy=root_policy, **shard)
    # On a GPU FSDP2 overlaps on its own streams. With one unit (the whole model) its reduce-scatter starts as
    # backward ends, with nothing left to overlap; deferred there, ViT-Ti zero2 ladder rows ran 0.91x blocking.
    # parallel.grad_reduce: on gloo an all-reduce instead of its reduce-scatter (a clone and the same all-reduce).
    defer, all_reduce = overlap and device.type == "cpu" and len(plan.shard_units) > 1, all_reduce_on(cfg)
    if defer or all_reduce:
        fp32_units = [*plan.norms, *(m for group in plan.fp32_groups for m in group)] if precision is not None else []
        reduce_dtype = precision.reduce_dtype if precision is not None else None
        deferred = overlap_collectives(
            model, plan.shard_units, reduce_dtype, fp32_units, defer=defer, all_reduce=all_reduce
        )
        if deferred is not None:
            model._vitrain_reductions = deferred
    if is_on_meta(model):  # parallel.sharded_init: only now, and only this rank's shards, take memory
        materialize_shards(model, torch.device("cpu") if cfg.offload == "params" else device)
    if not cfg.backward_prefetch:
        # An explicit prefetch list replaces FSDP2's default (the next unit); listing the unit itself, which is
        # already gathered when its backward starts, prefetches nothing.
        for unit in [*plan.shard_units, model]:
            unit.set_modules_to_backward_prefetch([unit])
    gather_once(model)
    return model


def gather_once(model: nn.Module) -> None:
    """Gather and free each FSDP2 unit once, unit by unit, outside any inference_mode. FSDP2 makes a unit's
    gathered-parameter buffers at its first all-gather and keeps them; made under torch.inference_mode (a process
    whose first forward is an evaluation: a run resumed after its epoch's last step evaluates first) they are
    inference tensors, which training's next gather may not write into (and one process's gather may not read)."""
    from torch.distributed.fsdp import FSDPModule

    with torch.no_grad():
        for unit in model.modules():
            if isinstance(unit, FSDPModule):
                unit.unshard()
                unit.reshard()


def finish_reductions(module: nn.Module) -> None:
    """Wait for the gradient reductions `overlap` left running in backward (nothing to do without it)."""
    reductions = getattr(unwrap(module), "_vitrain_reductions", None)
    if reductions is not None:
        reductions.wait()


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
    # Each rank's parameters as views into one flat buffer: after the step, one broadcast per rank instead of one
    # per parameter (ViT-Ti on 2 gloo ranks: the optimizer phase 80-89 ms -> 27-29 ms, docs/performance.md).
    return ZeroRedundancyOptimizer(
        param_groups(model, optim_cfg), optimizer_class=optimizer_class, parameters_as_bucket_view=True, **kwargs
    )
