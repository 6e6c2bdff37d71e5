"""The engine protocol: what sets up, steps and checkpoints the model, which the trainer and the step talk to.

    engine = build_engine(cfg, model, dist, head, pipeline, precision)   # train.engine, from the registry
    with engine.autocast():
        output = engine.forward(images)        # also what evaluation calls
    loss = engine.forward_backward(images, labels, loss_fn, timer)   # one micro-step: its loss, gradients accumulated
    grad_norm, skipped = engine.step(loss_nonfinite)  # after train.accum_steps micro-steps
    path = engine.save(run_dir, step, meta, keep)     # collective; meta.json beside the engine's own files
    engine.wait_for_save()                             # collective; an async save's files are complete
    engine.load(path)                                  # collective; the trainer reads and checks meta first
    teacher = engine.frozen(module)                    # train.distill: a frozen model run beside this one
    engine.close()                                     # optional: after the run (Trainer.close)

The native engine (vitrain/engine/native.py: precision policy, parallel strategy, DCP checkpoints) and the DeepSpeed
engine (vitrain/engine/deepspeed.py, `train.engine=deepspeed`) are peers under this protocol; neither imports the
other, and the DeepSpeed one is imported only when named. vitrain/engine/step.py drives either.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from vitrain import checkpoint as ckpt
from vitrain import registry, trust
from vitrain.config import Config
from vitrain.device import PhaseTimer
from vitrain.errors import ConfigError
from vitrain.parallel.distributed import DistInfo
from vitrain.parallel.pipeline import Pipeline
from vitrain.precision import Resolved

COMPENSATION = "compensation"  # pure mode's Kahan terms, saved beside the model and optimizer
HEAD = "head"  # a task's parameters outside the model (the identity head), saved by identity row
EMA = "ema"  # train.ema: the moving average of the weights

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (images, labels) -> the loss through `forward`


class Engine(Protocol):
    """Set up model and optimizer; forward, backward, step; save, load; the fp32 weights. Collective where noted."""

    name: str
    model: nn.Module  # the single-device model, under its own parameter names (complexity, checkpoints, export)
    forward: Callable[[torch.Tensor], Any]  # the module that computes: training loss and evaluation

    def autocast(self) -> contextlib.AbstractContextManager: ...

    def backward(self, loss: torch.Tensor) -> None:
        """One micro-step's mean loss; the engine averages the gradients over train.accum_steps micro-steps."""

    def forward_backward(
        self, images: torch.Tensor, labels: torch.Tensor, loss_fn: LossFn, timer: PhaseTimer | None = None
    ) -> torch.Tensor:
        """One micro-step: its loss (detached), its gradients added to those of the step's earlier micro-steps.

        `loss_fn(images, labels)` is the step's loss through `forward` under `autocast`; a pipeline's schedule
        runs its stages' forward and backward itself instead. `timer` (the benchmark's) marks the end of the
        forward and of the backward.
        """

    def step(self, loss_nonfinite: torch.Tensor | None = None) -> tuple[float | None, bool]:
        """Collective: clip and apply the step's gradients; returns (gradient norm before clipping, skipped)."""

    def set_lr(self, lr: float) -> None: ...

    def parameter_count(self) -> int:
        """The whole model's parameter count (also where a rank holds only a part)."""

    def state_dict(self) -> dict[str, Any]:
        """The engine's JSON state for meta.json (loss scale, skip counters)."""

    def save(self, run_dir: Path, step: int, meta: dict[str, Any], keep: int) -> Path:
        """Collective: a complete checkpoint folder (checkpoint.py's layout) with `meta` in meta.json; under
        train.checkpoint_async the folder it names is complete once `wait_for_save` returns."""

    def wait_for_save(self) -> Path | None:
        """Collective: the folder of the save still being written, once complete (None: none is pending)."""

    def load(self, path: Path, meta: dict[str, Any]) -> bool:
        """Collective: weights, optimizer and engine state from `path`; True when this rank's RNG state was in it."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the model's whole fp32 weights under single-device names, on the CPU (every rank)."""

    def scaler_fields(self) -> dict[str, Any]:
        """Loss-scaling fields for the metrics log (empty without loss scaling)."""

    def skip_report(self) -> tuple[dict[str, Any], str | None]:
        """What a skipped step logs: fields for metrics.jsonl and, where they do not say it, a line for people."""

    @property
    def precision_label(self) -> str:
        """The precision the engine computes in, e.g. `fp32` or `amp_o2 bfloat16`."""

    def describe(self) -> list[str]:
        """Lines for the log's header."""

    def frozen(self, module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """Optional (train.distill needs it): `module` set up to run beside the model, frozen (eval mode, no
        gradients, under inference_mode) in the step's precision and sharded as the model is; returns the function
        from images to its fp32 outputs."""

    def close(self) -> None:
        """Optional: after the run (the trainer's close()), let go of what the engine set up outside itself."""


def close_engine(engine: Engine | None) -> None:
    """`engine.close()` where it has one (a user's engine may not)."""
    close = getattr(engine, "close", None)
    if close is not None:
        close()


def forward_then_backward(
    engine: Engine, images: torch.Tensor, labels: torch.Tensor, loss_fn: LossFn, timer: PhaseTimer | None = None
) -> torch.Tensor:
    """The micro-step of an engine without a schedule of its own: the loss, then the engine's backward of it."""
    loss = loss_fn(images, labels)
    if timer is not None:
        timer.lap("forward")
    engine.backward(loss)
    if timer is not None:
        timer.lap("backward")
    return loss.detach()


def build_engine(
    cfg: Config,
    model: nn.Module,
    dist: DistInfo,
    head: nn.Module | None = None,
    pipeline: Pipeline | None = None,
    precision: Resolved | None = None,
) -> Engine:
    """The engine `train.engine` names (the registry's; a user's by import path), set up over `model` (on its device,
    the same weights on every rank). `precision`: what autotune decided `precision.mode=auto` is."""
    engine_class = registry.lookup("engine", cfg.train.engine)
    return engine_class(cfg, model, dist, head=head, pipeline=pipeline, precision=precision)


def load_model_weights(path: Path, model: nn.Module, trusted: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A checkpoint's fp32 weights into a single-device `model` (one process), whichever engine wrote it; returns
    the checkpoint's meta. An engine it names by import path is imported only where `trusted` (dotted keys: the
    user's values, e.g. config.trusted_values(cfg)) gives it as train.engine, or it is registered (vitrain/trust.py)."""
    meta = ckpt.read_meta(path)  # one process: rank 0, so the checksums are verified; a damaged file is named
    engine = meta.get("engine", "native")
    trust.check_component("engine", "train.engine", engine, Path(path) / ckpt.META_FILE, trusted, named="engine")
    registry.lookup("engine", engine).load_weights(path, meta, model)
    return meta


def check_train(cfg: Config) -> None:
    """The train section's loop settings: one line naming the value and the fix (each engine checks its own)."""
    t = cfg.train
    for name in ("epochs", "batch_size", "accum_steps", "eval_every_epochs", "keep_checkpoints"):
        if getattr(t, name) <= 0:
            raise ConfigError(f"train.{name}={getattr(t, name)} must be positive")
    for name, zero in (("threads", "torch's default"), ("max_steps", "no limit"),
                       ("checkpoint_every_steps", "at the end of each epoch only")):  # fmt: skip
        if getattr(t, name) < 0:
            raise ConfigError(f"train.{name}={getattr(t, name)} must be >= 0 (0: {zero})")
    if t.seed < 0:
        raise ConfigError(f"train.seed={t.seed} must be >= 0 (the data order's generators take no negative seed)")
    if not 0.0 <= t.label_smoothing < 1.0:
        raise ConfigError(f"train.label_smoothing={t.label_smoothing} must be in [0, 1)")
    if t.time_limit_s < 0:
        raise ConfigError(f"train.time_limit_s={t.time_limit_s} must be >= 0 (0: no limit)")
    if any(s <= 0 for s in t.eval_at_s):
        raise ConfigError(f"train.eval_at_s={list(t.eval_at_s)} must be positive seconds, e.g. [300,600]")
    if cfg.schedule.horizon == "time" and not t.time_limit_s:
        raise ConfigError(
            "schedule.horizon=time runs the schedule over the time budget: set train.time_limit_s=SECONDS"
        )
    if not 0.0 <= t.ema < 1.0:
        raise ConfigError(f"train.ema={t.ema} is a decay and must be in [0, 1), e.g. 0.999 (0 turns it off)")
    if t.ema and cfg.parallel.pipeline_stages > 1:
        raise ConfigError("train.ema averages whole weights: set parallel.pipeline_stages=1 or train.ema=0")
