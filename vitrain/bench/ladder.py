"""The ablation ladder: the sources' rows in order, each timed in its own processes, ratios to one baseline.

    vitrain bench --ladder                       # ViT-Ti/16 at 224 px, synthetic images, this device
    vitrain bench --ladder model.preset=vit_base_patch16 --out results/ladder-b16

Each row is `vitrain bench CONFIG overrides` run under torchrun with the same number of processes, so its peak
memory is its own and a row that fails cannot take the others down; the GEMM peaks are measured once first and
handed to every row, and every ratio is to the baseline row of the same run. A row that cannot run here (too few
processes, DeepSpeed not installed) or that fails is kept in the table with the reason.

`--repeats R` runs the whole ladder R times, rows taking turns (round 1: every row, then round 2, ...), so that a
drift of the machine's speed touches every row alike: a row then gives its median images/s with the spread over
the rounds, and its ratio to the baseline is taken round by round (median and spread, `~` where the spread reaches
across 1.0x). Its peak memory is the largest over its rounds; its other columns (step breakdown, MFU) are those of
its median round. Autotune's race, where a row has one, runs once before round 1 (`tune_first`), so that every
round times and measures a run whose decision is made.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vitrain.bench.spread import format_spread, paired_ratio, spread
from vitrain.bench.step import IMAGENET_SHAPED
from vitrain.device import cpu_description, cpu_gemm_peaks
from vitrain.errors import ConfigError

# The ladder's model when no config is given: ViT-Ti/16 at 224 px on synthetic ImageNet-shaped data.
DEFAULT_BASE = ["name=ladder", "model.preset=vit_tiny_patch16", *IMAGENET_SHAPED]


ROW_TIMEOUT_S = 600


@dataclass
class Context:
    """What decides which rows run here and with what."""

    device: str  # cpu | cuda
    nproc: int
    batch: int  # per rank
    deepspeed: bool
    fast_low_precision: bool  # a GPU, or a CPU whose bf16 GEMM outruns fp32: the comparison groups compute in bf16
    bf16_emulated: str | None = None  # why bf16 runs in software on this CPU (vitrain/device.py), or None
    dtype: str = "bf16"  # the config's precision.dtype: a row's low dtype where its overrides do not name one


@dataclass
class Row:
    name: str
    group: str
    overrides: Callable[[Context], list[str]]
    needs: Callable[[Context], str | None] = lambda ctx: None  # a reason it cannot run here, or None
    result: dict[str, Any] | None = None  # the median round's (the only round's without --repeats)
    status: str = "ok"
    command: str = ""
    wall_s: float = 0.0
    rounds: list[dict[str, Any]] = field(default_factory=list)  # every round's result that ran
    failures: list[str] = field(default_factory=list)  # why a round failed


def _multi(ctx: Context) -> str | None:
    return None if ctx.nproc >= 2 else f"needs 2 or more processes (--nproc {ctx.nproc})"


def _ds(ctx: Context) -> str | None:
    if not ctx.deepspeed:
        return "DeepSpeed is not installed (pip install 'vitrain[deepspeed]')"
    return None


def _ds_multi(ctx: Context) -> str | None:
    return _ds(ctx) or _multi(ctx)


def _bf16_multi(ctx: Context) -> str | None:
    if not ctx.fast_low_precision:
        return "the comparison computes in fp32 here (bf16 is not faster on this device): no bf16 gradients"
    return _multi(ctx)


def _emulated(row: Row, ctx: Context) -> str | None:
    """Why a row that computes in bf16 does not run where this CPU emulates bf16: its steps would time software
    arithmetic, tens of times slower than fp32, for nothing that carries over to a CPU with bf16 units."""
    if not ctx.bf16_emulated:
        return None
    precision = dict(
        o.split("=", 1) for o in row.overrides(ctx) if o.startswith(("precision.mode=", "precision.dtype="))
    )
    low = precision.get("precision.mode") in ("amp_o1", "amp_o2", "pure")
    if low and precision.get("precision.dtype", ctx.dtype) == "bf16":
        return "computes in bf16, which this CPU runs in software (the probe's figures above the table)"
    return None


def _compare_precision(ctx: Context) -> list[str]:
    """The comparison groups' precision: bf16 O2 where bf16 is measured faster, fp32 where bf16 matmuls are slow."""
    return ["precision.mode=amp_o2", "precision.dtype=bf16"] if ctx.fast_low_precision else ["precision.mode=fp32"]


