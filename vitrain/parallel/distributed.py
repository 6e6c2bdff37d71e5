"""Process-group set-up from torchrun's environment, and rank/world helpers that also work without one."""

from __future__ import annotations

import contextlib
import datetime
import errno
import functools
import gc
import itertools
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vitrain.errors import ConfigError, VitrainError


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: its global rank, the number of processes and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    # Which share of the data this process reads, of how many: its rank and the world size, except under pipelining,
    # where the stages of one replica read the same batches (vitrain/parallel/pipeline.py).
    data_rank: int = 0
    data_size: int = 1

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


def init_distributed(
    device: torch.device, strategy: str, backend: str = "auto", timeout_s: float | None = None
) -> DistInfo:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).

    Without torchrun a non-single strategy still gets a one-process group (an in-memory store), so that the
    same code path - and the same checkpoints - work with one process. CUDA: each process takes device
    LOCAL_RANK; more processes on a node than it has GPUs are refused in one line. `timeout_s`
    (run.collective_timeout_s): a collective waiting longer raises instead of hanging; under NCCL its async error
    handling tears the process down.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    warnings_on_rank_0_only(rank)
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"LOCAL_RANK={local_rank} needs GPU {local_rank} but this node has {torch.cuda.device_count()}: launch "
                "at most one process per GPU (torchrun --nproc_per_node), or train.device=cpu"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if world_size > 1 and strategy == "single":
        raise ConfigError(
            f"{world_size} processes were launched but parallel.strategy=single; "
            "choose parallel.strategy=ddp, zero1, zero2 or zero3"
        )
    if strategy != "single" and not dist.is_initialized():
        name = backend_for(device, backend)
        if name == "nccl":  # a failed or timed-out NCCL collective ends the process instead of leaving it stuck
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        timeout = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
        _TIMEOUT.clear()
        _TIMEOUT.update(timeout)
        if world_size > 1:
            dist.init_process_group(name, store=_restart_store(), rank=rank, world_size=world_size, **timeout)
        else:
            dist.init_process_group(name, store=dist.HashStore(), rank=0, world_size=1, **timeout)
    return DistInfo(rank, world_size, local_rank, device, data_rank=rank, data_size=world_size)


ALL_RANK_WARNINGS_ENV = "VITRAIN_ALL_RANK_WARNINGS"  # 1: Python warnings shown on every rank, not only rank 0


def warnings_on_rank_0_only(rank: int) -> None:
    """Python warnings (torch's, DeepSpeed's, vitrain's own) are shown on rank 0 only, as vitrain's own lines are:
    every rank runs the same code, so another rank's warning is rank 0's again, one copy per rank. Set for the whole
    process (its rank does not change); VITRAIN_ALL_RANK_WARNINGS=1 shows every rank's (a warning one rank alone
    meets). Code that records warnings in catch_warnings() with a filter of its own still sees them."""
    if rank > 0 and os.environ.get(ALL_RANK_WARNINGS_ENV, "").strip() != "1":
        warnings.simplefilter("ignore")


_TIMEOUT: dict[str, datetime.timedelta] = {}  # the process group's timeout, for the side groups too
RUN_DIR_KEY = "vitrain/run_dir"  # in torchrun's store: the run folder this launch writes into


