"""The one training step: micro-batches through forward, the task's loss and the engine's backward, then its step.

    train_step = TrainStep(engine, task.loss, accum_steps, token_drop, teacher)
    result = train_step(micro_batches, lr, steps_done=s, progress=s / total)   # accum_steps (images, targets)

`vitrain train` (the trainer's loop), `vitrain bench` (with a PhaseTimer marking its phases), autotune (each
candidate's engine) and lr-find all call this object, so what is benchmarked and tuned is what trains: the
precision policy's autocast, the task's loss in fp32, the engine's backward (gradient accumulation, loss scaling,
pipeline schedules, DeepSpeed), the non-finite guard, clipping and the optimizer step (the engine's `step`).
Token dropping (train.token_drop, vitrain/engine/token_drop.py) is applied here: the step draws each micro-batch's
kept tokens and hands them to the forward. A teacher (train.distill, the task's) gives its logits for the same images,
which join the targets the task's loss receives.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from vitrain.device import PhaseTimer
from vitrain.engine.protocol import Engine
from vitrain.engine.token_drop import TokenDrop

Criterion = Callable[[Any, Any], torch.Tensor]  # (model output, targets) -> loss (the task's)
# (images, targets) -> the targets the criterion receives: a distilling task's teacher adds its logits to them
Teacher = Callable[[torch.Tensor, Any], Any]


@dataclass
class StepResult:
    loss: torch.Tensor  # the mean of the step's micro-batch losses on this rank, detached (over ranks: a collective)
    grad_norm: float | None  # before clipping; None where the engine does not measure it
    skipped: bool  # inf/NaN (or an fp16 overflow): the weights did not change
    images: int  # images this rank stepped on


class TrainStep:
    """One optimizer step of `engine` over `accum_steps` micro-batches, the loss being `criterion` (the task's);
    `token_drop` draws the patch tokens each image keeps, `teacher` (the task's) adds its logits to the targets."""

    def __init__(
        self,
        engine: Engine,
        criterion: Criterion,
        accum_steps: int = 1,
        token_drop: TokenDrop | None = None,
        teacher: Teacher | None = None,
    ):
        self.engine = engine
        self.criterion = criterion
        self.accum_steps = accum_steps
        self.token_drop = token_drop
        self.teacher = teacher

    def loss(self, images: torch.Tensor, targets: Any, keep: torch.Tensor | None = None) -> torch.Tensor:
        """One micro-batch's training loss: the forward under the precision policy (on the patch tokens in `keep`
        only, where given), the task's loss in fp32 (with the teacher's logits beside the targets, where given)."""
        if self.teacher is not None:
            targets = self.teacher(images, targets)
        with self.engine.autocast():
            output = self.engine.forward(images) if keep is None else self.engine.forward(images, keep=keep)
        return self.criterion(output, targets)

    def __call__(
        self,
        micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
        lr: float | None = None,
        timer: PhaseTimer | None = None,
        steps_done: int = 0,
        progress: float = 0.0,
    ) -> StepResult:
        """Forward and backward each of the `accum_steps` micro-batches (gradients add up), then one optimizer step
        at `lr` (None: the optimizer's current lr). A step whose loss is inf/NaN anywhere is skipped or stops the run,
        as the engine's precision decides. `timer` marks data, forward, backward and optimizer phases. `steps_done`
        (the optimizer steps taken before this one) and `progress` (0-1, the share of the schedule behind it) decide
        token dropping's draws and its unmasked finish."""
        if lr is not None:
            self.engine.set_lr(lr)
        if timer is not None:
            timer.start()
        nonfinite: torch.Tensor | None = None
        total: torch.Tensor | None = None
        count = images = 0
        for inputs, targets in micro_batches:
            keep = self.token_drop.keep(inputs, steps_done, progress, count) if self.token_drop is not None else None
            if timer is not None:
                timer.lap("data")
            loss_fn = self.loss if keep is None else functools.partial(self.loss, keep=keep)
            loss = self.engine.forward_backward(inputs, targets, loss_fn, timer)
            flag = ~torch.isfinite(loss)  # checked at the optimizer step, without a device sync here
            nonfinite = flag if nonfinite is None else nonfinite | flag
            # The step's loss is the mean over its micro-batches, as a step of one batch of them all is the mean over
            # its samples (and the gradient is: each backward takes loss / accum_steps). Summed on the device, read
            # once by the log. Before, the last micro-batch's alone: 2.325479 at 32x2 against 2.325912 at 64x1.
            total = loss.detach() if total is None else total + loss.detach()
            count += 1
            images += inputs.shape[0]
        if total is None or count != self.accum_steps:
            raise ValueError(f"a step takes train.accum_steps={self.accum_steps} micro-batches, got {count}")
        grad_norm, skipped = self.engine.step(nonfinite)
        if timer is not None:
            timer.lap("optimizer")
        return StepResult(total / count, grad_norm, skipped, images)
