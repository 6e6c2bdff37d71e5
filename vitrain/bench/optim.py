"""Optimizer-step benchmark: time one step of each kernel (loop, foreach, fused, flat) over a preset's parameters."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from vitrain.config import ModelConfig, OptimConfig, load_config
from vitrain.device import synchronize
from vitrain.errors import ConfigError
from vitrain.models import count_parameters, create_model
from vitrain.optim import build_optimizer, resolve_impl
from vitrain.optim.optimizers import KERNELS

DEFAULT_IMPLS = ("loop", "foreach", "fused", "flat", "auto")


def default_impls(name: str) -> tuple[str, ...]:
    """Every kernel optimizer `name` has (loop first, the baseline of the speed-ups), then auto."""
    return tuple(impl for impl in DEFAULT_IMPLS if impl == "auto" or impl in KERNELS[name])


@dataclass
class StepTiming:
    impl: str  # as asked for
    resolved: str  # what `auto` became
    ms_per_step: float  # median over the timed steps
    speedup_vs_loop: float | None


def preset_model_config(name: str) -> ModelConfig:
    """The architecture of a preset (an unknown name gets the config's one-line error with a suggestion)."""
    return load_config(overrides=[f"model.preset={name}"]).model


def bench_optimizer_step(
    model_cfg: ModelConfig,
    optim_cfg: OptimConfig,
    impls: tuple[str, ...] = DEFAULT_IMPLS,
    steps: int = 20,
    warmup: int = 3,
    device: torch.device | None = None,
    ns_dtype: torch.dtype = torch.float32,
) -> tuple[int, list[StepTiming]]:
    """Median time of `optimizer.step()` per impl on the same parameters and gradients; returns (params, timings).

    The impls take turns step by step, so load from other processes on a shared machine hits them all alike.
    `ns_dtype` is Muon's Newton-Schulz dtype (optim.name=muon only; the engine sets it from the run's precision).
    A kernel the optimizer does not have is refused before any model is built.
    """
    for impl in impls:
        if impl != "auto" and impl not in KERNELS[optim_cfg.name]:
            choices = ", ".join(default_impls(optim_cfg.name))
            raise ConfigError(f"--impls: {optim_cfg.name} has no {impl} kernel; choose from {choices}")
    device = device or torch.device("cpu")
    optimizers, params = [], 0
    for impl in impls:
        torch.manual_seed(0)
        model = create_model(model_cfg).to(device)
        params = count_parameters(model)
        cfg = OptimConfig(**{**optim_cfg.__dict__, "impl": impl})
        optimizer = build_optimizer(model, cfg, device)
        if cfg.name == "muon":
            optimizer.ns_dtype = ns_dtype
        optimizers.append(optimizer)
        with torch.no_grad():
            for p in model.parameters():  # the flat impl already gave each parameter a gradient view: fill it
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                p.grad.normal_(std=1e-3)
    samples: list[list[float]] = [[] for _ in impls]
    for i in range(warmup + steps):
        for optimizer, times in zip(optimizers, samples, strict=True):
            synchronize(device)
            start = time.perf_counter()
            optimizer.step()
            synchronize(device)
            if i >= warmup:
                times.append(time.perf_counter() - start)
    timings = [
        StepTiming(impl, resolve_impl(impl, device, optim_cfg.name), 1e3 * statistics.median(times), None)
        for impl, times in zip(impls, samples, strict=True)
    ]
    loop = next((t.ms_per_step for t in timings if t.resolved == "loop"), None)
    for t in timings:
        t.speedup_vs_loop = loop / t.ms_per_step if loop else None
    return params, timings
