"""FSDP2 on a CPU process group: gradient reduce-scatters beside backward, the next unit's all-gather beside forward.

On a GPU FSDP2 overlaps its collectives with compute on their own streams. A CPU has no streams: FSDP2 there calls
each unit's reduce-scatter and all-gather blocking, so every collective stalls the process's compute thread for
the transfer and for the slower rank (docs/performance.md), while DDP's bucket all-reduce runs on the process
group's own thread beside backward. `overlap_collectives` gives FSDP2 the same on a CPU with its own settings:

- the reduce-scatter: FSDP2's custom reduce-scatter seam (`set_custom_reduce_scatter`) is handed the process
  group's own `reduce_scatter_single`, issued with `async_op=True`; `OverlappedReduceScatter.wait` (the native
  engine's backward, before anything reads a gradient) waits for every one issued. Nothing here reduces, copies or
  splits a tensor itself: the collective is PyTorch's, only the wait moves.
- the all-gather: each unit prefetches the next unit's parameters as it starts its forward
  (`set_modules_to_forward_prefetch`), issued asynchronously (FSDP2's unshard `async_op`), waited by FSDP2 where
  that unit's forward starts.

Only a model of several units is changed: with the whole model as one unit the reduce-scatter starts as backward
ends, and deferred there it measured slower (ViT-Ti zero2 ladder rows: 0.91x the blocking ones,
results/ladder-vit_tiny-cpu-overlap-model-deferred).

A deferred reduce-scatter is valid only where FSDP2 does not read the reduced shard before backward ends: the
gradients are reduced in the parameters' own dtype (FSDP2 casts a shard reduced in another dtype at once) and no
micro-batch accumulates into an existing sharded gradient (FSDP2 adds the new shard at once): units reduced in
another dtype keep FSDP2's blocking call, and the native engine turns deferral off under `train.accum_steps` > 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from vitrain.config import Config


def deferrable(cfg: Config) -> bool:
    """Whether the native engine defers zero2/zero3's reduce-scatters on a CPU (one micro-batch per step)."""
    return cfg.parallel.overlap_comm and cfg.train.accum_steps == 1


# torch 2.13 renamed `reduce_scatter_tensor` (kept as a deprecated alias) to `reduce_scatter_single`; 2.11 has only
# the old name (seen on a GPU machine's torch 2.11: every deferred zero2/zero3 step failed there).
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class OverlappedReduceScatter:
    """FSDP2's reduce-scatter (its `ReduceScatter` interface) as the process group's own, not waited for here."""

    def __init__(self) -> None:
        self.pending: list[dist.Work] = []

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(  # noqa: ANN204
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ):
        # The work holds both tensors until it completes; FSDP2 reads `output_tensor` only after `wait`.
        work = _reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=True)
        self.pending.append(work)

    def wait(self) -> None:
        """Every reduce-scatter issued since the last wait, finished: the sharded gradients hold their values."""
        for work in self.pending:
            work.wait()
        self.pending.clear()


def overlap_collectives(
    model: nn.Module, units: Sequence[nn.Module], reduce_dtype: torch.dtype | None, fp32_units: Sequence[nn.Module]
) -> OverlappedReduceScatter:
    """Defer the reduce-scatters of `model` (fully sharded, FSDP2) and its FSDP units, and prefetch each of `units`
    (in forward order) during the forward of the one before. `reduce_dtype`: the mixed-precision policy's (None:
    none); `fp32_units`: units reduced in fp32 whatever the policy (vitrain's fp32 norms). Returns the deferred
    reduce-scatter, whose `wait` must run after backward and before any gradient is read."""
    from torch.distributed.fsdp import FSDPModule

    comm = OverlappedReduceScatter()
    fp32_ids = {id(m) for m in fp32_units}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        own = {p.dtype for p in module.parameters(recurse=False)} or {p.dtype for p in module.parameters()}
        reduced_in = torch.float32 if id(module) in fp32_ids else reduce_dtype
        # The shard is not cast after its reduction; a torch without FSDP2's seam keeps its blocking call.
        if (reduced_in is None or own == {reduced_in}) and hasattr(module, "set_custom_reduce_scatter"):
            module.set_custom_reduce_scatter(comm)
    units = list(units)
    if len(units) > 1:
        for unit, following in zip(units, units[1:], strict=False):
            unit.set_modules_to_forward_prefetch([following])
        for unit in units:
            # FSDP2's own switch (default off): the unit's all-gathers are issued without blocking and waited where
            # its forward (or, under zero3, its backward) starts. Without it a prefetch would block as early.
            if hasattr(unit, "_set_unshard_async_op"):
                unit._set_unshard_async_op(True)
    return comm
