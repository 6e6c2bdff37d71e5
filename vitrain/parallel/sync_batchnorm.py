"""BatchNorm whose batch statistics span every data-parallel rank, so a model with BatchNorm trains alike on any
number of ranks (torch's SyncBatchNorm on accelerators; on CPU, where SyncBatchNorm does not run, our own)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) whose backward all-reduces the gradient: each rank's use of the sum reaches every input."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        total = x.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class CpuSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """SyncBatchNorm's arithmetic with gloo: the mean and the variance of the whole global batch.

    The statistics are all-reduced with autograd-aware all-reduces, so the backward pass carries each rank's share
    of the gradient through them to every rank, as torch's SyncBatchNorm does. Parameter and buffer names are
    BatchNorm's: checkpoints and exported weights do not change.
    """

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2-D input, got {x.dim()}-D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or not (dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)
        out_dtype, x = x.dtype, x.float()  # statistics in fp32 (autocast hands a bf16 Linear output in), as torch's
        dims = [d for d in range(x.dim()) if d != 1]  # every dimension but the channels
        count = x.new_tensor([x.numel() / x.shape[1]])
        totals = _SumOverRanks.apply(torch.cat([x.sum(dim=dims), count]))
        n = totals[-1]
        mean = totals[:-1] / n
        shape = [1, -1] + [1] * (x.dim() - 2)
        centred = x - mean.view(shape)
        var = _SumOverRanks.apply((centred * centred).sum(dim=dims)) / n
        with torch.no_grad():
            self.num_batches_tracked += 1
            momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
            self.running_mean.lerp_(mean.detach(), momentum)
            self.running_var.lerp_(var.detach() * n / (n - 1).clamp_min(1), momentum)
        out = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            out = out * self.weight.float().view(shape) + self.bias.float().view(shape)
        return out.to(out_dtype)


def sync_batchnorm(model: nn.Module, device: torch.device) -> nn.Module:
    """Make every BatchNorm of `model` its cross-rank version, in place.

    Only the class changes: parameters, buffers and hooks stay, so an amp_o2 working copy's norms keep sharing the
    fp32 master's parameters and running statistics.
    """
    synced = nn.SyncBatchNorm if device.type == "cuda" else CpuSyncBatchNorm
    for module in model.modules():
        # A BatchNorm without running statistics is left as it is (it normalizes each rank's own batch).
        is_norm = isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats
        if is_norm and not isinstance(module, synced):
            module.__class__ = synced
            if synced is nn.SyncBatchNorm:
                module.process_group = None  # the default group, as SyncBatchNorm.convert_sync_batchnorm sets
    return model