BASELINE = ["parallel.strategy=ddp", "precision.mode=amp_o1", "precision.dtype=bf16", "optim.impl=loop"]
BASELINE += ["model.pool=cls", "model.layout=batch_first", "model.attention=sdpa"]
MULTI_TENSOR = ["optim.impl=auto"]
POOLED = ["model.pool=gap"]
SEQ_FIRST = ["model.layout=seq_first"]
BF16_GRADIENTS = "precision.reduce_dtype=bf16"
BLOCKING = "parallel.overlap_comm=false"  # FSDP2's reduce-scatters and all-gathers block the compute thread (a CPU)
REDUCE_SCATTER = "parallel.grad_reduce=reduce_scatter"  # FSDP2's own reduce-scatter, not auto's all-reduce on gloo
NORM_HOOKS = "precision.compile_norms=false"  # amp_o2's fp32 norms through cast hooks, not one compiled kernel
TOKEN_DROP = ["train.token_drop=0.5"]  # half the patch tokens of each image (vitrain/engine/token_drop.py)


def _ladder(*steps: list[str]) -> Callable[[Context], list[str]]:
    """The baseline plus each of `steps`, in order (the sources' ladder is cumulative)."""
    return lambda ctx: BASELINE + [o for s in steps for o in s]


def rows() -> list[Row]:
    ladder = "the sources' ladder (cumulative)"
    sharded = "large-model recipe (vs the baseline)"
    engines = "DeepSpeed vs native (same precision)"

    def compare(strategy: str, *extra: str) -> Callable[[Context], list[str]]:
        base = [o for o in BASELINE if not o.startswith(("parallel.strategy", "precision."))]
        return lambda ctx: (
            base + MULTI_TENSOR + POOLED + [f"parallel.strategy={strategy}", *extra] + (_compare_precision(ctx))
        )

    def deepspeed(strategy: str, offload: str, *extra: str) -> Callable[[Context], list[str]]:
        return compare(strategy, "train.engine=deepspeed", f"parallel.offload={offload}", *extra)

    return [
        Row("fp32 reference", ladder, lambda ctx: [*BASELINE, "precision.mode=fp32"]),
        Row("baseline: DDP + AMP O1 bf16, per-tensor AdamW, class token", ladder, _ladder()),
        Row("+ multi-tensor optimizer", ladder, _ladder(MULTI_TENSOR)),
        Row("+ pooled classifier", ladder, _ladder(MULTI_TENSOR, POOLED)),
        Row("+ batch-second layout", ladder, _ladder(MULTI_TENSOR, POOLED, SEQ_FIRST)),
        Row("+ AMP O2", ladder, _ladder(MULTI_TENSOR, POOLED, SEQ_FIRST, ["precision.mode=amp_o2"])),
        Row("+ pure bf16", ladder, _ladder(MULTI_TENSOR, POOLED, SEQ_FIRST, ["precision.mode=pure"])),
        Row(
            "+ 2x batch",
            ladder,
            lambda ctx: (
                _ladder(MULTI_TENSOR, POOLED, SEQ_FIRST, ["precision.mode=pure"])(ctx)
                + [f"train.batch_size={2 * ctx.batch}"]
            ),
        ),
        Row(
            "+ token drop 0.5",
            ladder,
            lambda ctx: (
                _ladder(MULTI_TENSOR, POOLED, SEQ_FIRST, ["precision.mode=pure"], TOKEN_DROP)(ctx)
                + [f"train.batch_size={2 * ctx.batch}"]
            ),
        ),
        Row(
            "vitrain auto (precision, attention by measurement)",
            ladder,
            lambda ctx: (
                ["parallel.strategy=ddp", "precision.mode=auto", "model.attention=auto", *MULTI_TENSOR] + POOLED
            ),
        ),
        Row("zero2 + AMP O2", sharded, lambda ctx: _sharded(ctx, "zero2"), _multi),
        Row("zero3 + AMP O2", sharded, lambda ctx: _sharded(ctx, "zero3"), _multi),
        Row(
            "zero3 + AMP O2 + activation checkpointing",
            sharded,
            lambda ctx: _sharded(ctx, "zero3", "parallel.activation_checkpointing=block"),
            _multi,
        ),
        Row(
            "2 pipeline stages (1F1B) + AMP O1",
            sharded,
            lambda ctx: _ladder(MULTI_TENSOR, POOLED)(ctx) + ["parallel.pipeline_stages=2"],
            _multi,
        ),
        Row("native DDP", engines, compare("ddp")),
        Row("native zero1", engines, compare("zero1"), _multi),
        Row("native zero2", engines, compare("zero2"), _multi),
        Row("native zero3", engines, compare("zero3"), _multi),
        Row("DeepSpeed stage 2", engines, deepspeed("zero2", "none"), _ds_multi),
        # parallel.overlap_comm's measured effect: the same rows with FSDP2's collectives blocking, as FSDP2 calls them.
        Row("native zero2, collectives blocking", engines, compare("zero2", BLOCKING), _multi),
        Row("native zero3, collectives blocking", engines, compare("zero3", BLOCKING), _multi),
        # parallel.grad_reduce's measured effect: auto all-reduces on gloo; these rows keep FSDP2's reduce-scatter.
        Row("native zero2, FSDP2 reduce-scatter", engines, compare("zero2", REDUCE_SCATTER), _multi),
        Row("native zero3, FSDP2 reduce-scatter", engines, compare("zero3", REDUCE_SCATTER), _multi),
        # precision.compile_norms's measured effect on FSDP2's fp32 norm unit (auto compiles them on a CPU that can).
        Row("native zero2, norm cast hooks", engines, compare("zero2", NORM_HOOKS), _multi),
        Row("native zero3, norm cast hooks", engines, compare("zero3", NORM_HOOKS), _multi),
        # Both averaging gradients in bf16, DeepSpeed's own default (engine.communication_data_type).
        Row("native zero2, bf16 gradients", engines, compare("zero2", BF16_GRADIENTS), _bf16_multi),
        Row(
            "DeepSpeed stage 2, bf16 gradients",
            engines,
            deepspeed("zero2", "none", BF16_GRADIENTS),
            lambda ctx: _ds(ctx) or _bf16_multi(ctx),
        ),
        Row("DeepSpeed stage 2 + optimizer offload", engines, deepspeed("zero2", "optimizer"), _ds_multi),
        Row("DeepSpeed stage 3 + offload", engines, deepspeed("zero3", "params"), _ds_multi),
        Row("DeepSpeed stage 3", engines, deepspeed("zero3", "none"), _ds_multi),
    ]


