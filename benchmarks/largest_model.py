"""The largest ViT that trains 3 steps within a per-process memory budget, per strategy, beside `vitrain estimate`.

    python benchmarks/largest_model.py --processes 4 --budget-gib 5     # about an hour on 2 cores; needs 21 GiB free

Models come from one family on the presets' proportions (`vitrain.models.memory.ladder`: width, depth and MLP ratio
interpolated between consecutive presets, 16 steps between two presets), so "larger" means deeper and wider
together, as the presets grow. For each row the search starts at the model `vitrain estimate` predicts to be the
largest that fits, steps up or down until it has a fitting and a failing model, then bisects between them. Each probe
is a fresh set of processes (gloo, one thread each) that builds the model through the real `Trainer` and runs 3
training steps on synthetic 32x32 images (2 tokens of 16x16 patches plus the class token), without checkpoints.

A probe fits when it completes and every process's peak resident set (VmHWM: the whole process, the interpreter,
torch and the model's build included) stays under the budget. A watchdog polls every process's resident set and
kills the probe the moment one passes the budget, so that no probe takes more than processes x budget of memory;
it also stops the run if the machine itself runs short (other jobs), rather than let the kernel kill something.

glibc is told to serve every allocation above 64 KiB with mmap (MALLOC_MMAP_THRESHOLD_), so freed tensors leave the
resident set at once and the peak is the live-tensor peak, not allocator caching. The per-process baseline (the
interpreter, torch, gloo and the trainer with one narrow block per process) is measured once per row and passed to
the estimate.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

# Each row: the config sections it sets on top of the common base, and the matching `estimate` arguments.
ROWS: dict[str, dict[str, Any]] = {
    "ddp": {
        "config": {"parallel": {"strategy": "ddp"}},
        "estimate": {"strategy": "ddp"},
    },
    "zero3 + block wrap": {
        "config": {"parallel": {"strategy": "zero3", "wrap": "block"}},
        "estimate": {"strategy": "zero3", "wrap": "block"},
    },
    "zero3 + activation checkpointing": {
        "config": {"parallel": {"strategy": "zero3", "wrap": "block", "activation_checkpointing": "block"}},
        "estimate": {"strategy": "zero3", "wrap": "block", "ac": True},
    },
    "zero3 + activation checkpointing + sharded init": {
        "config": {
            "parallel": {
                "strategy": "zero3",
                "wrap": "block",
                "activation_checkpointing": "block",
                "sharded_init": True,
            }
        },
        "estimate": {"strategy": "zero3", "wrap": "block", "ac": True, "build": "sharded"},
    },
    "zero3 + amp_o2 bf16 + activation checkpointing": {
        "config": {
            "parallel": {"strategy": "zero3", "wrap": "block", "activation_checkpointing": "block"},
            "precision": {"mode": "amp_o2", "dtype": "bf16"},
        },
        "estimate": {"strategy": "zero3", "wrap": "block", "ac": True, "precision": "bf16"},
    },
    # One pipeline of all the processes, 1F1B over 4 micro-batches of one image: the same 4 images per step as the
    # data-parallel rows (the batch is the pipeline's, not each process's).
    "pipeline stages": {
        "config": {
            "parallel": {"strategy": "ddp", "pipeline_stages": "PROCESSES", "microbatches": 4},
            "train": {"batch_size": 4},
        },
        "estimate": {"strategy": "ddp", "pipeline_stages": "PROCESSES", "microbatches": 4, "batch": 4},
    },
}
STEPS = 3
IMAGE_SIZE, PATCH_SIZE = 32, 16
POLL_S = 0.02
MIN_AVAILABLE_BYTES = 3 << 29  # the machine's MemAvailable below this stops the run (other jobs need memory too)


def _status_bytes(field: str, pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} missing from /proc/{pid}/status")


def _available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable missing from /proc/meminfo")


def _resolve(values: dict[str, Any], processes: int) -> dict[str, Any]:
    """Replace the placeholder PROCESSES (pipeline stages = all processes) by the number of processes."""
    out = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out[key] = _resolve(value, processes)
        else:
            out[key] = processes if value == "PROCESSES" else value
    return out


def run_config(model: dict[str, Any], row: dict[str, Any], processes: int, batch: int, out_dir: str) -> dict[str, Any]:
    """The trainer's config for one probe: the row's sections over a synthetic-data, fp32, one-thread base."""
    config: dict[str, Any] = {
        "name": "largest-model",
        "model": {"image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE, "num_classes": 1000, **model},
        "data": {"source": "synthetic", "synthetic_samples": batch * processes * (STEPS + 1) * 2},
        "train": {"batch_size": batch, "threads": 1, "epochs": 1, "device": "cpu"},
        "precision": {"mode": "fp32"},  # auto could pick bf16 on CPUs with AMX
        "log": {"out_dir": out_dir, "progress": False},
    }
    for section, values in _resolve(row["config"], processes).items():
        config.setdefault(section, {}).update(values)
    return config


# ---------------------------------------------------------------------------------------------- one process


def worker(spec_path: str, rank: int) -> None:
    """One process of a probe: build the trainer, train STEPS steps, report the peaks of build and training."""
    from distributed_helpers import torchrun_env

    spec = json.loads(Path(spec_path).read_text())
    os.environ.update(torchrun_env(rank, spec["port"], spec["processes"]))
    import torch

    from vitrain.config import load_config
    from vitrain.engine import Trainer
    from vitrain.parallel import shutdown

    torch.set_num_threads(1)
    cfg = load_config(base=spec["config"])
    trainer = Trainer(cfg)
    build_peak = _status_bytes("VmHWM")
    Path("/proc/self/clear_refs").write_text("5")  # restart the peak counter: training's own peak from here
    batches = trainer.train_loader.epoch(0)
    step_s, losses = [], []
    for _ in range(STEPS):
        start = time.perf_counter()
        loss = trainer.train_step([next(batches)]).loss  # the trainer's own step (train.accum_steps=1)
        losses.append(loss.item())
        step_s.append(time.perf_counter() - start)
    result = {
        "rank": rank,
        "build_peak_bytes": build_peak,
        "train_peak_bytes": _status_bytes("VmHWM"),
        "step_s": step_s,
        "loss": losses,
    }
    result["peak_bytes"] = max(result["build_peak_bytes"], result["train_peak_bytes"])
    Path(spec_path).with_suffix(f".rank{rank}.json").write_text(json.dumps(result))
    close = getattr(batches, "close", None)
    if close is not None:
        close()
    trainer.close()
    shutdown()


# ---------------------------------------------------------------------------------------------- one probe


class MachineShortOfMemory(RuntimeError):
    """Other jobs left too little memory to run a probe safely; run again when the machine is quieter."""


def probe(model: dict[str, Any], row: dict[str, Any], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Run one model under one row in fresh processes; `fits` only if all finish under the budget."""
    from distributed_helpers import free_port

    budget = int(args.budget_gib * 2**30)
    tag = f"w{model['width']}-d{model['depth']}-{abs(hash(json.dumps(row, sort_keys=True))) % 10**8}"
    spec_path = work / f"{tag}.json"
    config = run_config(model, row, args.processes, args.batch, str(work / "runs"))
    spec_path.write_text(json.dumps({"config": config, "port": free_port(), "processes": args.processes}))
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(REPO)}
    log = open(work / f"{tag}.log", "w")
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(spec_path), str(rank)], env=env, stdout=log, stderr=log
        )
        for rank in range(args.processes)
    ]
    start, seen_peak, killed = time.perf_counter(), 0, None
    try:
        while any(p.poll() is None for p in procs):
            for p in procs:
                if p.poll() is None:
                    try:
                        seen_peak = max(seen_peak, _status_bytes("VmRSS", p.pid))
                    except (FileNotFoundError, ProcessLookupError, RuntimeError):
                        pass  # it just exited
            if seen_peak > budget:
                killed = "a process's resident set passed the budget"
            elif _available_bytes() < MIN_AVAILABLE_BYTES:
                killed = "machine short of memory"
            elif time.perf_counter() - start > args.probe_timeout_s:
                killed = f"took longer than {args.probe_timeout_s} s"
            elif any(p.poll() not in (None, 0) for p in procs):
                killed = "a process failed"
            if killed:
                break
            time.sleep(POLL_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait()
        log.close()
    wall_s = time.perf_counter() - start
    if killed == "machine short of memory":
        raise MachineShortOfMemory(f"MemAvailable fell below {MIN_AVAILABLE_BYTES / 2**30:.1f} GiB during a probe")
    ranks = []
    for rank in range(args.processes):
        path = spec_path.with_suffix(f".rank{rank}.json")
        if path.exists():
            ranks.append(json.loads(path.read_text()))
    complete = killed is None and len(ranks) == args.processes
    measured = max([r["peak_bytes"] for r in ranks], default=seen_peak)
    result = {
        "model": model,
        "fits": complete and measured <= budget,
        "peak_bytes": measured if complete else None,
        "watched_peak_bytes": seen_peak,
        "stopped": killed,
        "wall_s": wall_s,
        "ranks": ranks,
    }
    if killed == "a process failed":
        result["log_tail"] = (work / f"{tag}.log").read_text()[-3000:]
    return result


def measure_baseline(row: dict[str, Any], args: argparse.Namespace, work: Path) -> int:
    """Peak resident set of a probe whose model is a few narrow blocks: everything but the model's tensors.

    One block per process, so that every pipeline stage has one.
    """
    result = probe({"width": 64, "depth": args.processes, "heads": 1, "mlp_dim": 256}, row, args, work)
    if not result["fits"]:
        raise RuntimeError(f"the baseline probe did not complete: {result.get('stopped')} {result.get('log_tail', '')}")
    return result["peak_bytes"]


# ---------------------------------------------------------------------------------------------- the search


def search(name: str, row: dict[str, Any], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Largest fitting model of the ladder: start at the estimate's pick, gallop to a bracket, then bisect."""
    from vitrain.models.memory import estimate, ladder, largest_that_fits

    budget = int(args.budget_gib * 2**30)
    baseline = measure_baseline(row, args, work)
    setting = {"batch": args.batch, **_resolve(row["estimate"], args.processes), "baseline_bytes": baseline}
    base = {"image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE, "num_classes": 1000}
    models = ladder(base)
    predicted = largest_that_fits(models, budget, devices=args.processes, **setting)
    print(f"{name}: baseline {baseline / 2**30:.3f} GiB/process; estimate's largest: {_describe(models, predicted)}")
    probes: dict[int, dict[str, Any]] = {}

    def fits(i: int) -> bool:
        if i not in probes:
            m = models[i]
            spec = {"width": m.width, "depth": m.depth, "heads": m.heads, "mlp_dim": m.hidden_dim}
            result = probe(spec, row, args, work)
            est = estimate(m, devices=args.processes, **setting)
            result.update(index=i, params=_params(m), estimate_bytes=est.peak, estimate=est.as_dict())
            probes[i] = result
            peak = result["peak_bytes"]
            seen = f"{peak / 2**30:.3f}" if peak else f">{result['watched_peak_bytes'] / 2**30:.3f}"
            print(
                f"  probe {_describe(models, i)}: peak {seen} GiB, estimate {est.peak / 2**30:.3f} GiB, "
                f"{'fits' if result['fits'] else 'does not fit (' + str(result['stopped'] or 'over budget') + ')'}"
                f", {result['wall_s']:.0f} s",
                flush=True,
            )
        return probes[i]["fits"]

    start = predicted if predicted is not None else 0
    if fits(start):
        low, step = start, 1
        high = start + step
        while high < len(models) and fits(high):
            low, step = high, step * 2
            high = min(low + step, len(models))
    else:
        high, step = start, 1
        low = start - step
        while low >= 0 and not fits(low):
            high, step = low, step * 2
            low = max(high - step, -1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    best = probes.get(low)
    return {
        "row": name,
        "config": _resolve(row["config"], args.processes),
        "baseline_bytes": baseline,
        "largest": None if best is None else {**best["model"], "params": best["params"]},
        "measured_peak_bytes": None if best is None else best["peak_bytes"],
        "estimate_bytes": None if best is None else best["estimate_bytes"],
        "error": None if best is None else best["estimate_bytes"] / best["peak_bytes"] - 1,
        "predicted_largest": None
        if predicted is None
        else {"width": models[predicted].width, "depth": models[predicted].depth, "params": _params(models[predicted])},
        "first_failing": None if high >= len(models) else {"index": high, "params": _params(models[high])},
        "probes": [probes[i] for i in sorted(probes)],
    }


def _params(cfg) -> int:
    from vitrain.models import complexity

    return complexity(cfg).params


def _describe(models: list, i: int | None) -> str:
    if i is None:
        return "none"
    m = models[i]
    return f"#{i} width {m.width} depth {m.depth} mlp {m.hidden_dim} ({_params(m) / 1e6:.0f}M params)"


# ---------------------------------------------------------------------------------------------- report


def table(results: dict[str, Any]) -> str:
    lines = [
        f"Largest ViT that trains {STEPS} steps with {results['processes']} processes and a "
        f"{results['budget_gib']:g} GiB per-process budget ({results['cpu']}, torch {results['torch']}, "
        f"{results['batch']} image(s) of {IMAGE_SIZE}x{IMAGE_SIZE} per process)",
        "",
        "| row | largest measured (params, width x depth) | measured peak / process | `vitrain estimate` | "
        "estimate vs measured | estimate's largest | x ddp |",
        "|---|---|---|---|---|---|---|",
    ]
    ddp = results["rows"].get("ddp", {}).get("largest")
    for name, r in results["rows"].items():
        if r.get("not_measured"):
            lines.append(f"| {name} | not measured: {r['not_measured']} | | | | | |")
            continue
        big, pred = r["largest"], r["predicted_largest"]
        if big is None:
            lines.append(f"| {name} | nothing fits | | | | | |")
            continue
        ratio = f"{big['params'] / ddp['params']:.2f}" if ddp else ""
        lines.append(
            f"| {name} | {big['params'] / 1e6:,.0f}M ({big['width']} x {big['depth']}) | "
            f"{r['measured_peak_bytes'] / 2**30:.3f} GiB | {r['estimate_bytes'] / 2**30:.3f} GiB | "
            f"{r['error']:+.1%} | {pred['params'] / 1e6:,.0f}M ({pred['width']} x {pred['depth']}) | {ratio} |"
            if pred
            else f"| {name} | {big['params'] / 1e6:,.0f}M | {r['measured_peak_bytes'] / 2**30:.3f} GiB | | | none | |"
        )
    errors = [
        p["estimate_bytes"] / p["peak_bytes"] - 1
        for r in results["rows"].values()
        for p in r.get("probes", [])
        if p.get("peak_bytes") and "estimate_bytes" in p
    ]
    if errors:
        lines += ["", f"Every completed probe ({len(errors)}): estimate vs measured peak from {min(errors):+.1%} to "]
        lines[-1] += f"{max(errors):+.1%}."
    zero3, ddp_row = results["rows"].get("zero3 + activation checkpointing", {}), results["rows"].get("ddp", {})
    if zero3.get("largest") and ddp_row.get("largest"):
        ratio = zero3["largest"]["params"] / ddp_row["largest"]["params"]
        lines.append(f"zero3 + activation checkpointing trains {ratio:.2f}x the parameters of ddp.")
    return "\n".join(lines) + "\n"


def _cpu_name() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return platform.processor() or "unknown CPU"


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--budget-gib", type=float, default=5.0, help="peak resident set allowed per process")
    parser.add_argument("--batch", type=int, default=1, help="images per process per step")
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS), metavar="ROW")
    parser.add_argument("--probe-timeout-s", type=float, default=2400.0)
    parser.add_argument("--results", default=str(REPO / "results" / "largest_model.json"))
    parser.add_argument("--work-dir", default=None, help="probe specs, logs and run folders (default: a temp dir)")
    parser.add_argument("--table", action="store_true", help="only rewrite the .md table from the results JSON")
    args = parser.parse_args()
    if args.table:
        results_path = Path(args.results)
        results_path.with_suffix(".md").write_text(table(json.loads(results_path.read_text())))
        return
    # A stopped benchmark (kill PID) unwinds, so each probe's finally kills its processes instead of orphaning them.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    import torch

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="vitrain-largest-"))
    work.mkdir(parents=True, exist_ok=True)
    results_path = Path(args.results)
    # Rows already measured with the same setting are kept, so rows can be run (or re-run) one at a time.
    results: dict[str, Any] = {}
    if results_path.exists():
        results = json.loads(results_path.read_text())
    setting = {"processes": args.processes, "budget_gib": args.budget_gib, "batch": args.batch, "steps": STEPS}
    if any(results.get(k) != v for k, v in setting.items()):
        results = {}
    results.update(setting, cpu=_cpu_name(), torch=torch.__version__, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)
    results["command"] = " ".join(["python benchmarks/largest_model.py", *sys.argv[1:]])
    results.setdefault("rows", {})
    for name in args.rows:
        start = time.perf_counter()
        try:
            found = search(name, ROWS[name], args, work)
            results["rows"][name] = {**found, "wall_s": time.perf_counter() - start, "command": results["command"]}
        except MachineShortOfMemory as exc:
            print(f"{name}: stopped, {exc}; run this row again later", flush=True)
            break
        except RuntimeError as exc:
            print(f"{name}: not measured: {exc}", flush=True)
            results["rows"][name] = {"row": name, "not_measured": str(exc).splitlines()[0][:300]}
        results["rows"] = {k: results["rows"][k] for k in ROWS if k in results["rows"]}  # the order
        results_path.parent.mkdir(parents=True, exist_ok=True)
        results_path.write_text(json.dumps(results, indent=2) + "\n")
        results_path.with_suffix(".md").write_text(table(results))
    print(table(results))


if __name__ == "__main__":
    main()
