"""What FSDP2's two collectives cost on gloo (2 CPU processes), against other gloo calls that move the same data.

    python benchmarks/gloo_collectives.py --out results/gloo-collectives/cpu.json

Native zero2/zero3 on a CPU spend their communication in two calls per unit: `reduce_scatter_tensor` of the
gradients (in precision.reduce_dtype, fp32 by default) and `all_gather_into_tensor` of the compute-dtype (bf16)
parameters. For the parameter counts of ViT-Ti/16 and ViT-S/16 (the ladder's models, one unit each as zero2 takes
them) this times, on 2 processes x 1 thread, rounds taking turns after a barrier:
- reduce-scatter (fp32, average) against an in-place all-reduce of the same buffer plus taking this rank's chunk;
- all-gather (bf16) against one broadcast per rank into the same output.
It is a measurement of gloo, for docs/performance.md ("where native zero2 loses"); vitrain's engines call the
collectives PyTorch's FSDP2 calls (no collective of vitrain's own). Median and min-max over the rounds per call, and
the ratio paired round by round.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MODELS = ("vit_tiny_patch16", "vit_small_patch16")


def _params(preset: str) -> int:
    from vitrain.config import load_config
    from vitrain.models.vit import complexity

    shape = ["model.image_size=224", "model.in_chans=3", "model.num_classes=1000", "data.source=synthetic"]
    return complexity(load_config(None, [f"model.preset={preset}", *shape]).model).params


def _time_model(preset: str, rounds: int, rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from vitrain.bench.spread import paired_ratio, spread

    n = _params(preset) // world * world
    grads = torch.randn(n)
    shard = torch.empty(n // world)
    params = torch.empty(n, dtype=torch.bfloat16)
    mine = torch.randn(n // world).to(torch.bfloat16)

    def reduce_scatter() -> None:
        dist.reduce_scatter_tensor(shard, grads, op=dist.ReduceOp.AVG)

    def all_reduce_chunk() -> None:
        dist.all_reduce(grads)
        torch.div(grads.view(world, -1)[rank], world, out=shard)

    def all_gather() -> None:
        dist.all_gather_into_tensor(params, mine)

    def broadcasts() -> None:
        params.view(world, -1)[rank].copy_(mine)
        works = [dist.broadcast(params.view(world, -1)[r], src=r, async_op=True) for r in range(world)]
        for work in works:
            work.wait()

    calls = {
        "reduce_scatter_tensor fp32": reduce_scatter,
        "all_reduce in place + chunk": all_reduce_chunk,
        "all_gather_into_tensor bf16": all_gather,
        "one broadcast per rank": broadcasts,
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    for round_ in range(rounds + 2):  # 2 warm-up rounds
        for name, call in calls.items():
            dist.barrier()
            start = time.perf_counter()
            call()
            seconds = time.perf_counter() - start
            if round_ >= 2:
                times[name].append(seconds * 1e3)
    pairs = {
        "reduce-scatter / all-reduce": ("reduce_scatter_tensor fp32", "all_reduce in place + chunk"),
        "all-gather / broadcasts": ("all_gather_into_tensor bf16", "one broadcast per rank"),
    }
    return {
        "parameters": n,
        "ms": {name: spread(t) for name, t in times.items()},
        "ratio": {k: paired_ratio(times[x], times[y]) for k, (x, y) in pairs.items()},
    }


def worker(rounds: int, out: Path) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {preset: _time_model(preset, rounds, rank, world) for preset in MODELS}
    if rank == 0:
        out.write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="results/gloo-collectives/cpu.json")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = Path(args.out)
    if args.worker:
        worker(args.rounds, out)
        return 0
    from vitrain.bench.spread import format_spread
    from vitrain.device import cpu_description

    out.parent.mkdir(parents=True, exist_ok=True)
    raw = out.with_suffix(".raw.json")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__]
    subprocess.run([*command, "--worker", "--rounds", str(args.rounds), "--out", str(raw)], check=True, env=os.environ)
    results = json.loads(raw.read_text())
    raw.unlink()
    summary = {
        "device": cpu_description(),
        "setup": f"2 processes (torchrun, gloo) x 1 thread, {args.rounds} rounds after 2 warm-up, calls taking turns",
        "command": f"python benchmarks/gloo_collectives.py --out {args.out}",
        "models": results,
    }
    out.write_text(json.dumps(summary, indent=1) + "\n")
    for preset, r in results.items():
        print(f"{preset} ({r['parameters'] / 1e6:.1f}M):")
        for name, figures in r["ms"].items():
            print(f"  {name:30s} {format_spread(figures, digits=1)} ms")
        for name, figures in r["ratio"].items():
            print(f"  {name:30s} {format_spread(figures, unit='x')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
