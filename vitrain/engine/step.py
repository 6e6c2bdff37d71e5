"""The one training step: micro-batches through forward, the task's loss and the engine's backward, then its step.

    step = TrainStep(engine, task.loss, accum_steps)
    result = step(micro_batches, lr)        # train.accum_steps (images, targets) pairs -> StepResult

`vitrain train` (the trainer's loop), `vitrain bench` (with a PhaseTimer marking its phases), autotune (each
candidate's engine) and lr-find all call this object, so what is benchmarked and tuned is what trains: the
precision policy's autocast, the task's loss in fp32, the engine's backward (gradient accumulation, loss scaling,
pipeline schedules, DeepSpeed), the non-finite guard, clipping and the optimizer step (the engine's `step`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from vitrain.device import PhaseTimer
from vitrain.engine.protocol import Engine

Criterion = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (model output, targets) -> loss (the task's)


@dataclass
class StepResult:
    loss: torch.Tensor  # the last micro-batch's loss on this rank, detached (mean over ranks: a collective)
    grad_norm: float | None  # before clipping; None where the engine does not measure it
    skipped: bool  # inf/NaN (or an fp16 overflow): the weights did not change
    images: int  # images this rank stepped on


class TrainStep:
    """One optimizer step of `engine` over `accum_steps` micro-batches, the loss being `criterion` (the task's)."""

    def __init__(self, engine: Engine, criterion: Criterion, accum_steps: int = 1):
        self.engine = engine
        self.criterion = criterion
        self.accum_steps = accum_steps

    def loss(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One micro-batch's training loss: the forward under the precision policy, the task's loss in fp32."""
        with self.engine.autocast():
            output = self.engine.forward(images)
        return self.criterion(output, targets)

    def __call__(
        self,
        micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
        lr: float | None = None,
        timer: PhaseTimer | None = None,
    ) -> StepResult:
        """Forward and backward each of the `accum_steps` micro-batches (gradients add up), then one optimizer step
        at `lr` (None: the optimizer's current lr). A step whose loss is inf/NaN anywhere is skipped or stops the run,
        as the engine's precision decides. `timer` marks data, forward, backward and optimizer phases."""
        if lr is not None:
            self.engine.set_lr(lr)
        if timer is not None:
            timer.start()
        nonfinite: torch.Tensor | None = None
        count = images = 0
        for inputs, targets in micro_batches:
            if timer is not None:
                timer.lap("data")
            loss = self.engine.forward_backward(inputs, targets, self.loss, timer)
            flag = ~torch.isfinite(loss)  # checked at the optimizer step, without a device sync here
            nonfinite = flag if nonfinite is None else nonfinite | flag
            count += 1
            images += inputs.shape[0]
        if count != self.accum_steps:
            raise ValueError(f"a step takes train.accum_steps={self.accum_steps} micro-batches, got {count}")
        grad_norm, skipped = self.engine.step(nonfinite)
        if timer is not None:
            timer.lap("optimizer")
        return StepResult(loss, grad_norm, skipped, images)
