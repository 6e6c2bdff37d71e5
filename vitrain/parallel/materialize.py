"""Sharded init: a model built on the meta device gets each rank's FSDP2 shards, drawn one tensor at a time.

With `parallel.sharded_init` the trainer builds the model on the meta device (no memory), zero2/zero3 shard it,
and `materialize_shards` allocates only this rank's shards and fills them with exactly the values a whole build
would have drawn. From the random state the model recorded when its build began, it replays the build's draws one
tensor at a time in host memory: first each layer's own default init (which a whole build makes, then overwrites),
drawn and dropped; then the model's init in its own order (`init_plan`), each full tensor cut to this rank's shard.
The peak host memory of the build is one tensor, not the whole fp32 model (what stops zero3 from fitting more on
more processes).
"""

from __future__ import annotations

import torch
from torch import nn

from vitrain.errors import VitrainError


def is_on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def materialize_shards(model: nn.Module, device: torch.device) -> None:
    """Collective-free: allocate `model`'s (sharded) parameters and buffers on `device` and draw their values."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    plan = model.init_plan()
    named = dict(model.named_parameters()) | dict(model.named_buffers())
    uninitialized = sorted(set(named) - {name for name, _ in plan})
    if uninitialized:
        raise VitrainError(f"{type(model).__name__}.init_plan() does not say how {uninitialized[0]} starts")
    model.to_empty(device=device)
    named = dict(model.named_parameters()) | dict(model.named_buffers())
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.set_rng_state(model.init_rng_state)
        for module in model.modules():
            _replay_default_init(module, model)
        for name, init in plan:
            target = named[name]
            full = torch.empty(target.shape, dtype=target.dtype)
            init(full, None)
            if isinstance(target, DTensor):  # every rank drew the same full tensor: no communication needed
                shard = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
                target.to_local().copy_(shard.to_local())
            else:
                target.copy_(full)
    del model.init_rng_state


def _replay_default_init(module: nn.Module, model: nn.Module) -> None:
    """The random draws a layer's constructor made in a whole build (e.g. Linear's kaiming_uniform_), on a scratch
    copy of its own parameters at full size, then dropped."""
    own = {name: p for name, p in module._parameters.items() if p is not None}
    if module is model or not own or not hasattr(module, "reset_parameters"):
        return
    from torch.distributed.fsdp import FSDPModule

    layer = next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))  # e.g. LayerNorm, not its FSDP2 twin
    scratch = layer.__new__(layer)
    scratch.__dict__ = dict(module.__dict__)
    scratch._parameters = {  # a parameter the layer lacks (Linear(bias=False)) stays None, as its init expects
        name: None if p is None else nn.Parameter(torch.empty(p.shape, dtype=p.dtype))
        for name, p in module._parameters.items()
    }
    layer.reset_parameters(scratch)
