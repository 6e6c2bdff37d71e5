"""FSDP2's gradient reductions on a CPU process group: beside backward, by gloo's cheaper collective, and the next
unit's all-gather beside forward.

On a GPU FSDP2 overlaps its collectives with compute on their own streams. A CPU has no streams: FSDP2 there calls
each unit's reduce-scatter and all-gather blocking, so every collective stalls the process's compute thread for
the transfer and for the slower rank (docs/performance.md), while DDP's bucket all-reduce runs on the process
group's own thread beside backward. `overlap_collectives` changes FSDP2's own settings, nothing else:

- the reduction: FSDP2's custom reduce-scatter seam (`set_custom_reduce_scatter`) is handed a `GradientReduction`,
  which calls one of the process group's own collectives: `reduce_scatter_single`, or under parallel.grad_reduce
  (auto on gloo) an in-place `all_reduce` of which the rank keeps its chunk. gloo serves a reduce-scatter as a
  clone of the input and the same all-reduce, so that removes the clone and nothing else. With parallel.overlap_comm
  it is issued with `async_op=True`, at most `IN_FLIGHT` left pending (issuing another finishes the oldest, which
  frees its unit's gradient buffer); `GradientReduction.wait` (the native engine's backward, before anything reads
  a gradient) waits for the rest. The collective is always PyTorch's; vitrain moves the wait and, after an
  all-reduce, copies the rank's chunk out.
- the all-gather: each unit prefetches the next unit's parameters as it starts its forward
  (`set_modules_to_forward_prefetch`), issued asynchronously (FSDP2's unshard `async_op`), waited by FSDP2 where
  that unit's forward starts.

Deferral applies only to a model of several units: with the whole model as one unit the reduction starts as
backward ends, and deferred there it measured slower (ViT-Ti zero2 ladder rows: 0.91x the blocking ones,
results/ladder-vit_tiny-cpu-overlap-model-deferred).

A deferred reduction is valid only where FSDP2 does not read the reduced shard before backward ends: the gradients
are reduced in the parameters' own dtype (FSDP2 casts a shard reduced in another dtype at once) and no micro-batch
accumulates into an existing sharded gradient (FSDP2 adds the new shard at once), and no division follows the call
(FSDP2 divides fp16 gradients after it): units reduced in another dtype or in fp16 keep a blocking call, and the
native engine turns deferral off under `train.accum_steps` > 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from vitrain.config import Config, ParallelConfig


def deferrable(cfg: Config) -> bool:
    """Whether the native engine defers zero2/zero3's reduce-scatters on a CPU (one micro-batch per step)."""
    return cfg.parallel.overlap_comm and cfg.train.accum_steps == 1


# Deferred reductions left pending at a time: each holds its unit's whole gradient buffer until it is finished, so
# with no bound zero3's sharded gradients cost a whole model's again until backward ends (ViT-B/16 zero3 at 2 ranks,
# sublayer units, fp32: 1,040 MiB per rank against 759 with this bound and 755 blocking; the ViT-Ti zero3 step
# within noise of no bound: docs/performance.md).
IN_FLIGHT = 2

