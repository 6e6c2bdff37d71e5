"""The CPU kernels (vitrain/models/kernels.py) compute what the plain layers compute, and are applied where they
should be: a linear layer with its bias inside the GEMM, manual attention as one autograd function."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from tests.conftest import TINY_MODEL, graph_names
from vitrain.config import Config
from vitrain.models import kernels
from vitrain.models.kernels import (
    BiasInGemmLinear,
    PatchGemmConv2d,
    cpu_kernels,
    fuse_linear_bias,
    manual_attention,
    tiles_input,
    unfuse_linear_bias,
)
from vitrain.models.vit import VisionTransformer


def _plain_attention(qkv: torch.Tensor, heads: int, seq_first: bool, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(kernels, "plain_graph", lambda: True)  # what torch.compile and export see
        return manual_attention(qkv, heads, seq_first)


@pytest.mark.parametrize("seq_first", [False, True])
def test_manual_attention_function_has_the_plain_ops_gradients(seq_first: bool, monkeypatch: pytest.MonkeyPatch):
    torch.manual_seed(0)
    qkv = torch.randn(3, 5, 3 * 2 * 4, dtype=torch.float64, requires_grad=True)  # 2 heads of 4
    assert torch.autograd.gradcheck(lambda x: manual_attention(x, 2, seq_first), (qkv,))
    # The autograd function and the plain ops agree, values and gradients (float64: to rounding).
    grad = torch.randn(3, 5, 8, dtype=torch.float64)
    fused = manual_attention(qkv, 2, seq_first)
    (fused_grad,) = torch.autograd.grad(fused, qkv, grad)
    plain = _plain_attention(qkv, 2, seq_first, monkeypatch)
    (plain_grad,) = torch.autograd.grad(plain, qkv, grad)
    assert fused.grad_fn.name().endswith("_ManualAttentionBackward") and plain.grad_fn.name() != fused.grad_fn.name()
    torch.testing.assert_close(fused, plain, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fused_grad, plain_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seq_first", [False, True])
def test_manual_attention_in_bf16_matches_the_plain_ops(seq_first: bool, monkeypatch: pytest.MonkeyPatch):
    """Under autocast (amp_o1) and on bf16 activations (amp_o2): the bf16 values of autograd over the plain ops, the
    scale applied inside the score GEMM included (within bf16 rounding: CPUs' bf16 bmm may sum in another order)."""
    torch.manual_seed(1)
    x = torch.randn(4, 9, 3 * 3 * 16)  # 3 heads of 16
    grad = torch.randn(4, 9, 48).bfloat16()
    for autocast, dtype in ((True, torch.float32), (False, torch.bfloat16)):
        results = []
        for plain in (False, True):
            qkv = x.to(dtype).clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                inputs = qkv * 1.0  # a non-leaf, like the projection's output
                if plain:
                    out = _plain_attention(inputs, 3, seq_first, monkeypatch)
                else:
                    out = manual_attention(inputs, 3, seq_first)
            out.backward(grad.to(out.dtype))
            results.append((out, qkv.grad))
        (out, dqkv), (ref, dref) = results
        assert out.dtype == ref.dtype == torch.bfloat16
        # bf16 tolerances: the CPU kinds' bf16 bmm kernels sum in layout-dependent orders (one ulp apart)
        torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(dqkv, dref, rtol=1.6e-2, atol=1e-2)


def test_bias_in_gemm_function_has_addmms_values_and_gradients():
    """The function itself, in fp32 (oneDNN runs fp32 on every x86 CPU): forward and backward as F.linear's."""
    torch.manual_seed(2)
    x, w, b = torch.randn(3, 7, 24), torch.randn(40, 24), torch.randn(40)
    grad = torch.randn(3, 7, 40)
    got, want = [], []
    for fn, out in ((kernels._BiasInGemm.apply, got), (torch.nn.functional.linear, want)):
        inputs = [t.clone().requires_grad_() for t in (x, w, b)]
        y = fn(*inputs)
        y.backward(grad)
        out += [y, *(t.grad for t in inputs)]
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    # a frozen weight: the input is not kept for its gradient, the others come out as before
    frozen = [x.clone().requires_grad_(), w, b.clone().requires_grad_()]
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.shape) or t, lambda t: t):
        y = kernels._BiasInGemm.apply(*frozen)
    assert kept == [w.shape]  # the weight only (dx needs it); no copy of the input
    y.backward(grad)
    torch.testing.assert_close(frozen[0].grad, got[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(frozen[2].grad, got[3], rtol=1e-5, atol=1e-5)


def _computes_as_the_plain_layer(fused: nn.Module, plain: nn.Module, x: torch.Tensor, loss, bf16: dict) -> list:
    """`fused` (a CPU kernel's class) against `plain` on `x`: the output and the input, weight and bias gradients of
    `loss`. fp32 keeps aten's kernels (bit-equal); bf16 autocast (amp_o1) or bf16 weights (amp_o2) run oneDNN's GEMM
    with the bias in it where this CPU has it, within `bf16`'s tolerance. Returns `fused`'s outputs."""
    outputs = []
    for autocast, dtype, tol in (
        (False, torch.float32, dict(rtol=0, atol=0)),
        (True, torch.float32, bf16),
        (False, torch.bfloat16, bf16),
    ):
        outs = []
        for layer in (fused, plain):
            layer = copy.deepcopy(layer).to(dtype)
            xin = x.to(dtype).detach().clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = layer(xin)
            loss(y).backward()
            outs.append((y, xin.grad, layer.weight.grad, layer.bias.grad, graph_names(y)))
        (*new, name), (*ref, ref_name) = outs
        for a, e in zip(new, ref, strict=True):
            assert a.dtype == e.dtype
            torch.testing.assert_close(a, e, **tol)
        runs_onednn = dtype == torch.bfloat16 or autocast
        assert ("_BiasInGemmBackward" in name) == (runs_onednn and kernels._onednn_linear(torch.bfloat16))
        assert "_BiasInGemmBackward" not in ref_name
        outputs.append(new[0])
    return outputs


def test_bias_in_gemm_linear_computes_as_nn_linear():
    torch.manual_seed(3)
    plain = nn.Linear(24, 40)
    fused = copy.deepcopy(plain)
    assert fuse_linear_bias(fused) == 1 and type(fused) is BiasInGemmLinear
    assert list(fused.state_dict()) == ["weight", "bias"]
    x = torch.randn(3, 7, 24)
    _computes_as_the_plain_layer(fused, plain, x, lambda y: y.float().square().sum(), dict(rtol=1e-2, atol=1e-2))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast computes fp64 in fp64, and so does the layer
        assert copy.deepcopy(fused).double()(x.double()).dtype == torch.float64


def test_patch_gemm_conv_computes_as_nn_conv2d():
    """A conv that tiles its input, as one GEMM over the patches: nn.Conv2d's values and gradients (bf16: within its
    rounding; fp32 keeps the conv), an input whose sides are not whole patches included (the conv leaves out the
    pixels past the last whole patch)."""
    torch.manual_seed(4)
    plain = nn.Conv2d(3, 16, kernel_size=(4, 2), stride=(4, 2))
    assert tiles_input(plain)
    assert not any(tiles_input(c) for c in (nn.Conv2d(3, 8, 3), nn.Conv2d(3, 8, 4, 4, padding=1), nn.Conv2d(3, 8, 1)))
    fused = copy.deepcopy(plain)
    assert fuse_linear_bias(fused) == 1 and type(fused) is PatchGemmConv2d
    x = torch.randn(2, 3, 13, 10)  # 3 x 5 whole patches, one row of pixels left out
    loss = lambda y: (y.float().square() * torch.linspace(0, 1, y.numel()).view(y.shape)).sum()  # noqa: E731
    outputs = _computes_as_the_plain_layer(fused, plain, x, loss, dict(rtol=1e-2, atol=2e-2))
    assert all(y.shape == (2, 16, 3, 5) and y.is_contiguous() for y in outputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # no image: the conv's empty output
        assert fused(torch.randn(0, 3, 13, 10)).shape == (0, 16, 3, 5)
    fused.stride = (2, 2)  # no longer tiling (overlapping patches): the conv itself
    with torch.autocast("cpu", dtype=torch.bfloat16):
        names = graph_names(fused(x.clone().requires_grad_()))
    assert not tiles_input(fused) and "_BiasInGemmBackward" not in names and "ConvolutionBackward0" in names
    assert unfuse_linear_bias(fused) == 1 and type(fused) is nn.Conv2d
    # a class named in precision.fp32_modules keeps its own class (precision picks it by that name)
    model = nn.Sequential(copy.deepcopy(plain), nn.Linear(4, 4))
    assert fuse_linear_bias(model, keep=("Conv2d",)) == 1 and [type(m) for m in model] == [nn.Conv2d, BiasInGemmLinear]


def test_cpu_kernels_follow_the_switch(tmp_path):
    cfg = Config()
    model_cfg = dataclasses.replace(TINY_MODEL, attention="manual")
    linears = lambda m: [type(x) for x in m.modules() if isinstance(x, nn.Linear)]  # noqa: E731
    on = VisionTransformer(model_cfg)
    cpu_kernels(on, cfg, torch.device("cpu"))
    assert set(linears(on)) == {BiasInGemmLinear} and type(on.patch_embed.proj) is PatchGemmConv2d
    for changed in (dict(fused_linear=False), dict(compile=True)):
        off = VisionTransformer(model_cfg)
        cpu_kernels(off, dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **changed)), torch.device("cpu"))
        assert set(linears(off)) == {nn.Linear} and type(off.patch_embed.proj) is nn.Conv2d
    # A whole model's training step: the same loss and gradients as the plain layers (fp32: to rounding).
    plain = VisionTransformer(model_cfg)
    plain.load_state_dict(on.state_dict())
    images = torch.randn(2, TINY_MODEL.in_chans, TINY_MODEL.image_size, TINY_MODEL.image_size)
    grads = []
    for model in (on, plain):
        model.zero_grad()
        model(images).logsumexp(-1).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(g, grads[1][name], rtol=1e-4, atol=1e-5, msg=name)
