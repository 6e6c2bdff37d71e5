"""CPU kernels for the models' layers: linear layers whose bias is added inside oneDNN's GEMM, a patch embedding's
conv as one such GEMM over the patches, and manual attention as one autograd function that splits the heads once and
writes their gradients into one buffer.

All compute what the plain layers compute (the linear and the patch GEMM run bf16 only, where aten's addmm is
oneDNN's GEMM as well; attention in fp32 to rounding) and fall back to the plain layers wherever they do not apply:
another device, another dtype, torch.compile, export and tracing.
Measured on a 2-core Zen 4 and a Zen 5 (docs/performance.md: "One process: the ViT-S/16 step against the GEMM peak").
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

if TYPE_CHECKING:
    from vitrain.config import Config


def plain_graph() -> bool:
    """torch.compile, torch.export and the JIT tracer see the plain ops (they fuse and export those)."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


# ----------------------------------------------------------------------------------------------- linear


@functools.cache
def _onednn_linear(dtype: torch.dtype) -> bool:
    """Whether linear layers in `dtype` run oneDNN's linear: bf16, where this CPU build runs oneDNN in bf16 (the
    CPU's AVX-512 or AVX-NE-CONVERT). aten's bf16 addmm is oneDNN's GEMM too, so the values are the same; fp32 stays
    with aten's kernels (oneDNN's fp32 GEMM was faster too, results/cpu-kernels, but rounds differently: an fp32 run's
    values stay those of plain PyTorch, bit for bit)."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return dtype == torch.bfloat16 and supported is not None and bool(supported())


class _BiasInGemm(torch.autograd.Function):
    """y = x W^T + b with the bias added in the GEMM's epilogue (aten's addmm first fills the whole output with the
    bias, then accumulates onto it: one more pass over a tensor of batch x tokens x width). Backward as addmm's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2 if ctx.needs_input_grad[1] else None, weight)  # a frozen weight needs no input
        ctx.in_shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(x2, weight, bias, "none", [], "")
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x2, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        dx = (g2 @ weight).view(ctx.in_shape) if ctx.needs_input_grad[0] else None
        dw = g2.t() @ x2 if ctx.needs_input_grad[1] else None
        db = g2.sum(0) if ctx.needs_input_grad[2] else None
        return dx, dw, db