def launch_store() -> dist.Store | None:
    """torchrun's agent store: one per launch, kept across restarts of its worker group; None without torchrun."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from torch.distributed.constants import default_pg_timeout

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return dist.TCPStore(host, port, is_master=False, timeout=default_pg_timeout)


def _restart_store() -> dist.Store | None:
    """Under torchrun, the agent's store with its keys kept apart per restart and per group; None: the env:// default.

    torchrun keeps one store across restarts of the worker group; gloo's connection set-up then reads the
    addresses of the previous (dead) workers from it and times out (measured with torch 2.13: a restarted
    2-rank group fails in connectFullMesh). A prefix per restart gives every try keys of its own.
    """
    store = launch_store()
    if store is None:
        return None
    # Each group this process opens gets its own keys too: a second vitrain.train in the launch (every rank calls it
    # as often) read the first group's addresses and failed in gloo's set-up ("Connection reset by peer").
    return dist.PrefixStore(f"vitrain/restart_{restart_count()}/group_{next(_GROUPS_OPENED)}", store)


_GROUPS_OPENED = itertools.count()  # process groups this process opened under torchrun


@functools.cache
def side_group(purpose: str) -> dist.ProcessGroup | None:
    """Collective on first use (every rank, in the same order): a gloo group of all ranks for `purpose` ("control":
    the per-step stop flag; "checkpoint": async checkpoint writes). The control group is the default group where
    that is gloo already (no extra sockets); None without a group of more than one process.

    Collectives of a background thread must not share a group with the training loop's, and a CPU flag must not
    wait on GPU work: hence gloo, and a group of its own for the checkpoint writer.
    """
    if not is_distributed():
        return None
    if purpose == "control" and dist.get_backend() == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo", **_TIMEOUT)  # run.collective_timeout_s, as the default group's


def shutdown() -> None:
    """End the process group and join its worker threads while the interpreter still runs.

    torch 2.13 keeps a group alive past destroy_process_group once a DeviceMesh registered it: DTensor's caches
    (the redistribute planner, sharding propagation) keep every mesh they saw, and each mesh its groups. gloo's
    worker threads then live on into interpreter exit, where one still releasing a collective's tensors aborts the
    process ("terminate called without an active exception", about 1 exit in 60 on two cores). The meshes' hold
    on the groups is dropped here, so the group is freed, its threads joined, before Python winds down.
    """
    if not dist.is_initialized():
        return
    side_group.cache_clear()
    deepspeed_comm = sys.modules.get("deepspeed.comm.comm")
    if getattr(deepspeed_comm, "cdb", None) is not None:
        # DeepSpeed's own call ends torch's group and lets go of the groups DeepSpeed cached from it: with torch's
        # alone, a second run in the process (vitrain.train called again) failed on the stale group at its start.
        deepspeed_comm.destroy_process_group()
    else:
        dist.destroy_process_group()
    if "torch.distributed.device_mesh" in sys.modules:
        from torch.distributed.device_mesh import DeviceMesh

        for obj in gc.get_objects():
            # type(), not isinstance(): DeviceMesh's metaclass reads the object's own attributes, which warns on
            # torch.distributed.reduce_op (a FutureWarning per rank in every run) and raises on a weakref.proxy
            # whose object is gone (torch.compile's caches leave them).
            if issubclass(type(obj), DeviceMesh):
                getattr(obj, "_pg_registry", {}).clear()
    gc.collect()


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


class RankFailed(VitrainError):
    """Some rank failed; every rank raises this with the same one-line message, so none waits for a dead peer."""


def _failure_message(what: str, error: BaseException, failed_rank: int) -> str:
    """One line for a failure: the user's own error as it is, anything else with the rank and its cause."""
    failures = getattr(error, "failures", None)  # DCP's CheckpointException: {rank: (exception, traceback)}
    if failures:
        failed_rank, (error, _) = min(failures.items(), key=lambda item: item[0])
    if isinstance(error, VitrainError):
        return str(error)
    where = f" on rank {failed_rank}" if world_size() > 1 else ""
    text = " ".join(str(error).split()) or type(error).__name__
    return f"{what} failed{where}: {text}{_fix_for(error, text)}"


def _fix_for(error: BaseException, text: str) -> str:
    """What to do about a write the file system refused (full, read-only, not ours); '' for anything else."""
    code = getattr(error, "errno", None)
    # torch.save's zip writer reports a short write (a disk that filled up under it) as an "unexpected pos".
    if code in (errno.ENOSPC, errno.EDQUOT) or "unexpected pos" in text:
        short = " (a short write: the disk is most likely full)" if code is None else ""
        return f"{short}; free space on that disk and run the same command again (what was written before is kept)"
    if code in (errno.EROFS, errno.EACCES, errno.EPERM):
        return "; make that folder writable, or point log.out_dir at one that is, then run the command again"
    return ""


@contextlib.contextmanager
def all_or_none(what: str) -> Iterator[None]:
    """Collective: run the block on every rank; if it fails on any rank, every rank raises the same RankFailed.

    One all-gather after the block carries each rank's outcome, so a rank whose disk is full (or whose weights
    went non-finite) takes the others down with it within seconds instead of leaving them in the next barrier.
    The rank that failed re-raises its own error when it is the user's (VitrainError) or a bug (with its
    traceback); a failure of the machine (OSError, DCP's CheckpointException) becomes RankFailed everywhere.
    """
    error: BaseException | None = None
    try:
        yield
    except (Exception, _checkpoint_exception()) as exc:  # DCP's CheckpointException is a BaseException
        error = exc
    if not is_distributed() or world_size() == 1:
        outcomes = [None if error is None else _failure_message(what, error, 0)]
    else:
        outcomes = [None] * world_size()
        dist.all_gather_object(outcomes, None if error is None else _failure_message(what, error, rank()))
    failed = [message for message in outcomes if message is not None]
    if not failed:
        return
    if error is not None and not isinstance(error, OSError | _checkpoint_exception()):
        raise error  # the user's error as it was raised (same message as the others get), or a bug's traceback
    raise RankFailed(failed[0]) from None


def _checkpoint_exception() -> type[BaseException]:
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def restart_count() -> int:
    """How many times torchrun has restarted this worker group (torchrun --max-restarts); 0 on the first try."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def max_over_ranks(value: float, device: torch.device) -> float:
    """Collective: the largest of every rank's `value` (a step's time counts at its slowest rank)."""
    if not is_distributed() or dist.get_world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())