# parallel.overlap_comm's measured effect: each native sharded row against itself with FSDP2's collectives blocking.
OVERLAP_VS_BLOCKING = (
    ("native zero2", "native zero2, collectives blocking"),
    ("native zero3", "native zero3, collectives blocking"),
)

# parallel.grad_reduce's effect: each native sharded row (all-reduce on gloo under auto) against FSDP2's reduce-scatter.
ALL_REDUCE_VS_REDUCE_SCATTER = (
    ("native zero2", "native zero2, FSDP2 reduce-scatter"),
    ("native zero3", "native zero3, FSDP2 reduce-scatter"),
)

# precision.compile_norms's effect: each native sharded row (norms compiled where auto can) against the cast hooks.
COMPILED_VS_HOOKS = (
    ("native zero2", "native zero2, norm cast hooks"),
    ("native zero3", "native zero3, norm cast hooks"),
)

# The comparison: vitrain's own ZeRO stage against DeepSpeed's, same precision and batch.
NATIVE_VS_DEEPSPEED = (
    ("native zero2", "DeepSpeed stage 2"),
    ("native zero3", "DeepSpeed stage 3"),
    ("native zero2, bf16 gradients", "DeepSpeed stage 2, bf16 gradients"),
)


def _sharded(ctx: Context, strategy: str, *extra: str) -> list[str]:
    base = _ladder(MULTI_TENSOR, POOLED)(ctx)
    base = [o for o in base if not o.startswith(("parallel.strategy", "precision.mode"))]
    return base + [f"parallel.strategy={strategy}", "precision.mode=amp_o2", *extra]


def default_nproc(device: str) -> int:
    return max(1, torch.cuda.device_count()) if device == "cuda" else 2


