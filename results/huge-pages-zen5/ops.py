"""ViT-S/16's elementwise ops and two of its GEMMs (batch 64, bf16, 2 threads) in one process, timed as
benchmarks/cpu_kernels.py times (median of 9 calls after an untimed one), with the share of the process's memory
in transparent huge pages. Run it with and without a setting that asks for them (see README.md):

    python results/huge-pages-zen5/ops.py
    GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python results/huge-pages-zen5/ops.py
    THP_MEM_ALLOC_ENABLE=1 python results/huge-pages-zen5/ops.py
"""

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from cpu_kernels import _ms  # noqa: E402

from vitrain.device import reuse_freed_host_memory  # noqa: E402

reuse_freed_host_memory()
torch.set_num_threads(2)
bf = torch.bfloat16
x = torch.randn(64 * 197, 1536, dtype=bf)  # fc1's output
g = torch.randn_like(x)
probs = torch.randn(64 * 6, 197, 197, dtype=bf)
a = torch.randn(64 * 197, 384, dtype=bf)
w = torch.randn(1536, 384, dtype=bf)
qkv = torch.randn(64, 197, 3, 6, 64, dtype=bf)
ops = {
    "gelu": lambda: F.gelu(x),
    "gelu_backward": lambda: torch.ops.aten.gelu_backward(g, x),
    "softmax": lambda: torch.softmax(probs, -1),
    "heads split copy": lambda: qkv.permute(2, 0, 3, 1, 4).contiguous(),
    "fc1 GEMM": lambda: a @ w.t(),
    "fc1 weight-gradient GEMM": lambda: x.t() @ a,
}
times = " | ".join(f"{name} {_ms(fn, 9):.2f} ms" for name, fn in ops.items())
huge = next(int(line.split()[1]) for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages"))
setting = next((f"{k}={os.environ[k]}" for k in ("GLIBC_TUNABLES", "THP_MEM_ALLOC_ENABLE") if k in os.environ), "none")
print(f"{setting}: {times} | huge pages {huge / 2**10:.0f} MiB")