def _onednn_dtype(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.dtype | None:
    """The dtype a CPU kernel's oneDNN GEMM computes a layer in: under autocast, autocast's (what it would cast all
    three to; it leaves fp64 alone), else the one dtype of the three; None where the plain layer computes instead
    (mixed dtypes, fp64 under autocast, a dtype this CPU's oneDNN build does not run)."""
    dtypes = {x.dtype, weight.dtype} | ({bias.dtype} if bias is not None else set())
    if torch.is_autocast_enabled("cpu"):
        dtype = torch.get_autocast_dtype("cpu")
        if torch.float64 in dtypes:
            return None
    elif len(dtypes) == 1:
        (dtype,) = dtypes
    else:
        return None
    return dtype if _onednn_linear(dtype) else None


class BiasInGemmLinear(nn.Linear):
    """nn.Linear (same parameters, same state dict) whose CPU forward in bf16 adds the bias inside oneDNN's GEMM
    (ViT-S/16's layers at batch 64: results/cpu-kernels). Elsewhere, nn.Linear's forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        dtype = None if bias is None or x.device.type != "cpu" or plain_graph() else _onednn_dtype(x, weight, bias)
        if dtype is None:
            return F.linear(x, weight, bias)
        if not torch.is_autocast_enabled("cpu"):
            return _BiasInGemm.apply(x, weight, bias)
        with torch.autocast("cpu", enabled=False):  # autocast's cast, done here: all three in its dtype
            return _BiasInGemm.apply(x.to(dtype), weight.to(dtype), bias.to(dtype))


def tiles_input(conv: nn.Conv2d) -> bool:
    """Whether `conv` cuts its input into non-overlapping patches and projects each (a ViT's patch embedding): kernel
    equal to stride and larger than one pixel, no padding, dilation or groups. Such a conv is a linear layer over the
    patches."""
    return (
        conv.kernel_size == conv.stride
        and conv.kernel_size != (1, 1)
        and conv.padding in ((0, 0), "valid")
        and conv.dilation == (1, 1)
        and conv.groups == 1
    )


class PatchGemmConv2d(nn.Conv2d):
    """nn.Conv2d that tiles its input (`tiles_input`; same parameters, same state dict) computing, on a CPU in bf16, as
    one GEMM of the image's patches (a reshape and one copy) by the kernel flattened to a matrix, the bias added in
    oneDNN's GEMM: oneDNN's bf16 convolution with 3 input channels and a 16 x 16 kernel took 41 ms forward and
    21 ms backward of a ViT-S/16 step at batch 64 on a Zen 5, for 7.4 GFLOP (docs/performance.md). The output
    is the conv's: (B, C, H', W'), contiguous. Elsewhere, nn.Conv2d's forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if x.device.type != "cpu" or x.dim() != 4 or plain_graph() or not tiles_input(self):
            return super().forward(x)
        if x.shape[2] < self.kernel_size[0] or x.shape[3] < self.kernel_size[1]:
            return super().forward(x)  # no whole patch: the conv's own error
        dtype = _onednn_dtype(x, weight, bias)
        if dtype is None:
            return super().forward(x)
        with torch.autocast("cpu", enabled=False):
            x, weight = x.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
            b, c, h, w = x.shape
            ph, pw = self.kernel_size
            gh, gw = h // ph, w // pw  # the conv's grid: pixels past the last whole patch are left out
            patches = x[:, :, : gh * ph, : gw * pw].reshape(b, c, gh, ph, gw, pw).permute(0, 2, 4, 1, 3, 5)
            patches = patches.reshape(b * gh * gw, c * ph * pw)
            flat = weight.reshape(weight.shape[0], -1)  # (out, c * ph * pw): the kernel's (c, ph, pw) order
            y = _BiasInGemm.apply(patches, flat, bias) if bias is not None else F.linear(patches, flat)
        return y.view(b, gh, gw, weight.shape[0]).permute(0, 3, 1, 2).contiguous()


_PLAIN_CLASS = {BiasInGemmLinear: nn.Linear, PatchGemmConv2d: nn.Conv2d}  # each kernel's class: the layer it stands for


def cpu_kernels(model: nn.Module, cfg: Config, device: torch.device) -> None:
    """What an engine does to a CPU model's layers before precision and parallelism (train.fused_linear)."""
    if device.type == "cpu" and cfg.train.fused_linear and not cfg.train.compile:
        fuse_linear_bias(model, keep=cfg.precision.fp32_modules)


def fuse_linear_bias(model: nn.Module, keep: tuple[str, ...] = ()) -> int:
    """Every plain nn.Linear of `model` (on the CPU, before sharding) computes as a BiasInGemmLinear, and every plain
    nn.Conv2d that tiles its input (a patch embedding) as a PatchGemmConv2d; returns how many. The class is swapped
    in place, so parameters, hooks and state-dict names stay the module's own. `keep`: class names left as they are
    (precision.fp32_modules picks layers by class name, e.g. Linear or Conv2d)."""
    swapped = 0
    for module in model.modules():
        kind = type(module)
        if kind not in (nn.Linear, nn.Conv2d) or kind.__name__ in keep:
            continue
        if module.weight.device.type not in ("cpu", "meta"):
            continue
        if kind is nn.Linear and module.bias is not None:
            module.__class__ = BiasInGemmLinear
        elif kind is nn.Conv2d and tiles_input(module):
            module.__class__ = PatchGemmConv2d
        else:
            continue
        module._swapped_by_vitrain = True  # unfuse_linear_bias gives back these only
        swapped += 1
    return swapped


def unfuse_linear_bias(model: nn.Module) -> int:
    """The layers fuse_linear_bias swapped are plain nn.Linear and nn.Conv2d again (a model handed to the library
    leaves training with the classes it came with); returns how many."""
    swapped = 0
    for module in model.modules():
        plain = _PLAIN_CLASS.get(type(module))
        if plain is not None and module.__dict__.pop("_swapped_by_vitrain", False):
            module.__class__ = plain
            swapped += 1
    return swapped


# -------------------------------------------------------------------------------------------- attention


class _ManualAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(d)) v from the fused QKV projection's output, as `bmm`s (what autotune picks over the
    CPU's flash kernel for bf16). Forward splits the heads in one copy and applies the scale inside the GEMMs
    (baddbmm's alpha), not in a pass of its own; backward writes dq, dk and dv into one buffer and merges it back
    to the projection's layout in one pass (autograd's path: a scale pass, a stack and a copy). ViT-S/16's
    attention at batch 64, bf16: 1.16x (1.09-1.26) the plain ops (results/cpu-kernels-baddbmm)."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, heads: int, seq_first: bool) -> torch.Tensor:
        src = split_heads(qkv, heads, seq_first)  # (3, B, H, N, d), a view
        _, b, _, n, d = src.shape
        scale = d**-0.5
        split = torch.empty(src.shape, dtype=qkv.dtype, device=qkv.device)  # (3, B, H, N, d)
        split.copy_(src)
        q, k, v = (t.view(b * heads, n, d) for t in split.unbind(0))
        scores = torch.empty((b * heads, n, n), dtype=qkv.dtype, device=qkv.device)
        torch.baddbmm(scores, q, k.transpose(1, 2), beta=0, alpha=scale, out=scores)  # the scale in the GEMM
        probs = torch.softmax(scores, dim=-1)
        del scores
        out = torch.bmm(probs, v).view(b, heads, n, d)
        ctx.save_for_backward(q, k, v, probs)
        ctx.dims = (b, n, heads, d, scale, seq_first)
        return merge_heads(out, seq_first)

    @staticmethod
    @once_differentiable  # its backward writes into buffers (out=): no graph of its own for a second derivative
    def backward(ctx, grad: torch.Tensor):
        q, k, v, probs = ctx.saved_tensors
        b, n, heads, d, scale, seq_first = ctx.dims
        if seq_first:
            g = grad.view(n, b, heads, d).permute(1, 2, 0, 3).reshape(b * heads, n, d)
        else:
            g = grad.view(b, n, heads, d).transpose(1, 2).reshape(b * heads, n, d)
        dsplit = torch.empty((3, b * heads, n, d), dtype=grad.dtype, device=grad.device)
        torch.bmm(probs.transpose(1, 2), g, out=dsplit[2])
        dscores = torch._softmax_backward_data(torch.bmm(g, v.transpose(1, 2)), probs, -1, probs.dtype)
        torch.baddbmm(dsplit[0], dscores, k, beta=0, alpha=scale, out=dsplit[0])
        torch.baddbmm(dsplit[1], dscores.transpose(1, 2), q, beta=0, alpha=scale, out=dsplit[1])
        dsplit = dsplit.view(3, b, heads, n, d)
        if seq_first:
            return dsplit.permute(3, 1, 0, 2, 4).reshape(n, b, 3 * heads * d), None, None
        return dsplit.permute(1, 3, 0, 2, 4).reshape(b, n, 3 * heads * d), None, None


def manual_attention(qkv: torch.Tensor, heads: int, seq_first: bool) -> torch.Tensor:
    """Multi-head attention over the fused QKV projection's output ((B, N, 3C), or (N, B, 3C) when `seq_first`,
    q, k, v in that order, each heads x head_dim): the attention's output before its projection, in the input's
    layout. One autograd function when a gradient is wanted (above); the plain ops otherwise."""
    if qkv.device.type == "cpu" and qkv.requires_grad and torch.is_grad_enabled() and not plain_graph():
        device = qkv.device.type
        if not torch.is_autocast_enabled(device):
            return _ManualAttention.apply(qkv, heads, seq_first)
        with torch.autocast(device, enabled=False):  # autocast runs bmm in its dtype: the whole function does
            return _ManualAttention.apply(qkv.to(torch.get_autocast_dtype(device)), heads, seq_first)
    q, k, v = split_heads(qkv, heads, seq_first).unbind(0)
    return merge_heads(((q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)).softmax(dim=-1) @ v, seq_first)


def split_heads(qkv: torch.Tensor, heads: int, seq_first: bool) -> torch.Tensor:
    """The fused QKV projection's output ((B, N, 3C), or (N, B, 3C) when `seq_first`) as (3, B, heads, N, head_dim):
    q, k and v split into heads, a view where the input allows it."""
    if seq_first:
        n, b, _ = qkv.shape
        return qkv.reshape(n, b, 3, heads, -1).permute(2, 1, 3, 0, 4)
    b, n, _ = qkv.shape
    return qkv.reshape(b, n, 3, heads, -1).permute(2, 0, 3, 1, 4)


def merge_heads(out: torch.Tensor, seq_first: bool) -> torch.Tensor:
    """Attention's (B, heads, N, head_dim) output back in the layer's layout: (B, N, C), or (N, B, C)."""
    b, heads, n, d = out.shape
    if seq_first:
        return out.permute(2, 0, 1, 3).reshape(n, b, heads * d)
    return out.transpose(1, 2).reshape(b, n, heads * d)
