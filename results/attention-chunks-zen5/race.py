"""Manual attention (ViT-S/16 shapes, batch 64, bf16) forward + backward: vitrain's one-pass function against the
chunked experiment (chunked-attention.patch: 8 samples at a time), rounds taking turns, each the median of 7 calls.

    python results/attention-chunks-zen5/race.py [--reuse]

--reuse: freed host memory stays in the heap (train.reuse_host_memory, what training runs with)."""

import argparse
import sys
import time
from pathlib import Path

import torch

from vitrain.device import reuse_freed_host_memory
from vitrain.models.kernels import _ManualAttention

parser = argparse.ArgumentParser()
parser.add_argument("--reuse", action="store_true")
parser.add_argument("--rounds", type=int, default=5)
args = parser.parse_args()
if args.reuse:
    reuse_freed_host_memory()
torch.set_num_threads(2)
torch.manual_seed(0)
B, N, H, D = 64, 197, 6, 64

sys.path.insert(0, str(Path(__file__).parent))
import chunked  # noqa: E402

chunked.samples_per_chunk = lambda *a: 8  # 8 samples per chunk: 3.7 MB of scores
Chunked = chunked._ManualAttention

qkv0 = torch.randn(B, N, 3 * H * D).bfloat16()
g0 = torch.randn(B, N, H * D).bfloat16()


def run(fn):
    qkv = qkv0.clone().requires_grad_()
    y = fn.apply(qkv, H, False)
    y.backward(g0)
    return y, qkv.grad


same = [torch.equal(a, b) for a, b in zip(run(_ManualAttention), run(Chunked), strict=False)]
print(f"bit-equal output and gradient: {same}; host memory reuse: {args.reuse}")
times = {"one pass": [], "chunks": []}
for _ in range(args.rounds):
    for name, fn in (("one pass", _ManualAttention), ("chunks", Chunked)):
        ts = []
        for _ in range(7):
            t = time.perf_counter()
            run(fn)
            ts.append(time.perf_counter() - t)
        times[name].append(sorted(ts)[3] * 1e3)
ratios = sorted(a / b for a, b in zip(times["one pass"], times["chunks"], strict=False))
for name, t in times.items():
    print(f"{name}: {sorted(t)[len(t) // 2]:.1f} ms (min {min(t):.1f}, max {max(t):.1f})")
print(f"chunks' speedup, paired by round: {ratios[len(ratios) // 2]:.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})")
