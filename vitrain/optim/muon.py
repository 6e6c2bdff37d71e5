"""Muon for the transformer blocks' weight matrices (orthogonalized momentum), AdamW for every other tensor.

Muon (Jordan et al. 2024) replaces each matrix's update by the nearest semi-orthogonal matrix to its (Nesterov)
momentum, computed with a few Newton-Schulz iterations. The update is rescaled to the RMS an AdamW update has
(0.2 x sqrt(max(rows, cols)), Liu et al. 2025, "Muon is scalable"), so one `optim.lr` and `optim.weight_decay`
serve both kinds of tensor and a recipe can switch between adamw and muon without retuning them.

One optimizer with ordinary per-parameter state (`momentum_buffer`; AdamW's `step`, `exp_avg`, `exp_avg_sq`,
updated by torch's functional AdamW), so checkpoints, resume and the lr schedule treat it like any torch optimizer.
Each group says which rule it follows (`group["muon"]`); `param_groups` in optimizers.py decides it by name.
"""

from __future__ import annotations

import torch
from torch.optim.adamw import adamw

# Quintic Newton-Schulz coefficients tuned to push all singular values into roughly [0.7, 1.2] in 5 steps.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
RMS_MATCH = 0.2  # the typical RMS of an AdamW update per unit lr


def orthogonalize(
    matrix: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32, eps: float = 1e-7
) -> torch.Tensor:
    """An approximation of U V^T for matrix = U S V^T (singular values pushed towards 1), in the matrix's shape.

    `matrix` may carry leading batch dimensions (a stack of same-shaped matrices, each treated on its own). The
    iteration's matmuls run in `dtype`: bf16 is accurate enough for an update direction (Jordan et al. run it so)
    and 4x faster on a CPU with bf16 dot products, but slow on one without; Muon takes the run's compute dtype.
    """
    a, b, c = NS_COEFFICIENTS
    x = matrix.float().reshape(-1, *matrix.shape[-2:])
    tall = x.size(-2) > x.size(-1)
    if tall:  # iterate on the smaller Gram matrix
        x = x.mT
    x = (x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)).to(dtype)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)  # a x + (b G + c G^2) x
    if tall:
        x = x.mT
    return x.reshape(matrix.shape).to(matrix.dtype)


class Muon(torch.optim.Optimizer):
    """Muon on the groups marked `muon=True` (2-D weights), AdamW on the others; decoupled weight decay on both."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        ns_steps: int = 5,
        ns_dtype: torch.dtype = torch.float32,
    ):
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "ns_steps": ns_steps,
            "muon": False,
        }
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype  # the engine sets the run's compute dtype (not a hyperparameter: not checkpointed)
        for group in self.param_groups:
            if group["muon"] and any(p.ndim != 2 for p in group["params"]):
                raise ValueError("Muon groups hold 2-D weight matrices only")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                (self._muon if group["muon"] else self._adamw)(group, params)
        return loss

    def _muon(self, group: dict, params: list[torch.Tensor]) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        for p in params:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)
        grads = [p.grad for p in params]
        buffers = [self.state[p]["momentum_buffer"] for p in params]
        torch._foreach_lerp_(buffers, grads, 1 - mu)
        directions = torch._foreach_lerp(grads, buffers, mu)  # Nesterov: look one momentum step ahead
        if wd:
            torch._foreach_mul_(params, 1 - lr * wd)
        # Same-shaped matrices (one per block) are orthogonalized as one batch: a few large matmuls, not many small.
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, p in enumerate(params):
            by_shape.setdefault(tuple(p.shape), []).append(i)
        for shape, members in by_shape.items():
            updates = orthogonalize(torch.stack([directions[i] for i in members]), group["ns_steps"], self.ns_dtype)
            scale = lr * RMS_MATCH * max(shape) ** 0.5
            torch._foreach_add_([params[i] for i in members], list(updates.unbind(0)), alpha=-scale)

    def _adamw(self, group: dict, params: list[torch.Tensor]) -> None:
        for p in params:
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adamw(  # torch's own AdamW update (its functional form), on this group's state
            params,
            [p.grad for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            [s["step"] for s in states],
            foreach=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