# torch 2.13 renamed `reduce_scatter_tensor` (kept as a deprecated alias) to `reduce_scatter_single`; 2.11 has only
# the old name (seen on a GPU machine's torch 2.11: every deferred zero2/zero3 step failed there).
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class GradientReduction:
    """FSDP2's reduce-scatter (its `ReduceScatter` interface) as one of the process group's own collectives: its
    `reduce_scatter_single`, or (`all_reduce`) an in-place all-reduce of the whole input of which this rank keeps
    its chunk, what DDP and DeepSpeed (`reduce_scatter: false`) call. gloo serves a reduce-scatter by cloning its
    input and all-reducing the clone, so on gloo the all-reduce is the same transfer without the clone (the same
    sums). `defer`: issued without waiting; `wait` (the native engine's backward, before anything reads a gradient)
    finishes every one issued, and only then is an all-reduced chunk copied out."""

    def __init__(self, all_reduce: bool = False, defer: bool = False, in_flight: int = IN_FLIGHT) -> None:
        self.all_reduce, self.defer, self.in_flight = all_reduce, defer, in_flight
        self.pending: list[tuple[dist.Work, torch.Tensor | None, torch.Tensor | None]] = []

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
        if not self.all_reduce:
            # The work holds both tensors until it completes; FSDP2 reads `output_tensor` only after `wait`.
            work = _reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=self.defer)
            if self.defer:
                self._issued(work, None, None)
            return
        # FSDP2 lays the input out as each rank's shard in rank order (its copy-in), so this rank's chunk of the
        # reduced whole is its reduced shard.
        mine = input_tensor.view(dist.get_world_size(group), -1)[dist.get_rank(group)]
        work = dist.all_reduce(input_tensor, op=op, group=group, async_op=self.defer)
        if self.defer:
            self._issued(work, output_tensor, mine)
        else:
            output_tensor.copy_(mine)

    def _issued(self, work: dist.Work, output: torch.Tensor | None, mine: torch.Tensor | None) -> None:
        """Keep `work` pending; beyond `in_flight` pending ones, finish the oldest, so that its unit's whole gradient
        buffer (the collective's input, held until it is finished) is freed while backward goes on."""
        self.pending.append((work, output, mine))
        while len(self.pending) > self.in_flight:
            self._finish(*self.pending.pop(0))

    @staticmethod
    def _finish(work: dist.Work, output: torch.Tensor | None, mine: torch.Tensor | None) -> None:
        work.wait()
        if output is not None:
            output.copy_(mine)

    def wait(self) -> None:
        """Every reduction issued since the last wait, finished: the sharded gradients hold their values."""
        for pending in self.pending:
            self._finish(*pending)
        self.pending.clear()


def all_reduce_on(cfg: ParallelConfig) -> bool:
    """Whether zero2/zero3 reduce gradients with an all-reduce (parallel.grad_reduce): auto where the default process
    group is gloo (its reduce-scatter clones the input first), FSDP2's reduce-scatter elsewhere (NCCL's moves half
    the data of an all-reduce)."""
    if cfg.grad_reduce != "auto":
        return cfg.grad_reduce == "all_reduce"
    return dist.is_initialized() and dist.get_backend() == "gloo"


def overlap_collectives(
    model: nn.Module,
    units: Sequence[nn.Module],
    reduce_dtype: torch.dtype | None,
    fp32_units: Sequence[nn.Module],
    defer: bool = True,
    all_reduce: bool = False,
) -> GradientReduction | None:
    """Hand the gradient reductions of `model` (fully sharded, FSDP2) and its FSDP units to a `GradientReduction`:
    `defer` them, and prefetch each of `units` (in forward order) during the forward of the one before; reduce
    them with an `all_reduce` (parallel.grad_reduce). `reduce_dtype`: the mixed-precision policy's (None: none);
    `fp32_units`: units reduced in fp32 whatever the policy (vitrain's fp32 norms). Returns the deferred reduction,
    whose `wait` must run after backward and before any gradient is read; None where nothing is deferred."""
    from torch.distributed.fsdp import FSDPModule

    deferred = GradientReduction(all_reduce, defer=True)
    blocking = GradientReduction(all_reduce, defer=False) if all_reduce else None
    fp32_ids = {id(m) for m in fp32_units}
    for module in model.modules():
        if not isinstance(module, FSDPModule) or not hasattr(module, "set_custom_reduce_scatter"):
            continue  # a torch without FSDP2's seam keeps its own blocking call
        own = {p.dtype for p in module.parameters(recurse=False)} or {p.dtype for p in module.parameters()}
        reduced_in = torch.float32 if id(module) in fp32_ids else reduce_dtype
        # Deferred only where the shard is not cast after its reduction (FSDP2 casts it at once), and is reduced in
        # fp32 or bf16: in fp16 FSDP2 divides the output right after the call, which a deferred one has not written.
        if defer and (reduced_in is None or own == {reduced_in}) and own <= {torch.float32, torch.bfloat16}:
            module.set_custom_reduce_scatter(deferred)
        elif blocking is not None:
            module.set_custom_reduce_scatter(blocking)
    units = list(units)
    if defer and len(units) > 1:
        for unit, following in zip(units, units[1:], strict=False):
            unit.set_modules_to_forward_prefetch([following])
        for unit in units:
            # FSDP2's own switch (default off): the unit's all-gathers are issued without blocking and waited where
            # its forward (or, under zero3, its backward) starts. Without it a prefetch would block as early.
            if hasattr(unit, "_set_unshard_async_op"):
                unit._set_unshard_async_op(True)
    return deferred if defer else None