def main(name: str | None, overrides: list[str], args: argparse.Namespace) -> int:
    from vitrain.config import load_config, resolve_config_path, to_yaml

    asked = {row.name for row in asked_for(rows(), args.rows)}  # a --rows entry naming no row: refused first
    cfg = load_config(resolve_config_path(name) if name else None, (DEFAULT_BASE if name is None else []) + overrides)
    device = "cuda" if torch.cuda.is_available() and cfg.train.device in ("auto", "cuda") else "cpu"
    nproc = args.nproc or default_nproc(device)
    # A GPU step of these models takes about 0.1 s: 3 of them could not rank the rows of a one-H100 ViT-B/16 ladder
    # (results/cuda-h100), so a GPU times 20 after 5 (cuDNN and allocator warm-up). A CPU times 3 after 2: with
    # compiled norms (precision.compile_norms=auto) the step after the compiling one still ran 1.2x slower under
    # 2-rank zero2 (ViT-Ti/16, a ninth session's docs/performance.md).
    steps = args.steps or (3 if device == "cpu" else 20)
    warmup = (2 if device == "cpu" else 5) if args.warmup is None else args.warmup
    repeats = getattr(args, "repeats", None) or 1
    batch = (
        cfg.train.batch_size
        if any(o.startswith("train.batch_size=") for o in overrides)
        else (16 if device == "cpu" else 128)
    )
    threads = max(1, (os.cpu_count() or 1) // nproc) if device == "cpu" else torch.get_num_threads()
    peaks, emulated = {}, None
    if device == "cpu":
        torch.set_num_threads(threads)
        peaks, emulated = cpu_gemm_peaks(torch.device("cpu"))
    ctx = Context(
        device=device,
        nproc=nproc,
        batch=batch,
        deepspeed=importlib.util.find_spec("deepspeed") is not None,
        # Measured, not assumed: some CPUs without AMX (avx512_bf16) run bf16 GEMMs faster than fp32, others slower.
        fast_low_precision=device == "cuda" or peaks["bf16"] > 1.2 * peaks["fp32"],
        bf16_emulated=emulated,
        dtype=cfg.precision.dtype,
    )
    # Enough synthetic images for every step of the largest row (2x batch) without a second epoch's shuffle.
    samples = 2 * batch * nproc * (steps + warmup + 1)
    common = [f"train.batch_size={batch}", f"data.synthetic_samples={samples}", "log.progress=false"]
    if ctx.device == "cpu":
        common.append(f"train.threads={threads}")

    peaks_arg = ",".join(f"{k}={v / 1e12:.6f}" for k, v in peaks.items())

    out = Path(args.out or Path(cfg.log.out_dir) / "bench-ladder")
    out.mkdir(parents=True, exist_ok=True)
    # Every row starts from this resolved config (the recipe and the overrides given), then its own overrides.
    config = out / "ladder-config.yaml"
    config.write_text(to_yaml(cfg))
    table_rows = rows()
    started = time.perf_counter()
    print(
        f"ladder: {len(table_rows)} rows, {nproc} process(es) x {threads} thread(s), batch {batch}/rank, "
        f"{warmup} warm-up + {steps} timed steps each, {repeats} round(s) -> {out}",
        file=sys.stderr,
    )
    if emulated:
        print(
            f"  bf16 is emulated on this CPU ({emulated}): the rows that compute in bf16 are skipped", file=sys.stderr
        )
    runnable = []
    for row in table_rows:
        reason = row.needs(ctx) or _emulated(row, ctx)
        if not reason and row.name not in asked:
            reason = f"not asked for (--rows {args.rows})"
        if reason:
            row.status = f"skipped: {reason}"
            print(f"  {row.name}: {row.status}", file=sys.stderr)
        else:
            runnable.append(row)
    for row in runnable:
        tune_first(row, config, common + row.overrides(ctx), nproc, peaks_arg, threads, ctx.device)
    for round_ in range(repeats):
        for row in runnable:
            run_row(row, config, common + row.overrides(ctx), nproc, steps, warmup, peaks_arg, threads)
            got = f"{row.rounds[-1]['images_per_s']:.2f} img/s" if row.rounds and not row.failures else row.status
            print(f"  [{round_ + 1}/{repeats}] {row.name}: {got} ({row.wall_s:.0f} s)", file=sys.stderr)
    for row in runnable:
        settle(row, repeats)
    total_s = time.perf_counter() - started

    summary = _summary(table_rows, ctx, threads, steps, warmup, peaks, total_s, cfg, sys.argv, repeats)
    (out / "ladder.json").write_text(json.dumps(summary, indent=2) + "\n")
    markdown = to_markdown(summary)
    (out / "ladder.md").write_text(markdown)
    draw_bars(summary, out / "ladder.png")
    print(markdown)
    print(f"wrote {out / 'ladder.md'}, {out / 'ladder.json'}, {out / 'ladder.png'} in {total_s:.0f} s")
    return 0


def asked_for(table_rows: list[Row], spec: str | None) -> list[Row]:
    """The rows `--rows` names (every row without it): a row's whole name picks that row alone, any other text
    every row whose name contains it; text that is in no row's name is refused, with the names listed."""
    wanted = [w.strip() for w in (spec or "").split(",") if w.strip()]
    if not wanted:
        return list(table_rows)
    names = {row.name for row in table_rows}
    unmatched = [w for w in wanted if not any(w in name for name in names)]
    if unmatched:
        listed = "; ".join(row.name for row in table_rows)
        raise ConfigError(f"--rows {','.join(unmatched)} matches no ladder row; the rows: {listed}")
    return [r for r in table_rows if any(w == r.name or (w not in names and w in r.name) for w in wanted)]


def tune_first(row: Row, config, overrides, nproc, peaks_arg, threads, device: str) -> None:
    """Autotune's race for a row whose config has one (autotune's own `candidates`), run once before the rounds in
    the row's own processes (one untimed step, its figures dropped): every round then reads the decision it cached,
    as every run after a config's first does. A round that raced would carry the race into its peak memory: its
    candidates are freed, but the heap they fragmented stays (ViT-S/16 zero2, batch 16 per rank: 1.75 GiB against
    1.49 in the same run with the decision cached, docs/performance.md)."""
    from vitrain.config import load_config
    from vitrain.engine.autotune import candidates, enabled

    cfg = load_config(config, overrides)
    if not enabled() or not candidates(cfg, torch.device(device), pipelined=cfg.parallel.pipeline_stages > 1):
        return  # nothing to race: a DeepSpeed row, a pipeline, every value fixed
    tuning = Row(row.name, row.group, row.overrides)
    run_row(tuning, config, overrides, nproc, 1, 0, peaks_arg, threads)
    how = "done" if tuning.rounds else f"failed: {tuning.failures[-1]}"  # the rounds then fail and say why
    print(f"  [autotune first] {row.name}: {how} ({tuning.wall_s:.0f} s)", file=sys.stderr)


def run_row(row: Row, config, overrides, nproc, steps, warmup, peaks_arg, threads) -> None:
    """One round of `row`: `vitrain bench` in its own processes; the result joins row.rounds, a failure row.failures."""
    with tempfile.TemporaryDirectory(prefix="vitrain-ladder-") as scratch:
        result_path = Path(scratch) / "row.json"
        vitrain = ["-m", "vitrain", "bench", "run", str(config), *overrides]
        vitrain += ["--steps", str(steps), "--warmup", str(warmup), "--json", str(result_path)]
        if peaks_arg:
            vitrain += ["--peaks", peaks_arg]
        launch = [sys.executable]
        if nproc > 1:
            launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        command = launch + vitrain
        row.command = shlex.join(["python" if c == sys.executable else c for c in command])  # as a reader types it
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore")
        start = time.perf_counter()
        # Its own session: a row over its time is stopped with every process torchrun started.
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
        )
        try:
            _, stderr = proc.communicate(timeout=ROW_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            row.failures.append(f"over {ROW_TIMEOUT_S} s")
            return
        finally:
            row.wall_s = time.perf_counter() - start
        if proc.returncode == 0 and result_path.exists():
            row.rounds.append(json.loads(result_path.read_text()))
            return
        row.failures.append(_error_line(stderr))


def settle(row: Row, repeats: int) -> None:
    """The row's result (its median round by images/s) and its status once every round has run."""
    if not row.rounds:
        row.status = f"failed: {row.failures[-1]}" if row.failures else "failed: no round ran"
        return
    ordered = sorted(row.rounds, key=lambda r: r["images_per_s"])
    row.result = ordered[(len(ordered) - 1) // 2]
    if row.failures:
        row.status = f"{len(row.failures)} of {repeats} rounds failed: {row.failures[-1]}"


def peak_gib(row: Row) -> float:
    """The row's peak memory in GiB: the largest process's, the largest over the rounds (one round's high-water mark
    moves with what the allocator kept, so the median round's alone can read below what a rank needed)."""
    return max(r["peak_memory_bytes"] for r in row.rounds) / 2**30


def _error_line(stderr: str) -> str:
    """The line that says why a row failed: vitrain's one-line error, else the last exception line."""
    lines = [line.strip() for line in (stderr or "").splitlines() if line.strip()]
    for marker in ("vitrain: error:", "Error: ", "Exception: "):
        found = [line for line in lines if marker in line and "elastic/errors" not in line]
        if found:
            return found[-1][:300]
    return (lines[-1] if lines else "no output")[:300]


def _summary(table_rows, ctx, threads, steps, warmup, peaks, total_s, cfg, argv, repeats=1) -> dict[str, Any]:
    baseline = next((r for r in table_rows if r.name.startswith("baseline") and r.result), None)
    out_rows = []
    for row in table_rows:
        entry: dict[str, Any] = {"name": row.name, "group": row.group, "status": row.status, "command": row.command}
        if row.result:
            r = row.result
            rounds = [x["images_per_s"] for x in row.rounds]
            ratio = _paired(row, baseline) if baseline is not None else None
            entry.update(
                images_per_s=spread(rounds)["median"],
                images_per_s_spread=spread(rounds),
                images_per_s_rounds=rounds,  # in round order: any two rows pair round by round from this file
                vs_baseline=ratio["median"] if ratio else None,
                vs_baseline_spread=ratio,
                step_ms=r["step_s"] * 1e3,
                breakdown_ms={k: v * 1e3 for k, v in r["breakdown_s"].items()},
                peak_memory_gib=peak_gib(row),
                peak_memory_gib_rounds=[x["peak_memory_bytes"] / 2**30 for x in row.rounds],  # in round order
                mfu=r["mfu"],
                precision=r["precision"],
                optimizer=r["optimizer"],
                engine=r["engine"],
                strategy=r["strategy"],
                wrap=r.get("wrap", ""),
                global_batch=r["global_batch"],
                attention=r["attention"],
                pool=r["pool"],
                layout=r["layout"],
                token_drop=r["token_drop"],
            )
        out_rows.append(entry)
    first = next((r.result for r in table_rows if r.result), None) or {}
    by_name = {r.name: r for r in table_rows}
    engine_pairs = _pairs(by_name, NATIVE_VS_DEEPSPEED, ("native", "deepspeed"))
    overlap_pairs = _pairs(by_name, OVERLAP_VS_BLOCKING, ("overlapped", "blocking"))
    norm_pairs = _pairs(by_name, COMPILED_VS_HOOKS, ("compiled", "hooks"))
    reduce_pairs = _pairs(by_name, ALL_REDUCE_VS_REDUCE_SCATTER, ("grad_reduce_auto", "reduce_scatter"))
    return {
        "model": first.get("model", f"{cfg.model.preset}"),
        "device": first.get("device") or (cpu_description() if ctx.device == "cpu" else torch.cuda.get_device_name()),
        "torch": torch.__version__,
        "processes": ctx.nproc,
        "threads_per_process": threads,
        "batch_per_rank": ctx.batch,
        "steps": steps,
        "warmup": warmup,
        "repeats": repeats,
        "peaks_tflops_per_process": {k: v / 1e12 for k, v in peaks.items()},
        "comparison_precision": "amp_o2 bf16" if ctx.fast_low_precision else "fp32",
        "bf16_emulated": ctx.bf16_emulated,  # None, or why the rows computing in bf16 did not run
        "wall_s": total_s,
        "command": shlex.join(["vitrain", *argv[1:]]),
        "rows": out_rows,
        "native_vs_deepspeed": engine_pairs,
        "overlap_vs_blocking": overlap_pairs,
        "compiled_norms_vs_hooks": norm_pairs,
        "grad_reduce_vs_reduce_scatter": reduce_pairs,
    }


def _pairs(by_name: dict[str, Row], names: tuple[tuple[str, str], ...], keys: tuple[str, str]) -> list[dict[str, Any]]:
    """Each (row, other row) of `names` that both ran every round: images/s ratio paired round by round, both peaks,
    the first row's FSDP unit; `keys` name the two rows in each entry."""
    pairs = []
    for first, second in names:
        a, b = by_name.get(first), by_name.get(second)
        ratio = _paired(a, b) if a is not None and b is not None and a.result and b.result else None
        if ratio is None:
            continue  # a row that did not run (or lost a round) has no paired figure
        pairs.append(
            {
                keys[0]: first,
                keys[1]: second,
                "images_per_s_ratio": ratio,
                "peak_memory_gib": [peak_gib(a), peak_gib(b)],
                "wrap": a.result.get("wrap", ""),
                "wrap_other": b.result.get("wrap", ""),
            }
        )
    return pairs


def _paired(row: Row, other: Row) -> dict[str, Any] | None:
    """`row`'s images/s over `other`'s, paired round by round; None where they did not run the same rounds."""
    if len(row.rounds) != len(other.rounds):
        return None
    return paired_ratio([x["images_per_s"] for x in row.rounds], [x["images_per_s"] for x in other.rounds])


def to_markdown(summary: dict[str, Any]) -> str:
    lines = [
        f"# Ablation ladder: {summary['model']}",
        "",
        f"- Device: {summary['device']}",
        f"- torch {summary['torch']}; {summary['processes']} process(es) x {summary['threads_per_process']} "
        f"thread(s); batch {summary['batch_per_rank']} per process; {summary['warmup']} warm-up + "
        f"{summary['steps']} timed steps per row, each row in its own processes, "
        f"{summary.get('repeats', 1)} round(s) of every row taking turns (images/s and x baseline: median "
        "(min-max) over the rounds, the ratio paired round by round; `~`: its spread reaches across 1.0x)",
        f"- Command: `{summary['command']}` ({summary['wall_s']:.0f} s)",
        f"- Ratios are to the baseline row of this run; the DeepSpeed group and the native rows beside it compute in "
        f"{summary['comparison_precision']} (bf16 where its GEMM peak measured above 1.2x fp32's). Peak memory: the "
        "largest process's over its steps, the largest over the rounds (CPU: peak RSS, its high-water mark reset "
        "once the model, optimizer and autotune's choice are built). MFU: model FLOPs over the computing dtype's peak, "
        + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in summary["peaks_tflops_per_process"].items())
        + " GFLOP/s per process measured before the rows.",
        *(
            [f"- bf16 is emulated on this CPU ({summary['bf16_emulated']}): the rows that compute in bf16 are skipped."]
            if summary.get("bf16_emulated")
            else []
        ),
        "",
        "| row | images/s | x baseline | step ms | fwd / bwd / opt ms | peak GiB/process | MFU | precision | "
        "optimizer |",
        "|---|---:|---:|---:|---|---:|---:|---|---|",
    ]
    group = None
    for row in summary["rows"]:
        if row["group"] != group:
            group = row["group"]
            lines.append(f"| **{group}** | | | | | | | | |")
        if "images_per_s" not in row:
            lines.append(f"| {row['name']} | {row['status']} | | | | | | | |")
            continue
        b = row["breakdown_ms"]
        ips = row.get("images_per_s_spread") or {"median": row["images_per_s"], "n": 1}
        spread_ = row.get("vs_baseline_spread") or {"median": row["vs_baseline"], "n": 1}
        ratio = format_spread(spread_, unit="x") if row["vs_baseline"] else "-"
        if spread_.get("overlaps_1x") and not row["name"].startswith("baseline"):
            ratio += " ~"
        lines.append(
            f"| {row['name']} | {format_spread(ips)} | {ratio} | {row['step_ms']:.0f} | "
            f"{b['forward']:.0f} / {b['backward']:.0f} / {b['optimizer']:.0f} | {row['peak_memory_gib']:.2f} | "
            f"{row['mfu']:.3f} | {row['precision']} | {row['optimizer']} |"
        )
    for key, intro, header, names in PAIR_TABLES:
        lines += _pair_table(summary.get(key) or [], intro, header, names)
    return "\n".join(lines) + "\n"


# The summary's paired comparisons as markdown: its key, the line above the table, the header, each pair's row cells.
PAIR_TABLES: tuple[tuple[str, str, str, Callable[[dict[str, Any]], tuple[str, str]]], ...] = (
    (
        "native_vs_deepspeed",
        "Native engine vs DeepSpeed at the same ZeRO stage (images/s ratio paired round by round, median "
        "(min-max); peak memory of the largest process):",
        "| native | vs | images/s ratio | peak GiB native / DeepSpeed |",
        lambda p: (p["native"] + (f" (FSDP2 unit: {p['wrap']})" if p.get("wrap") else ""), p["deepspeed"]),
    ),
    (
        "overlap_vs_blocking",
        "parallel.overlap_comm: FSDP2's collectives beside compute against blocking (images/s ratio paired round "
        "by round, median (min-max); each row's FSDP unit as autotune picked it for that setting):",
        "| overlapped | vs | images/s ratio | peak GiB overlapped / blocking |",
        lambda p: (f"{p['overlapped']} (unit: {p['wrap']})", f"{p['blocking']} (unit: {p['wrap_other']})"),
    ),
    (
        "compiled_norms_vs_hooks",
        "precision.compile_norms: FSDP2's fp32 norms as one compiled kernel each (auto, where this CPU can build it) "
        "against the cast hooks (images/s ratio paired round by round, median (min-max)):",
        "| compiled | vs | images/s ratio | peak GiB compiled / hooks |",
        lambda p: (f"{p['compiled']} (unit: {p['wrap']})", f"{p['hooks']} (unit: {p['wrap_other']})"),
    ),
    (
        "grad_reduce_vs_reduce_scatter",
        "parallel.grad_reduce: gradients reduced as auto reduces them (an all-reduce on gloo, whose reduce-scatter "
        "clones its input and all-reduces the clone) against FSDP2's reduce-scatter (images/s ratio paired round by "
        "round, median (min-max)):",
        "| auto | vs | images/s ratio | peak GiB auto / reduce-scatter |",
        lambda p: (f"{p['grad_reduce_auto']} (unit: {p['wrap']})", f"{p['reduce_scatter']} (unit: {p['wrap_other']})"),
    ),
)


def _pair_table(
    pairs: list[dict[str, Any]], intro: str, header: str, names: Callable[[dict[str, Any]], tuple[str, str]]
) -> list[str]:
    """The markdown lines of one table of `_pairs` entries (none where there are none): `names` gives each entry's two
    row cells; then the paired images/s ratio (`~` where its spread reaches across 1.0x) and both peaks."""
    if not pairs:
        return []
    lines = ["", intro, "", header, "|---|---|---:|---:|"]
    for pair in pairs:
        ratio = format_spread(pair["images_per_s_ratio"], unit="x")
        if pair["images_per_s_ratio"]["overlaps_1x"]:
            ratio += " ~"
        first, second = names(pair)
        ours, theirs = pair["peak_memory_gib"]
        lines.append(f"| {first} | {second} | {ratio} | {ours:.2f} / {theirs:.2f} |")
    return lines


def draw_bars(summary: dict[str, Any], path: Path) -> None:
    """A horizontal bar per row (images/s x baseline), skipped and failed rows named; drawn with Pillow."""
    from PIL import Image, ImageDraw

    rows_ = summary["rows"]
    ratios = [r.get("vs_baseline") or 0.0 for r in rows_]
    top = max(ratios + [1.0])
    label_w, bar_w, row_h, pad = 430, 420, 24, 12
    height = pad * 3 + 40 + row_h * len(rows_)
    image = Image.new("RGB", (label_w + bar_w + 160, height), "white")
    draw = ImageDraw.Draw(image)
    draw.text((pad, pad), f"{summary['model']}: images/s relative to the baseline", fill="black")
    draw.text((pad, pad + 16), summary["device"][:150], fill="dimgray")
    y0 = pad * 2 + 40
    one = label_w + int(bar_w / top)
    draw.line([(one, y0 - 4), (one, height - pad)], fill="gray")
    colors = {}
    palette = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]
    for i, row in enumerate(rows_):
        y = y0 + i * row_h
        color = colors.setdefault(row["group"], palette[len(colors) % len(palette)])
        draw.text((pad, y + 5), row["name"][:68], fill="black")
        if row.get("vs_baseline"):
            width = int(bar_w * row["vs_baseline"] / top)
            draw.rectangle([label_w, y + 3, label_w + width, y + row_h - 3], fill=color)
            draw.text(
                (label_w + width + 6, y + 5), f"{row['vs_baseline']:.2f}x  {row['images_per_s']:.1f}/s", fill="black"
            )
        else:
            draw.text((label_w, y + 5), row["status"][:70], fill="firebrick")
    image.save(path)
