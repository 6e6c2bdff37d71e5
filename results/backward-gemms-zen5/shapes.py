"""ViT-S/16 b64's linear-layer GEMMs in bf16, one at a time: forward, input gradient and weight gradient against the
2048^3 bf16 peak, and the ways tried to speed up the weight gradient (not kept). Two threads, glibc's heap kept
(as training runs it). Run from the repository root: python results/backward-gemms-zen5/shapes.py"""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from cpu_kernels import _ms  # noqa: E402 (the CPU kernels' timer: the median of calls after one untimed)

from vitrain.device import cpu_description, reuse_freed_host_memory  # noqa: E402

BF16 = torch.bfloat16
ROWS = 64 * 197  # batch 64, 197 tokens


def chunked(g, x, rows):
    out = torch.mm(g[:rows].t(), x[:rows])
    for i in range(rows, ROWS, rows):
        out.addmm_(g[i : i + rows].t(), x[i : i + rows])
    return out


def backward_weights_primitive(g, x, w):
    dw, db = torch.ops.aten.mkldnn_linear_backward_weights(g.to_mkldnn(), x.to_mkldnn(), w.float(), True)
    return dw.to_dense(), db.to_dense()


def one_layer(k, n, peak):
    x, g = torch.randn(ROWS, k, dtype=BF16), torch.randn(ROWS, n, dtype=BF16)
    w, bias = torch.randn(n, k, dtype=BF16), torch.randn(n, dtype=BF16)
    flops = 2 * ROWS * k * n
    ways = {
        "forward (oneDNN linear, bias in the GEMM)": lambda: torch.ops.mkldnn._linear_pointwise(
            x, w, bias, "none", [], ""
        ),
        "input gradient g @ W": lambda: g @ w,
        "weight gradient g^T @ x": lambda: g.t() @ x,
        "  g^T made contiguous first": lambda: g.t().contiguous() @ x,
        "  in chunks of 2048 rows, accumulated": lambda: chunked(g, x, 2048),
        "  plus the bias gradient (mm + sum)": lambda: (g.t() @ x, g.sum(0)),
        "  oneDNN's backward-weights primitive, bias included": lambda: backward_weights_primitive(g, x, w),
    }
    for name, fn in ways.items():
        print(f"  {name:55s} {flops / (_ms(fn, 10) / 1e3) / peak:.2f}")


def main():
    torch.set_num_threads(2)
    reuse_freed_host_memory()
    print(cpu_description(), f"torch {torch.__version__}, 2 threads")
    a, b = torch.randn(2048, 2048, dtype=BF16), torch.randn(2048, 2048, dtype=BF16)
    peak = max(2 * 2048**3 / (_ms(lambda: a @ b, 10) / 1e3) for _ in range(3))
    print(
        f"bf16 peak {peak / 1e9:.0f} GFLOP/s; each figure: that GEMM's FLOP/s over the peak "
        "(median of 10 after one untimed call)"
    )
    for k, n in [(384, 1152), (384, 384), (384, 1536), (1536, 384)]:
        print(f"in {k} -> out {n}:")
        one_layer(k, n, peak)


if __name__ == "__main__":
    main()
