"""Flat optimizer: each param group's tensors become views into one contiguous buffer, updated by one fused call.

The parameters (and their gradients) are re-pointed at slices of a single buffer per group, so the fused kernel
sees one long tensor instead of hundreds of small ones: one launch per group, no per-tensor bookkeeping.
Autograd accumulates into the existing gradient views in place, so `zero_grad` must zero the buffer, never drop
it (the returned optimizer does exactly that whatever `set_to_none` says).
"""

from __future__ import annotations

import torch
from torch import nn


def flatten_group(params: list[nn.Parameter]) -> nn.Parameter:
    """Move `params` into one buffer (data and gradient) and return the buffer as a parameter."""
    first = params[0]
    if any(p.dtype != first.dtype or p.device != first.device for p in params):
        raise ValueError("a flat param group needs one dtype and one device")
    total = sum(p.numel() for p in params)
    flat = nn.Parameter(torch.empty(total, dtype=first.dtype, device=first.device))
    flat.grad = torch.zeros_like(flat)
    flat.members = []  # (parameter, offset): lets checkpoints name each slice of the buffer's state
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            flat[offset : offset + n].copy_(p.reshape(-1))
            p.data = flat.data[offset : offset + n].view_as(p)
            p.grad = flat.grad[offset : offset + n].view_as(p)
            flat.members.append((p, offset))
            offset += n
    return flat


def is_flat(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, _FlatMixin)


def per_parameter_state(optimizer: torch.optim.Optimizer, names: dict[nn.Parameter, str]) -> dict:
    """The optimizer state as if it were kept per parameter (views into the flat state), keyed by name.

    The layout is torch.distributed.checkpoint's (`{"state": {name: {...}}, "param_groups": [...]}`), so a flat
    run's checkpoint loads under any other optimizer kernel or parallel strategy, and the reverse.
    """
    state, groups = {}, []
    for group in optimizer.param_groups:
        (flat,) = group["params"]
        flat_state = optimizer.state.get(flat, {})
        for param, offset in flat.members:
            state[names[param]] = {
                key: value[offset : offset + param.numel()].view_as(param)
                if torch.is_tensor(value) and value.shape == flat.shape
                else value
                for key, value in flat_state.items()
            }
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": [names[p] for p, _ in flat.members]})
    return {"state": state, "param_groups": groups}


def ensure_state(optimizer: torch.optim.Optimizer) -> None:
    """Allocate the flat state (as the first step would) so that a checkpoint can be read into it in place."""
    for group in optimizer.param_groups:
        (flat,) = group["params"]
        if optimizer.state.get(flat):
            continue
        if isinstance(optimizer, torch.optim.AdamW | torch.optim.Adam):
            step = torch.zeros((), dtype=torch.float32, device=flat.device)
            optimizer.state[flat] = {
                "step": step,
                "exp_avg": torch.zeros_like(flat),
                "exp_avg_sq": torch.zeros_like(flat),
            }
        elif group.get("momentum", 0):
            optimizer.state[flat] = {"momentum_buffer": torch.zeros_like(flat)}


class _FlatMixin:
    def zero_grad(self, set_to_none: bool = True) -> None:
        # The gradient buffers are shared with the model's parameters: dropping them would break the views.
        for group in self.param_groups:
            for flat in group["params"]:
                flat.grad.zero_()


def flat_optimizer(cls: type[torch.optim.Optimizer], groups: list[dict], **kwargs) -> torch.optim.Optimizer:
    """Build `cls` (AdamW, SGD, ...) with its fused kernel over one flat buffer per param group."""
    flat_groups = [{**group, "params": [flatten_group(group["params"])]} for group in groups if group["params"]]
    flat_cls = type(f"Flat{cls.__name__}", (_FlatMixin, cls), {})
    fused = torch.device(flat_groups[0]["params"][0].device).type in ("cpu", "cuda")
    return flat_cls(flat_groups, fused=fused, **kwargs)
