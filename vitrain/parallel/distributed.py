"""Process-group set-up from torchrun's environment, and rank/world helpers that also work without one."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vitrain.errors import ConfigError


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: its global rank, the number of processes and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def backend_for(device: torch.device, backend: str = "auto") -> str:
    """nccl for CUDA devices, gloo for CPU (the only backend that runs CPU collectives)."""
    if backend != "auto":
        if backend == "nccl" and device.type != "cuda":
            raise ConfigError("parallel.backend=nccl needs CUDA devices; use parallel.backend=gloo (or auto) on cpu")
        return backend
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(device: torch.device, strategy: str, backend: str = "auto") -> DistInfo:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).

    Without torchrun a non-single strategy still gets a one-process group (an in-memory store), so that the
    same code path - and the same checkpoints - work with one process. CUDA: each process takes device
    LOCAL_RANK (untested here: this machine has no GPU).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if world_size > 1 and strategy == "single":
        raise ConfigError(
            f"{world_size} processes were launched but parallel.strategy=single; "
            "choose parallel.strategy=ddp, zero1, zero2 or zero3"
        )
    if strategy != "single" and not dist.is_initialized():
        name = backend_for(device, backend)
        if world_size > 1:
            dist.init_process_group(name, rank=rank, world_size=world_size)
        else:
            dist.init_process_group(name, store=dist.HashStore(), rank=0, world_size=1)
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The average of a scalar over all processes (the loss of the global batch when batches are equal)."""
    return sum_over_ranks(value) / world_size()


def sum_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The elementwise sum of a tensor over all processes (for example counts of a sharded evaluation)."""
    if not is_distributed() or dist.get_world_size() == 1:
        return value
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def broadcast_object(obj: object) -> object:
    """Rank 0's value on every rank (for example a checkpoint directory name)."""
    if not is_distributed() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
