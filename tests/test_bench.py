"""`vitrain bench`: the real training step timed phase by phase, and the ablation ladder's table, JSON and chart."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import pytest
import torch
from PIL import Image

from tests.conftest import run_cli, tiny_overrides
from vitrain.bench import ladder, scaling
from vitrain.bench.optim import bench_optimizer_step, default_impls
from vitrain.bench.step import bench_step, dtype_key, parse_peaks
from vitrain.cli import main
from vitrain.config import OptimConfig, load_config
from vitrain.device import (
    gemm_flops,
    gemm_flops_taking_turns,
    glibc_function,
    peak_memory_bytes,
    reset_peak_memory,
    reuse_freed_host_memory,
)
from vitrain.engine import Trainer
from vitrain.engine.step import TrainStep
from vitrain.errors import ConfigError
from vitrain.optim import muon as muon_module


def test_bench_times_the_same_step_object_that_training_calls(tmp_path, monkeypatch):
    calls = []
    real = TrainStep.__call__

    def spy(step, micro_batches, lr=None, timer=None, **position):  # position: the step index and progress
        calls.append("bench" if timer is not None else "train")
        return real(step, micro_batches, lr, timer, **position)

    monkeypatch.setattr(TrainStep, "__call__", spy)
    cfg = load_config(None, tiny_overrides(tmp_path, "data.source=synthetic", "data.synthetic_samples=256"))
    trainer = Trainer(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=2)))
    try:
        trainer.fit()
    finally:
        trainer.close()
    bench_step(cfg, steps=2, warmup=1, peaks={"fp32": (1e11, "given")})
    assert calls == ["train"] * 2 + ["bench"] * 3


def test_bench_times_the_trainers_own_step(tmp_path):
    cfg = load_config(
        None, tiny_overrides(tmp_path, "data.source=synthetic", "data.synthetic_samples=256", "train.device=cpu")
    )  # on the CPU: its peak memory is the process's
    result = bench_step(cfg, steps=3, warmup=1, peaks={"fp32": (1e11, "given")})
    assert result["steps"] == 3 and result["global_batch"] == 64
    assert result["images_per_s"] == pytest.approx(64 / result["step_s"])
    phases = result["breakdown_s"]
    assert set(phases) == {"data", "forward", "backward", "optimizer"}
    assert all(value >= 0 for value in phases.values())
    assert sum(phases.values()) <= result["step_s"] * 1.01  # the phases are parts of the step
    assert phases["backward"] > 0 and phases["forward"] > 0
    assert result["precision"] == "fp32" and result["compute_dtype"] == "fp32"
    assert result["peak_memory_bytes"] > 50 * 2**20 and result["peak_memory_kind"].startswith("process peak RSS")
    # MFU is the model's FLOP/s over the given peak: 3 x forward FLOPs per image.
    flops = result["train_gflops_per_image"] * 1e9 * result["images_per_s"]
    assert result["mfu"] == pytest.approx(flops / 1e11)
    assert result["peak_source"] == "given"


def test_bench_command_writes_json_and_a_profile(tmp_path):
    out = tmp_path / "bench.json"
    profile = tmp_path / "profile"
    done = run_cli(
        "bench",
        *tiny_overrides(tmp_path, "data.source=synthetic", "data.synthetic_samples=256", "train.device=cpu"),
        "--steps",
        "2",
        "--warmup",
        "1",
        "--json",
        str(out),
        "--profile",
        str(profile),
    )
    assert done.returncode == 0, done.stderr
    assert "images/s" in done.stdout and "MFU" in done.stdout and "step breakdown" in done.stdout
    result = json.loads(out.read_text())
    assert result["steps"] == 2 and result["images_per_s"] > 0
    assert "fp32 matmul measured on this CPU" in result["peak_source"]
    trace = json.loads((profile / "trace.json").read_text())
    assert trace["traceEvents"]
    assert "aten::" in (profile / "ops.txt").read_text()


def test_bench_subcommands_keep_their_names():
    with pytest.raises(SystemExit) as done:
        main(["bench", "optim", "--help"])
    assert done.value.code == 0


def test_a_bad_override_is_one_line_and_exit_code_2(tmp_path, capsys):
    assert main(["bench", *tiny_overrides(tmp_path, "model.width=33")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.width" in err[0]


@pytest.mark.parametrize("flag, where, named", [("--json", "dir", "is a folder, not a file"),
                                                 ("--json", "file/x.json", "is a file, not a folder"),
                                                 ("--profile", "file", "is a file, not a folder")])  # fmt: skip
def test_an_output_path_that_cannot_be_written_is_one_line_before_the_bench_runs(
    tmp_path, capsys, monkeypatch, flag, where, named
):
    import vitrain.bench.step

    monkeypatch.setattr(vitrain.bench.step, "bench_step", lambda *a, **k: pytest.fail("the bench ran"))
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("kept")
    path = tmp_path / where
    assert main(["bench", "run", "digits", *tiny_overrides(tmp_path), flag, str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"vitrain: error: {flag} {path}: ") and named in err[0], err
    assert (tmp_path / "file").read_text() == "kept"


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--ladder", "--rows", ""], "--rows names no row (it is empty)"),  # it ran every row of the ladder
        (["--ladder", "--peers"], "argument --peers: not allowed with argument --ladder"),  # --peers was dropped
    ],
)
def test_bench_flags_that_would_run_another_benchmark_are_one_line(tmp_path, capsys, monkeypatch, flags, said):
    monkeypatch.setattr(ladder, "main", lambda *a, **k: pytest.fail("the ladder ran"))
    assert main(["bench", "run", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0], err


def test_dtype_from_precision_labels():
    assert dtype_key("fp32") == "fp32"
    assert dtype_key("amp_o1 bfloat16") == "bf16"
    assert dtype_key("pure float16") == "fp16"
    assert parse_peaks("fp32=0.15,bf16=0.4") == {
        "fp32": (0.15e12, "fp32 peak measured once by the ladder before its rows"),
        "bf16": (0.4e12, "bf16 peak measured once by the ladder before its rows"),
    }


def test_the_peak_memory_starts_over_from_what_the_process_holds_now():
    cpu = torch.device("cpu")
    big = torch.ones(2**25)  # 128 MiB, touched
    del big
    trim = glibc_function("malloc_trim")
    if trim is not None:  # the heap gives it back even where the trainer keeps freed memory (reuse_host_memory)
        trim(0)
    before, _ = peak_memory_bytes(cpu)
    if not reset_peak_memory(cpu):
        pytest.skip("this kernel has no /proc/self/clear_refs to reset the peak RSS")
    after, _ = peak_memory_bytes(cpu)
    assert after < before - 100 * 2**20


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_freed_host_memory_stays_in_the_heap_for_the_next_step():
    if not reuse_freed_host_memory():
        pytest.skip("the C library is not glibc: its allocator keeps its own policy")
    big = torch.ones(2**24)  # 64 MiB: glibc's default would map it afresh and unmap it when freed
    held = _resident_bytes()
    del big
    assert _resident_bytes() > held - 16 * 2**20  # still resident, to be reused


def test_the_trainer_keeps_freed_host_memory_unless_told_not_to(tmp_path, monkeypatch):
    from vitrain.engine import trainer as trainer_module

    calls = []
    monkeypatch.setattr(trainer_module, "reuse_freed_host_memory", lambda: calls.append(1))
    for switch, expected in (("true", [1]), ("false", [])):
        calls.clear()
        # The host memory setting is a CPU run's: a GPU run leaves the C library's allocator as it is.
        overrides = tiny_overrides(tmp_path / switch, f"train.reuse_host_memory={switch}", "train.device=cpu")
        cfg = load_config(None, overrides)
        trainer_module.Trainer(cfg).close()
        assert calls == expected


def test_gemm_peak_is_a_positive_rate():
    assert gemm_flops("fp32", torch.device("cpu"), size=256, repeats=2) > 1e8


def test_the_bf16_probe_times_the_two_dtypes_taking_turns(monkeypatch):
    # One call of each dtype per round: a busy spell of the machine slows a round, not one dtype's every call.
    import vitrain.device as device

    order, mm = [], torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: order.append(str(a.dtype)) or mm(a, b))
    flops = gemm_flops_taking_turns(("fp32", "bf16"), torch.device("cpu"), size=64, repeats=3)
    assert order == ["torch.float32", "torch.bfloat16"] * 4 and min(flops.values()) > 0  # a warm-up round, then 3
    monkeypatch.setattr(device, "gemm_flops_taking_turns", lambda *a, **k: {"fp32": 200e9, "bf16": 70e9})
    assert device.bf16_emulated(torch.device("cpu")) is None  # 2.9x slower: within the limit
    monkeypatch.setattr(device, "gemm_flops_taking_turns", lambda *a, **k: {"fp32": 200e9, "bf16": 10e9})
    assert "20x slower (bf16 emulated)" in device.bf16_emulated(torch.device("cpu"))


@pytest.mark.parametrize("emulated", [None, "a 512^3 bf16 matmul ran ... (bf16 emulated)"])
def test_the_cpu_peaks_time_bf16_at_the_probes_size_where_it_is_emulated(monkeypatch, emulated):
    # In software a 2048^3 bf16 product takes seconds a call: a ladder capped at AVX2 spent minutes on it.
    import vitrain.device as device

    sizes = []
    monkeypatch.setattr(device, "bf16_emulated_here", lambda device_type: emulated)
    monkeypatch.setattr(
        device, "gemm_flops", lambda dtype, on, size=2048, repeats=5: sizes.append((dtype, size)) or 1e9
    )
    peaks, why = device.cpu_gemm_peaks(torch.device("cpu"))
    bf16_size = device.PROBE_SIZE if emulated else 2048
    assert why == emulated and peaks == {"fp32": 1e9, "bf16": 1e9} and sizes == [("fp32", 2048), ("bf16", bf16_size)]
    sizes.clear()
    assert device.peak_flops(torch.device("cpu"), "bf16")[0] == 1e9 and sizes == [("bf16", bf16_size)]


# ------------------------------------------------------------------------------------------ ladder


def _context(nproc=2, deepspeed=True, fast=False):
    return ladder.Context(device="cpu", nproc=nproc, batch=16, deepspeed=deepspeed, fast_low_precision=fast)


def test_ladder_rows_follow_the_sources_order_and_add_one_change_each():
    rows = ladder.rows()
    names = [row.name for row in rows]
    assert names.index("+ multi-tensor optimizer") < names.index("+ pooled classifier") < names.index("+ AMP O2")
    ctx = _context()
    baseline = next(row for row in rows if row.name.startswith("baseline")).overrides(ctx)
    assert "precision.mode=amp_o1" in baseline and "optim.impl=loop" in baseline and "model.pool=cls" in baseline
    pooled = next(row for row in rows if row.name == "+ pooled classifier").overrides(ctx)
    assert "optim.impl=auto" in pooled and pooled[-1] == "model.pool=gap"
    # Later overrides win: the last pool value given is the one a row runs with.
    assert [o for o in pooled if o.startswith("model.pool")][-1] == "model.pool=gap"
    groups = {row.group for row in rows}
    assert len(groups) == 3


def test_ladder_rows_that_cannot_run_here_say_why():
    rows = {row.name: row for row in ladder.rows()}
    assert rows["zero3 + AMP O2"].needs(_context(nproc=1)) == "needs 2 or more processes (--nproc 1)"
    assert "DeepSpeed is not installed" in rows["DeepSpeed stage 3"].needs(_context(deepspeed=False))
    assert rows["+ AMP O2"].needs(_context(nproc=1)) is None
    # The DeepSpeed group computes in bf16 only where bf16 is fast.
    assert "precision.mode=fp32" in rows["DeepSpeed stage 2"].overrides(_context(fast=False))
    assert "precision.mode=amp_o2" in rows["DeepSpeed stage 2"].overrides(_context(fast=True))
    assert "parallel.offload=params" in rows["DeepSpeed stage 3 + offload"].overrides(_context())
    # bf16 gradients only where the group computes in bf16.
    assert "computes in fp32 here" in rows["native zero2, bf16 gradients"].needs(_context(fast=False))
    assert rows["DeepSpeed stage 2, bf16 gradients"].needs(_context(fast=True)) is None


def _summary():
    return {
        "model": "ViT-Ti/16 @ 224px",
        "device": "CPU: test",
        "torch": "2.13",
        "processes": 2,
        "threads_per_process": 1,
        "batch_per_rank": 16,
        "steps": 3,
        "warmup": 1,
        "comparison_precision": "fp32",
        "peaks_tflops_per_process": {"fp32": 0.09, "bf16": 0.2},
        "wall_s": 1.0,
        "command": "vitrain bench --ladder",
        "rows": [
            {
                "name": "baseline",
                "group": "g1",
                "status": "ok",
                "images_per_s": 10.0,
                "vs_baseline": 1.0,
                "step_ms": 3200.0,
                "breakdown_ms": {"data": 0.1, "forward": 1000.0, "backward": 2000.0, "optimizer": 200.0},
                "peak_memory_gib": 1.5,
                "mfu": 0.4,
                "precision": "amp_o1 bfloat16",
                "optimizer": "adamw[loop]",
            },
            {"name": "DeepSpeed stage 3", "group": "g2", "status": "skipped: DeepSpeed is not installed"},
        ],
    }


def test_ladder_table_keeps_skipped_rows_with_their_reason(tmp_path):
    markdown = ladder.to_markdown(_summary())
    assert "| baseline | 10.00 | 1.00x | 3200 | 1000 / 2000 / 200 | 1.50 | 0.400 |" in markdown
    assert "| DeepSpeed stage 3 | skipped: DeepSpeed is not installed |" in markdown
    ladder.draw_bars(_summary(), tmp_path / "ladder.png")
    with Image.open(tmp_path / "ladder.png") as image:
        assert image.format == "PNG" and image.width > 600 and image.height > 80


def _rounds_row(name: str, images_per_s_by_round, failures=(), mfu: float = 0.5) -> ladder.Row:
    """A ladder/scaling row whose rounds ran at these images/s (or failed with these reasons), settled over 3."""
    made = ladder.Row(name, "g", lambda ctx: [])
    for ips in images_per_s_by_round:
        made.rounds.append(
            {
                "images_per_s": ips,
                "step_s": 16 / ips,
                "breakdown_s": {"data": 0.0, "forward": 1.0, "backward": 2.0, "optimizer": 0.1},
                "peak_memory_bytes": 2**30,
                "mfu": mfu,
                **{k: "x" for k in ("precision", "optimizer", "engine", "strategy", "global_batch", "attention")},
                **{k: "x" for k in ("pool", "layout", "token_drop")},
            }
        )
    made.failures.extend(failures)
    ladder.settle(made, 3)
    return made


def test_ladder_rounds_give_each_row_its_median_spread_and_a_paired_ratio():
    row = _rounds_row
    # The machine slows down in round 3; the row stays 1.5x the baseline round by round.
    base = row("baseline", [10.0, 10.0, 5.0])
    fast = row("+ fast", [15.0, 15.0, 7.5])
    noisy = row("+ noisy", [9.0, 11.5, 5.0])
    broken = row("+ broken", [], failures=["boom"])
    partial = row("+ partial", [10.0, 12.0], failures=["once"])
    summary = ladder._summary(
        [base, fast, noisy, broken, partial], _context(), 1, 3, 1, {}, 1.0, load_config(None, []), ["x"], 3
    )
    rows = {r["name"]: r for r in summary["rows"]}
    assert (
        rows["+ fast"]["vs_baseline"] == pytest.approx(1.5) and not rows["+ fast"]["vs_baseline_spread"]["overlaps_1x"]
    )
    assert rows["+ fast"]["images_per_s"] == 15.0 and rows["+ fast"]["images_per_s_spread"]["min"] == 7.5
    assert rows["+ noisy"]["vs_baseline_spread"]["overlaps_1x"]
    assert rows["+ broken"]["status"] == "failed: boom" and "images_per_s" not in rows["+ broken"]
    assert rows["+ partial"]["status"] == "1 of 3 rounds failed: once" and rows["+ partial"]["vs_baseline"] is None
    markdown = ladder.to_markdown(summary)
    assert "| + fast | 15.00 (7.50-15.00) | 1.50x (1.50-1.50) |" in markdown
    assert "| + noisy | 9.00 (5.00-11.50) | 1.00x (0.90-1.15) ~ |" in markdown


def test_ladder_pairs_native_zero_stages_with_deepspeeds_round_by_round():
    row = _rounds_row
    native2 = row("native zero2", [12.0, 11.0, 6.0])
    native2.rounds[0]["wrap"] = native2.result["wrap"] = "model"
    deepspeed2 = row("DeepSpeed stage 2", [10.0, 11.0, 5.0])
    native3 = row("native zero3", [9.0, 9.0])  # a round fewer: no paired figure
    deepspeed3 = row("DeepSpeed stage 3", [10.0, 10.0, 10.0])
    blocking2 = row("native zero2, collectives blocking", [10.0, 11.0, 5.0])
    blocking2.rounds[0]["wrap"] = blocking2.result["wrap"] = "model"
    hooks2 = row("native zero2, norm cast hooks", [11.0, 11.0, 6.0])
    scattering2 = row("native zero2, FSDP2 reduce-scatter", [12.0, 10.0, 6.0])
    summary = ladder._summary(
        [native2, deepspeed2, native3, deepspeed3, blocking2, hooks2, scattering2],
        *(_context(), 1, 3, 1, {}, 1.0, load_config(None, []), ["x"], 3),
    )
    # parallel.overlap_comm's effect pairs the same way, each side's unit named.
    (overlap,) = summary["overlap_vs_blocking"]
    assert overlap["images_per_s_ratio"]["median"] == pytest.approx(1.2)
    assert "| native zero2 (unit: model) | native zero2, collectives blocking (unit: model) | 1.20x" in (
        ladder.to_markdown(summary)
    )
    (norms,) = summary["compiled_norms_vs_hooks"]  # precision.compile_norms's effect, the same way
    assert (norms["compiled"], norms["hooks"]) == ("native zero2", "native zero2, norm cast hooks")
    assert norms["images_per_s_ratio"]["median"] == pytest.approx(1.0)
    (reduce,) = summary["grad_reduce_vs_reduce_scatter"]  # parallel.grad_reduce's effect, the same way
    assert reduce["reduce_scatter"] == "native zero2, FSDP2 reduce-scatter"
    assert reduce["images_per_s_ratio"]["median"] == pytest.approx(1.0) and "parallel.grad_reduce" in (
        ladder.to_markdown(summary)
    )
    rows = {r["name"]: r for r in summary["rows"]}
    assert rows["native zero2"]["images_per_s_rounds"] == [12.0, 11.0, 6.0]  # round order, for any other pairing
    (pair,) = summary["native_vs_deepspeed"]
    assert pair["native"] == "native zero2" and pair["deepspeed"] == "DeepSpeed stage 2"
    assert pair["images_per_s_ratio"]["median"] == pytest.approx(1.2) and pair["images_per_s_ratio"]["overlaps_1x"]
    assert "| native zero2 (FSDP2 unit: model) | DeepSpeed stage 2 | 1.20x (1.00-1.20) ~ | 1.00 / 1.00 |" in (
        ladder.to_markdown(summary)
    )


def test_ladder_peak_memory_is_the_largest_over_the_rounds_not_the_median_rounds():
    native = _rounds_row("native zero3", [9.0, 10.0, 11.0])  # the median round (10 images/s) held the least
    for round_, gib in zip(native.rounds, (1.25, 0.75, 1.0), strict=True):
        round_["peak_memory_bytes"] = int(gib * 2**30)
    deepspeed = _rounds_row("DeepSpeed stage 3", [9.0, 9.0, 9.0])
    summary = ladder._summary([native, deepspeed], *(_context(), 1, 3, 1, {}, 1.0, load_config(None, []), ["x"], 3))
    rows = {r["name"]: r for r in summary["rows"]}
    assert rows["native zero3"]["peak_memory_gib"] == pytest.approx(1.25)
    assert rows["native zero3"]["peak_memory_gib_rounds"] == pytest.approx([1.25, 0.75, 1.0])
    (pair,) = summary["native_vs_deepspeed"]
    assert pair["peak_memory_gib"] == pytest.approx([1.25, 1.0])


def test_ladder_rows_are_picked_by_whole_name_or_by_part():
    rows = ladder.rows()
    picked = [r.name for r in ladder.asked_for(rows, "DeepSpeed stage 2,native zero")]
    # A whole name picks that row alone (not "DeepSpeed stage 2 + optimizer offload"); a part, every row with it.
    assert picked[:4] == ["native zero1", "native zero2", "native zero3", "DeepSpeed stage 2"]
    assert picked[4:] == [
        "native zero2, collectives blocking",
        "native zero3, collectives blocking",
        "native zero2, FSDP2 reduce-scatter",
        "native zero3, FSDP2 reduce-scatter",
        "native zero2, norm cast hooks",
        "native zero3, norm cast hooks",
        "native zero2, bf16 gradients",
    ]
    assert len(ladder.asked_for(rows, "DeepSpeed stage")) == 5 and ladder.asked_for(rows, None) == rows


def test_ladder_runs_rows_in_their_own_processes(tmp_path, monkeypatch):
    monkeypatch.setattr(ladder, "default_nproc", lambda device: 1)
    # Peaks handed to the rows, bf16 taken as fast: the baseline row computes in bf16 on every CPU kind (its tiny
    # model's steps stay short where bf16 runs in software).
    monkeypatch.setattr(ladder, "cpu_gemm_peaks", lambda device: ({"fp32": 100e9, "bf16": 300e9}, None))
    args = argparse.Namespace(steps=1, warmup=1, out=str(tmp_path / "out"), nproc=1, rows="fp32 reference,baseline")
    overrides = tiny_overrides(tmp_path, "train.batch_size=8", "data.mean=[0.5]", "data.std=[0.5]")
    assert ladder.main(None, overrides, args) == 0
    summary = json.loads((tmp_path / "out" / "ladder.json").read_text())
    rows = {row["name"]: row for row in summary["rows"]}
    base = rows["baseline: DDP + AMP O1 bf16, per-tensor AdamW, class token"]
    assert base["vs_baseline"] == 1.0 and base["precision"] == "amp_o1 bfloat16" and base["optimizer"] == "adamw[loop]"
    assert rows["fp32 reference"]["precision"] == "fp32" and 0 < rows["fp32 reference"]["vs_baseline"]
    assert rows["zero3 + AMP O2"]["status"] == "skipped: needs 2 or more processes (--nproc 1)"
    assert rows["+ pooled classifier"]["status"].startswith("skipped: not asked for")
    assert (tmp_path / "out" / "ladder.md").exists() and (tmp_path / "out" / "ladder.png").exists()


def test_where_this_cpu_emulates_bf16_the_rows_that_compute_in_bf16_are_skipped_with_the_reason():
    why = "a 512^3 bf16 matmul ran at 2.5 GFLOP/s against fp32's 183.0 here, 72x slower (bf16 emulated)"
    ctx = ladder.Context("cpu", nproc=2, batch=16, deepspeed=True, fast_low_precision=False, bf16_emulated=why)
    skipped = {row.name for row in ladder.rows() if ladder._emulated(row, ctx)}
    ran = {row.name for row in ladder.rows()} - skipped
    # The sources' fp32 reference, autotune's row (it races no bf16 here) and the comparison groups (fp32 here) run.
    assert ran == {"fp32 reference", "vitrain auto (precision, attention by measurement)"} | {
        row.name for row in ladder.rows() if row.group == "DeepSpeed vs native (same precision)"
    }
    assert "baseline: DDP + AMP O1 bf16, per-tensor AdamW, class token" in skipped and "zero2 + AMP O2" in skipped
    row = next(r for r in ladder.rows() if r.name.startswith("baseline"))
    assert ladder._emulated(row, ctx).startswith("computes in bf16, which this CPU runs in software")
    assert ladder._emulated(row, dataclasses.replace(ctx, dtype="fp16"))  # the row names bf16 itself
    assert ladder._emulated(row, dataclasses.replace(ctx, bf16_emulated=None)) is None
    o2 = ladder.Row("o2", "g", lambda ctx: ["precision.mode=amp_o2"])  # the config's low dtype
    assert ladder._emulated(o2, ctx) and ladder._emulated(o2, dataclasses.replace(ctx, dtype="fp16")) is None


def test_autotune_races_once_before_the_rounds_and_its_pass_is_not_a_round(monkeypatch):
    monkeypatch.setenv("VITRAIN_AUTOTUNE", "1")
    calls = []

    def fake_run_row(row, config, overrides, nproc, steps, warmup, peaks_arg, threads):
        calls.append((row.name, steps, warmup))
        row.rounds.append({"images_per_s": 1.0})

    monkeypatch.setattr(ladder, "run_row", fake_run_row)
    fixed = ["model.attention=sdpa", "precision.mode=amp_o2"]
    rows = {
        "native zero2": ["parallel.strategy=zero2", *fixed],  # parallel.wrap=auto: autotune races the unit
        "DeepSpeed stage 2": ["parallel.strategy=zero2", "train.engine=deepspeed", *fixed],
        "native DDP, all fixed": ["parallel.strategy=ddp", *fixed],
    }
    made = {name: ladder.Row(name, "g", lambda ctx: []) for name in rows}
    for name, overrides in rows.items():
        ladder.tune_first(made[name], None, overrides, 2, "", 1, "cpu")
    assert calls == [("native zero2", 1, 0)]  # one untimed step where autotune races; nothing to race elsewhere
    assert all(row.rounds == [] for row in made.values())  # the pass's figures are dropped
    monkeypatch.setenv("VITRAIN_AUTOTUNE", "0")  # autotune off: nothing races anywhere
    ladder.tune_first(made["native zero2"], None, rows["native zero2"], 2, "", 1, "cpu")
    assert len(calls) == 1


def test_bench_optim_defaults_to_the_kernels_each_optimizer_has():
    assert default_impls("adamw") == ("loop", "foreach", "fused", "flat", "auto")
    assert default_impls("lamb") == ("loop", "foreach", "auto")
    assert default_impls("muon") == ("foreach", "auto")


def test_bench_optim_times_muon_with_the_newton_schulz_dtype_asked_for(tiny_cfg, monkeypatch):
    seen = []

    def recording(matrix, steps=5, dtype=torch.float32):
        seen.append(dtype)
        return original(matrix, steps, dtype)

    original = muon_module.orthogonalize
    monkeypatch.setattr(muon_module, "orthogonalize", recording)
    params, timings = bench_optimizer_step(
        tiny_cfg.model, OptimConfig(name="muon"), ("foreach", "auto"), steps=2, warmup=1, ns_dtype=torch.bfloat16
    )
    assert params > 0 and [t.resolved for t in timings] == ["foreach", "foreach"]
    assert all(t.ms_per_step > 0 and t.speedup_vs_loop is None for t in timings)  # muon has no loop kernel
    assert seen and set(seen) == {torch.bfloat16}


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--optimizer", "lamb", "--impls", "fused"], "--impls"),
        (["--optimizer", "muon", "--impls", "flat"], "--impls"),
        (["--optimizer", "adamw", "--ns-dtype", "bfloat16"], "--ns-dtype"),
    ],
)
def test_bench_optim_refuses_a_kernel_the_optimizer_lacks_in_one_line(argv, named, capsys):
    assert main(["bench", "optim", "--model", "vit_tiny_patch16", "--steps", "1", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0]


# ------------------------------------------------------------------------------------------ scaling


def test_scaling_layouts_keep_the_global_batch_and_use_every_core():
    rows = scaling.layouts("cpu", nproc=2, cores=2)
    assert rows[0] == ("1 process x 2 threads, single", "single", 1, 2)
    assert [r[1:] for r in rows[1:]] == [("ddp", 2, 1), ("zero2", 2, 1), ("zero3", 2, 1)]
    assert rows[1][0] == "2 processes x 1 thread(s), ddp"


def test_scaling_efficiency_is_paired_with_the_one_process_row_round_by_round():
    def row(name, rounds_ips):
        return _rounds_row(name, rounds_ips, mfu=0.4)

    one = row("1 process x 2 threads, single", [20.0, 20.0, 10.0])
    ddp = row("2 processes x 1 thread(s), ddp", [18.0, 18.0, 9.0])  # 0.9x in every round, the machine slowing alike
    zero3 = row("2 processes x 1 thread(s), zero3", [21.0, 15.0, 10.0])
    summary = scaling._summary(
        [one, ddp, zero3], "cpu", 2, 2, 32, ["precision.mode=fp32"], 3, 1, 3, {}, load_config(None, [])
    )
    rows = {r["name"]: r for r in summary["rows"]}
    assert rows["2 processes x 1 thread(s), ddp"]["efficiency"] == pytest.approx(0.9)
    assert rows["2 processes x 1 thread(s), ddp"]["efficiency_spread"]["max"] == pytest.approx(0.9)
    assert rows["2 processes x 1 thread(s), zero3"]["efficiency_spread"]["overlaps_1x"]
    markdown = scaling.to_markdown(summary)
    assert "| 2 processes x 1 thread(s), ddp | 18.00 (9.00-18.00) | 0.90x (0.90-0.90) | 0.400 |" in markdown
    assert "| 2 processes x 1 thread(s), zero3 | 15.00 (10.00-21.00) | 1.00x (0.75-1.05) ~ |" in markdown
    assert markdown.splitlines()[-1].endswith("| x | x |")  # precision, then the attention kernel the row ran


@pytest.mark.slow  # 4 rows in their own processes, 3 of them under torchrun: the table's logic is tested above
def test_scaling_runs_one_process_against_two_and_pairs_their_rounds(tmp_path):
    args = argparse.Namespace(steps=1, warmup=1, out=str(tmp_path / "out"), nproc=2, repeats=1)
    overrides = tiny_overrides(tmp_path, "train.batch_size=8", "data.mean=[0.5]", "data.std=[0.5]")
    assert scaling.main(None, overrides, args) == 0
    summary = json.loads((tmp_path / "out" / "scaling.json").read_text())
    rows = {row["name"]: row for row in summary["rows"]}
    assert list(rows)[0] == "1 process x 2 threads, single" and rows["1 process x 2 threads, single"]["efficiency"] == 1
    for strategy in ("ddp", "zero2", "zero3"):
        row = rows[f"2 processes x 1 thread(s), {strategy}"]
        assert row["status"] == "ok" and row["efficiency"] > 0 and 0 < row["mfu"] < 2, row
        assert "--nproc-per-node=2" in row["command"] and "train.batch_size=4" in row["command"]
    assert (
        summary["global_batch"] == 8
        and "| 2 processes x 1 thread(s), zero3 |" in (tmp_path / "out" / "scaling.md").read_text()
    )


def test_scaling_refuses_a_global_batch_that_does_not_divide():
    args = argparse.Namespace(steps=1, warmup=1, out=None, nproc=2, repeats=1)
    with pytest.raises(ConfigError, match=r"train.batch_size=7 \(the global batch\) must divide by --nproc=2"):
        scaling.main(None, ["train.batch_size=7"], args)
