"""The attention backward's products whose first operand is transposed (dk = dS^T q, dv = P^T g) against the same
product untransposed and against materializing the transpose first; ViT-S/16 shapes at batch 64, bf16, 2 threads.

    python results/attention-chunks-zen5/transposed_operands.py
"""

import sys
from pathlib import Path

import torch

from vitrain.device import reuse_freed_host_memory

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from cpu_kernels import _ms  # noqa: E402 (the CPU kernels' timer: the median of calls after one untimed)

reuse_freed_host_memory()
torch.set_num_threads(2)
BH, N, d = 384, 197, 64
q = torch.randn(BH, N, d).bfloat16()
ds = torch.randn(BH, N, N).bfloat16()


o = torch.empty(BH, N, d, dtype=torch.bfloat16)
oT = torch.empty(BH, d, N, dtype=torch.bfloat16)
ref = torch.bmm(ds.transpose(1, 2), q)
alt = torch.bmm(q.transpose(1, 2), ds).transpose(1, 2)
print("same:", torch.equal(ref, alt), (ref.float() - alt.float()).abs().max().item())
for _r in range(3):
    a = _ms(lambda: torch.bmm(ds.transpose(1, 2), q, out=o), 9)
    b = _ms(lambda: torch.bmm(q.transpose(1, 2), ds, out=oT), 9)
    c = _ms(lambda: torch.bmm(ds.transpose(1, 2).contiguous(), q, out=o), 9)
    e = _ms(lambda: torch.bmm(ds, q, out=o), 9)
    print(f"dsT@q {a:.2f} | qT@ds {b:.2f} | contig(dsT)@q {c:.2f} | ds@q {e:.2f}")
