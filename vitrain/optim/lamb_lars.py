"""LAMB and LARS: layer-wise trust ratios for large-batch training (torch has neither); foreach or per-tensor loop."""

from __future__ import annotations

import torch


def _trust_ratios(weight_norms: list[torch.Tensor], step_norms: list[torch.Tensor]) -> list[torch.Tensor]:
    """||w|| / ||step|| per tensor, 1 where either norm is zero (fresh zero-initialized biases, zero gradients)."""
    return [
        torch.where((w > 0) & (u > 0), w / u.clamp_min(1e-30), torch.ones_like(w))
        for w, u in zip(weight_norms, step_norms, strict=True)
    ]


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2019): the AdamW step of each tensor rescaled so its norm follows ||w||."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, foreach=True, fused=False):
        if fused:
            raise ValueError("Lamb has no fused kernel; use foreach=True")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.foreach = foreach

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            beta1, beta2 = group["betas"]
            grads, exp_avgs, exp_avg_sqs = [p.grad for p in params], [], []
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
            step = self.state[params[0]]["step"]
            correction1, correction2 = 1 - beta1**step, 1 - beta2**step
            if self.foreach:
                torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
                torch._foreach_mul_(exp_avg_sqs, beta2)
                torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
                denom = torch._foreach_sqrt(exp_avg_sqs)
                torch._foreach_div_(denom, correction2**0.5)
                torch._foreach_add_(denom, group["eps"])
                updates = torch._foreach_div(exp_avgs, denom)
                torch._foreach_div_(updates, correction1)
                if group["weight_decay"]:
                    torch._foreach_add_(updates, params, alpha=group["weight_decay"])
                ratios = _trust_ratios(torch._foreach_norm(params), torch._foreach_norm(updates))
                torch._foreach_mul_(updates, ratios)
                torch._foreach_add_(params, updates, alpha=-group["lr"])
                continue
            for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                update = (m / correction1) / ((v / correction2).sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                (ratio,) = _trust_ratios([p.norm()], [update.norm()])
                p.add_(update * ratio, alpha=-group["lr"])


class Lars(torch.optim.Optimizer):
    """LARS (You et al. 2017): SGD with momentum whose per-tensor lr is trust_coefficient x ||w|| / ||g + wd w||.

    Tensors without weight decay (norms, biases, embeddings) take plain momentum SGD, as in common practice.
    """

    def __init__(
        self, params, lr=0.1, momentum=0.9, weight_decay=0.0, trust_coefficient=0.001, foreach=True, fused=False
    ):
        if fused:
            raise ValueError("Lars has no fused kernel; use foreach=True")
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
        super().__init__(params, {**defaults, "trust_coefficient": trust_coefficient})
        self.foreach = foreach

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            bufs = []
            for p in params:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                bufs.append(self.state[p]["momentum_buffer"])
            wd, lr = group["weight_decay"], group["lr"]
            if self.foreach:
                grads = [p.grad for p in params]
                if wd:
                    grads = torch._foreach_add(grads, params, alpha=wd)
                    ratios = _trust_ratios(torch._foreach_norm(params), torch._foreach_norm(grads))
                    grads = torch._foreach_mul(grads, [r * group["trust_coefficient"] for r in ratios])
                torch._foreach_mul_(bufs, group["momentum"])
                torch._foreach_add_(bufs, grads)
                torch._foreach_add_(params, bufs, alpha=-lr)
                continue
            for p, buf in zip(params, bufs, strict=True):
                grad = p.grad + wd * p if wd else p.grad
                if wd:
                    (ratio,) = _trust_ratios([p.norm()], [grad.norm()])
                    grad = grad * (ratio * group["trust_coefficient"])
                buf.mul_(group["momentum"]).add_(grad)
                p.add_(buf, alpha=-lr)
