"""An exponential moving average of the model's weights (`train.ema`): updated after each step, evaluated, saved."""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn


class WeightAverage:
    """fp32 shadow weights: after optimizer step t, ema <- ema + (1 - d_t) * (weights - ema), one foreach op.

    d_t = min(decay, (1 + t) / (10 + t)) with `warmup` (as timm's ModelEmaV3 and TensorFlow's num_updates): the
    average follows the fast-moving early weights closely and forgets its random start, which matters on the
    short runs this is for. Floating-point buffers (BatchNorm statistics) are averaged the same way; integer ones
    are copied. `model` is the single-device model whose weights the optimizer updates (fp32 masters under
    amp_o2; pure mode's low-precision weights are read as fp32).
    """

    def __init__(self, model: nn.Module, decay: float, warmup: bool = True):
        self.decay, self.warmup = decay, warmup
        self.module = copy.deepcopy(model).float().eval().requires_grad_(False)
        self.updates = 0  # optimizer steps averaged so far (checkpointed: the warmup continues on resume)
        # The (average, source) tensor pairs, matched by name once: floating-point ones are averaged, the rest copied.
        own = dict(self.module.named_parameters()) | dict(self.module.named_buffers())
        src = dict(model.named_parameters()) | dict(model.named_buffers())
        floats = [n for n in own if own[n].is_floating_point()]
        ints = [n for n in own if not own[n].is_floating_point()]
        self._floats = [own[n] for n in floats], [src[n] for n in floats]
        self._ints = [own[n] for n in ints], [src[n] for n in ints]

    def current_decay(self) -> float:
        if not self.warmup:
            return self.decay
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self) -> None:
        """After an optimizer step that changed the weights."""
        ema, src = self._floats
        weight = 1.0 - self.current_decay()
        torch._foreach_lerp_(ema, [t.detach().float() for t in src], weight)
        for own, other in zip(*self._ints, strict=True):
            own.copy_(other)
        self.updates += 1

    def state(self) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint holds (filled in place on load)."""
        state = dict(self.module.state_dict(keep_vars=True))
        state["updates"] = torch.tensor(self.updates, dtype=torch.int64)
        return {name: t.data if isinstance(t, nn.Parameter) else t for name, t in state.items()}

    def loaded(self, state: dict[str, torch.Tensor]) -> None:
        """After a checkpoint filled `state()`'s tensors: take the step count back."""
        self.updates = int(state["updates"])

    def autocast(self, dtype: torch.dtype) -> contextlib.AbstractContextManager:
        """Evaluation of the fp32 average in the run's compute dtype (autocast; nothing under fp32)."""
        device = next(self.module.parameters()).device
        if dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=dtype)
