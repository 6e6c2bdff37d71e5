"""Measure per-rank peak memory of ViT training under each strategy (2 gloo ranks on CPU) against `vitrain estimate`.

Run under the timing lock so no other job disturbs the figures:

    flock /tmp/vitrain-timing.lock python benchmarks/memory_per_rank.py --preset ViT-B/16 --strategies ddp zero3

Each rank reports its peak anonymous memory during training steps after a warm-up step (VmHWM minus file-backed
pages, so library code a step faults in is not counted) minus the same figure just before the model was built:
the model states plus activations and transient buffers. glibc is told to serve every
allocation above 64 KiB with mmap (MALLOC_MMAP_THRESHOLD_), so freed tensors leave the resident set at once and
the figure is the live-tensor peak, not allocator caching. The model is built whole and then sharded, so the peak
counter is reset after construction (writing 5 to /proc/self/clear_refs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO)]  # tests/distributed_helpers.py imports tests.conftest


def _rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} missing from /proc/self/status")


def _rank_job(rank: int, port: int, args: argparse.Namespace, strategy: str, out: str) -> None:
    from distributed_helpers import torchrun_env

    os.environ.update(torchrun_env(rank, port))
    import torch

    from vitrain.config import load_config
    from vitrain.engine import Trainer
    from vitrain.parallel import shutdown

    torch.set_num_threads(1)
    cfg = load_config(
        base={
            "name": f"mem-{strategy}",
            "model": {"preset": args.preset, "num_classes": 1000, "attention": "sdpa"},
            "data": {"source": "synthetic", "synthetic_samples": 40},
            # freed host memory must leave the resident set (the mmap threshold below), which the heap that
            # train.reuse_host_memory keeps for reuse would not; fp32 and sdpa: what the estimate models
            "train": {"batch_size": args.batch, "threads": 1, "epochs": 1, "reuse_host_memory": False},
            "precision": {"mode": "fp32"},
            "parallel": {
                "strategy": strategy,
                "activation_checkpointing": "block" if args.ac else "none",
                "wrap": args.wrap,
                "backward_prefetch": args.prefetch,
            },
            "log": {"out_dir": args.out_dir, "progress": False},
        }
    )
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    torch.distributed.barrier()
    anon_base = _rss_bytes("VmRSS") - _rss_bytes("RssFile")
    trainer = Trainer(cfg)
    built = _rss_bytes("VmRSS") - _rss_bytes("RssFile") - anon_base
    step_s, phase_peaks = [], {"forward": 0, "backward": 0, "optimizer": 0}

    def phase_done(name: str, counted: bool) -> None:
        # Peak anonymous memory of the phase: the resident peak minus file-backed pages (library code that a
        # step faults in is not model memory); the counter restarts so the report says where the peak is.
        anon_peak = _rss_bytes("VmHWM") - _rss_bytes("RssFile") - anon_base
        if counted:
            phase_peaks[name] = max(phase_peaks[name], anon_peak)
        Path("/proc/self/clear_refs").write_text("5")

    class PhaseMarks:
        """The step's phase marks (the PhaseTimer interface): each records the peak of the phase that ended."""

        def __init__(self, counted: bool):
            self.counted = counted

        def start(self) -> None:
            pass

        def lap(self, phase: str) -> None:
            if phase in phase_peaks:
                phase_done(phase, self.counted)
            else:  # the data phase: not model memory
                Path("/proc/self/clear_refs").write_text("5")

    Path("/proc/self/clear_refs").write_text("5")  # the model was built whole: count from after sharding
    for batch in trainer.train_loader.epoch(0):
        start = time.perf_counter()
        counted = len(step_s) > 0  # the first step is a warm-up: it faults in code and sets up buffers
        trainer.train_step([batch], cfg.optim.lr, PhaseMarks(counted))  # the trainer's own step, marked by phase
        step_s.append(time.perf_counter() - start)
        if len(step_s) == args.steps:
            break
    result = {
        "rank": rank,
        "strategy": strategy,
        "peak_bytes": max(phase_peaks.values()),
        "phase_peak_bytes": phase_peaks,
        "after_build_bytes": built,
        "step_s": step_s,
    }
    Path(out).with_suffix(f".rank{rank}.json").write_text(json.dumps(result))
    shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="ViT-B/16")
    parser.add_argument("--strategies", nargs="+", default=["ddp", "zero3"])
    parser.add_argument("--batch", type=int, default=1, help="images per rank per step")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-ac", dest="ac", action="store_false", help="store all activations")
    parser.add_argument("--wrap", default="block", choices=["block", "sublayer", "model"], help="FSDP units")
    parser.add_argument("--no-prefetch", dest="prefetch", action="store_false", help="backward_prefetch=false")
    parser.add_argument("--out-dir", default="/tmp/vitrain-memory-bench")
    parser.add_argument("--results", default=str(REPO / "results" / "memory_per_rank.json"))
    args = parser.parse_args()

    from distributed_helpers import free_port

    from vitrain.config import load_config
    from vitrain.models.memory import estimate

    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks
    model_cfg = load_config(base={"model": {"preset": args.preset}}).model
    rows = []
    for strategy in args.strategies:
        out = Path(args.out_dir) / f"{strategy}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        mp.spawn(_rank_job, args=(free_port(), args, strategy, str(out)), nprocs=2, join=True)
        ranks = [json.loads(out.with_suffix(f".rank{r}.json").read_text()) for r in range(2)]
        measured = max(r["peak_bytes"] for r in ranks)
        est = estimate(model_cfg, 2, strategy, wrap=args.wrap, ac=args.ac, batch=args.batch, prefetch=args.prefetch)
        rows.append(
            {
                "strategy": strategy,
                "measured_peak_bytes": measured,
                "estimate_bytes": est.total,
                "estimate": est.as_dict(),
                "error": est.total / measured - 1,
                "step_s": ranks[0]["step_s"],
                "ranks": ranks,
            }
        )
        print(
            f"{strategy:<6} measured peak/rank {measured / 2**20:8.1f} MiB   estimate {est.total / 2**20:8.1f} MiB"
            f"   estimate/measured - 1 = {est.total / measured - 1:+.1%}",
            flush=True,
        )
    by_name = {r["strategy"]: r for r in rows}
    if "ddp" in by_name and "zero3" in by_name:
        ratio = by_name["zero3"]["measured_peak_bytes"] / by_name["ddp"]["measured_peak_bytes"]
        print(f"zero3 / ddp measured per-rank peak: {ratio:.3f}")
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(
        json.dumps(
            {"preset": args.preset, "batch_per_rank": args.batch, "ac": args.ac, "wrap": args.wrap, "rows": rows},
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
