"""Helpers for tests that run the trainer in two gloo processes on CPU (spawned, cleaned up on exit)."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from tests.conftest import TINY_MODEL, model_section
from vitrain.config import Config, load_config

# The suite's tiny ViT on 8x8 colour images of 4 classes.
MODEL = dataclasses.replace(TINY_MODEL, image_size=8, in_chans=3, num_classes=4)


def tiny_config(out_dir: Path, name: str, batch_size: int = 16, **sections: dict[str, Any]) -> Config:
    """A 2-block ViT on 64 synthetic 8x8 images, fp32 on any CPU, no augmentation or dropout: exactly comparable."""
    raw: dict[str, Any] = {
        "name": name,
        "model": model_section(MODEL),
        "data": {"source": "synthetic", "synthetic_samples": 64},
        "train": {"epochs": 3, "batch_size": batch_size, "max_steps": 5, "threads": 1, "keep_checkpoints": 10},
        # Exact comparisons need the same arithmetic on every machine: auto picks bf16 on CPUs with AMX.
        "precision": {"mode": "fp32"},
        "log": {"out_dir": str(out_dir), "every_steps": 1, "progress": False},
    }
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return load_config(base=raw)


def whole_and_resumed(out_dir: Path, train: dict[str, Any], stop_at: int, **sections: dict[str, Any]):
    """The same tiny run twice: "whole" straight through `train`, and "part" stopped after `stop_at` steps, then
    resumed to train["max_steps"]. Returns (whole's config, part's config, the resumed Trainer after its fit)."""
    from vitrain.engine import Trainer

    whole = tiny_config(out_dir, "whole", train=train, **sections)
    Trainer(whole).fit()
    part = tiny_config(out_dir, "part", train={**train, "max_steps": stop_at}, **sections)
    Trainer(part).fit()
    part.train.max_steps = train["max_steps"]
    resumed = Trainer(part, resume=True)
    resumed.fit()
    return whole, part, resumed


def losses(run_dir: Path) -> dict[int, float]:
    """Training loss by step from a run's metrics.jsonl (rank 0 logs the mean over ranks)."""
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_free_env(nproc: int) -> dict[str, str]:
    """The variables that keep `nproc` ranks started from here off the GPUs where this machine has fewer GPUs than
    ranks (NCCL wants one per rank): each rank's train.device=auto then resolves to the CPU, and the ranks join with
    gloo. Nothing where there are enough. Ask in the parent: a process that has asked CUDA keeps its answer."""
    return {"CUDA_VISIBLE_DEVICES": ""} if torch.cuda.device_count() < nproc else {}


def run_two_ranks(job: Callable[..., None], *args: Any) -> None:
    """Run `job(*args)` in 2 processes joined in one group, as torchrun would set them up: gloo on CPUs, and on a
    machine with fewer than 2 GPUs too (`gpu_free_env`), NCCL where there are 2."""
    run_ranks(2, job, *args)


def run_ranks(nproc: int, job: Callable[..., None], *args: Any) -> None:
    """Run `job(*args)` in `nproc` processes joined in one group (gloo or NCCL as in `run_two_ranks`)."""
    mp.spawn(_worker, args=(free_port(), nproc, job, args, gpu_free_env(nproc)), nprocs=nproc, join=True)


def torchrun_env(rank: int, port: int, world_size: int = 2) -> dict[str, str]:
    """The variables torchrun sets for one local process."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def _worker(rank: int, port: int, nproc: int, job: Callable[..., None], args: tuple, env: dict[str, str]) -> None:
    # Before anything in this fresh process asks CUDA.
    os.environ.update({**torchrun_env(rank, port, world_size=nproc), **env})
    from vitrain.parallel import shutdown

    try:
        job(*args)
    finally:
        shutdown()
