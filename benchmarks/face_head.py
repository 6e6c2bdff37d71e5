"""Measure the many-identity face head's step time and per-rank peak memory: replicated, sharded, sharded + sampled.

Run under the timing lock so no other job disturbs the figures:

    flock /tmp/vitrain-timing.lock python benchmarks/face_head.py --identities 500000

Two gloo ranks on CPU (`--threads` each) train only the identity head (`vitrain.parallel.identity_head`), CosFace
(s=64, m=0.35), AdamW (lr 0.1): each step scores random embeddings (a stand-in for the backbone, `--batch` per rank)
with random labels, backpropagates and steps the head's optimizer. The variants:

- replicated: every rank holds all centres and scores its own batch; the gradient is averaged over the ranks, as
  plain data parallelism would;
- sharded: each rank holds half of the centres and scores the global batch against them (sample rate 1.0);
- sharded_sampled: the same, scoring the batch's identities plus a random 10% of the other centres (Partial FC).

Each variant runs in its own fresh pair of processes, so that no peak carries over from another. A rank's peak is its
peak resident set (getrusage's ru_maxrss), reported as is and as the increase over the resident set just before the
head was built (the head's weights, gradient, optimizer state and the step's transient tensors). glibc serves every
allocation above 64 KiB with mmap (MALLOC_MMAP_THRESHOLD_), so freed tensors leave the resident set at once. Step
time is the median over the timed steps (each starts after a barrier), the slower rank's.

The two acceptance ratios: the sharded head's per-rank increase at most 0.6x the replicated head's, and the sampled
head's (r = 0.1) step at least 2x faster than the sharded head's at r = 1.0.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vitrain.config import OptimConfig
from vitrain.device import cpu_description
from vitrain.models.heads import Margin
from vitrain.optim.optimizers import build_head_optimizer
from vitrain.parallel.identity_head import IdentityHead, average_replicated_gradients

REPO = Path(__file__).resolve().parent.parent
WORLD_SIZE = 2
VARIANTS = {  # name: (sharded, sample_rate)
    "replicated": (False, 1.0),
    "sharded": (True, 1.0),
    "sharded_sampled": (True, 0.1),
}
MAX_MEMORY_RATIO = 0.6  # sharded / replicated per-rank peak increase
MIN_SPEEDUP = 2.0  # sharded (r = 1.0) / sharded_sampled (r = 0.1) median step time


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS missing from /proc/self/status")


def _rank_job(rank: int, port: int, args: argparse.Namespace, variant: str, out: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    dist.barrier()
    sharded, sample_rate = VARIANTS[variant]
    baseline_bytes = _rss_bytes()
    peak_before_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    head = IdentityHead(args.identities, args.embed_dim, Margin("cosface", 64.0, m3=0.35), sample_rate, sharded)
    optimizer = build_head_optimizer(head, OptimConfig(name="adamw", lr=0.1), torch.device("cpu"))
    torch.manual_seed(rank)  # the sampled head draws its centres from torch's global RNG, as the trainer seeds it
    # The data has its own generator: every variant sees the same embeddings and labels.
    data = torch.Generator().manual_seed(rank)
    step_s = []
    for step in range(args.warmup + args.steps):
        embeddings = torch.randn(args.batch, args.embed_dim, generator=data).requires_grad_()
        labels = torch.randint(0, args.identities, (args.batch,), generator=data)
        dist.barrier()
        start = time.perf_counter()
        loss = head(embeddings, labels)
        loss.backward()
        average_replicated_gradients(head)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= args.warmup:
            step_s.append(time.perf_counter() - start)
    peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    result = {
        "rank": rank,
        "rows": head.rows,
        "step_s": step_s,
        "median_step_s": statistics.median(step_s),
        "baseline_rss_bytes": baseline_bytes,
        "peak_rss_before_head_bytes": peak_before_bytes,
        "peak_rss_bytes": peak_bytes,
        "rss_increase_bytes": peak_bytes - baseline_bytes,
        "last_loss": loss.item(),
    }
    Path(out).with_suffix(f".rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_variant(variant: str, args: argparse.Namespace, work_dir: Path) -> dict:
    """One variant in a fresh pair of processes: the slower rank's median step, the larger per-rank peaks."""
    out = work_dir / f"{variant}.json"
    mp.spawn(_rank_job, args=(_free_port(), args, variant, str(out)), nprocs=WORLD_SIZE, join=True)
    ranks = [json.loads(out.with_suffix(f".rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    sharded, sample_rate = VARIANTS[variant]
    return {
        "sharded": sharded,
        "sample_rate": sample_rate,
        "median_step_s": max(r["median_step_s"] for r in ranks),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
        "rss_increase_bytes": max(r["rss_increase_bytes"] for r in ranks),
        "rows_per_rank": [r["rows"] for r in ranks],
        # The mean of the ranks' losses is the global batch's loss (a sharded head's is the same on every rank).
        "last_loss": statistics.fmean(r["last_loss"] for r in ranks),
        "ranks": ranks,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--identities", type=int, default=500_000)
    parser.add_argument("--embed-dim", type=int, default=512)
    parser.add_argument("--batch", type=int, default=128, help="embeddings per rank per step")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--out", default=str(REPO / "results" / "face_head.json"))
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)

    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks
    variants = {}
    print(f"{'variant':<16} {'rows/rank':>10} {'median s':>9} {'peak MiB':>9} {'+MiB':>9} {'last loss':>10}")
    with tempfile.TemporaryDirectory() as work_dir:
        for name in VARIANTS:
            row = variants[name] = run_variant(name, args, Path(work_dir))
            print(
                f"{name:<16} {max(row['rows_per_rank']):>10} {row['median_step_s']:>9.3f}"
                f" {row['peak_rss_bytes'] / 2**20:>9.1f} {row['rss_increase_bytes'] / 2**20:>9.1f}"
                f" {row['last_loss']:>10.4f}",
                flush=True,
            )
    memory_ratio = variants["sharded"]["rss_increase_bytes"] / variants["replicated"]["rss_increase_bytes"]
    speedup = variants["sharded"]["median_step_s"] / variants["sharded_sampled"]["median_step_s"]
    memory_ok, speed_ok = memory_ratio <= MAX_MEMORY_RATIO, speedup >= MIN_SPEEDUP
    print(
        f"sharded / replicated per-rank peak increase: {memory_ratio:.3f} "
        f"({'pass' if memory_ok else 'FAIL'}: <= {MAX_MEMORY_RATIO})"
    )
    print(f"r = 1.0 / r = 0.1 median step time: {speedup:.2f}x ({'pass' if speed_ok else 'FAIL'}: >= {MIN_SPEEDUP})")
    result = {
        "command": shlex.join(["python", "benchmarks/face_head.py", *argv]),
        "cpu": cpu_description(),
        "torch": torch.__version__,
        "threads_per_rank": args.threads,
        "identities": args.identities,
        "embed_dim": args.embed_dim,
        "batch_per_rank": args.batch,
        "world_size": WORLD_SIZE,
        "steps": args.steps,
        "warmup": args.warmup,
        "margin": "cosface s=64 m=0.35",
        "optimizer": "adamw lr=0.1",
        "variants": variants,
        "sharded_over_replicated_peak_increase": memory_ratio,
        "sharded_peak_at_most_0.6x_replicated": memory_ok,
        "sampled_speedup": speedup,
        "sampled_at_least_2x_faster": speed_ok,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
