"""One LayerNorm's forward + backward on bf16 activations, alone, in the three ways a ViT step can run it: aten's bf16
norm (bf16 weights: what DeepSpeed's bf16 mode runs), amp_o2's fp32 norm as `precision.compile_norms` compiles it
(fp32 weights, upcast, norm and downcast in one kernel each way), and aten's mixed-dtype norm (bf16 input, fp32
weights). Shapes: ViT-Ti/16 and ViT-S/16 at batch 16 (the ladder's per-process batch) and ViT-S/16 at batch 64 (the
peers' step). Median of 15 calls after an untimed one (benchmarks/cpu_kernels.py's timer), three rounds.

    python results/norms-alone-zen5/norms.py THREADS
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from cpu_kernels import _ms  # noqa: E402

from vitrain.device import reuse_freed_host_memory  # noqa: E402
from vitrain.precision import fp32_between  # noqa: E402


class MixedLayerNorm(nn.LayerNorm):
    """fp32 weights applied by aten's own kernel to a bf16 input (its output bf16)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


def forward_backward(norm: nn.Module, x: torch.Tensor, grad: torch.Tensor):
    def step() -> None:
        x.grad = None
        for p in norm.parameters():
            p.grad = None
        norm(x).backward(grad)

    return step


reuse_freed_host_memory()
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
bf16 = torch.bfloat16
for name, rows, width in [
    ("ViT-Ti/16 b16", 16 * 197, 192),
    ("ViT-S/16 b16", 16 * 197, 384),
    ("ViT-S/16 b64", 64 * 197, 384),
]:
    x = torch.randn(rows, width, dtype=bf16, requires_grad=True)
    grad = torch.randn(rows, width, dtype=bf16)
    compiled = nn.LayerNorm(width)
    fp32_between(compiled, bf16, compile_norms=True)
    norms = {"aten bf16": nn.LayerNorm(width).to(bf16), "compiled fp32": compiled, "aten mixed": MixedLayerNorm(width)}
    for _ in range(3):
        times = {label: _ms(forward_backward(norm, x, grad), 15) for label, norm in norms.items()}
        line = " | ".join(f"{label} {ms:.3f} ms" for label, ms in times.items())
        print(f"{torch.get_num_threads()} thread(s), {name} ({rows} x {width}): {line}")
