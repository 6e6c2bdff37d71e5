"""Faults end runs cleanly and lose nothing: NaN guard, a full disk or a bad weight on one rank, SIGKILL, restarts."""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, model_overrides
from tests.distributed_helpers import MODEL, free_port, gpu_free_env, losses, tiny_config, torchrun_env
from vitrain import checkpoint as ckpt
from vitrain.engine import Trainer
from vitrain.engine.step import TrainStep
from vitrain.models import create_model
from vitrain.precision import TrainingDiverged

RUNNER = REPO / "tests" / "fault_runner.py"
PRECISIONS = {"fp32": {"mode": "fp32"}, "bf16": {"mode": "amp_o1", "dtype": "bf16"}}


def every_checkpoint_is_finite(run_dir: Path) -> bool:
    """Each complete checkpoint of a run: its model weights and optimizer state hold no inf/NaN."""
    for step in ckpt.step_dirs(run_dir):
        index = ckpt.read_index(step)
        state = {
            key: torch.empty(md.size, dtype=md.properties.dtype)
            for key, md in index.items()
            if hasattr(md, "properties") and key.startswith(("model.", "optim.state."))
        }
        ckpt.load_extra(step, state)
        for tensor in state.values():
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                return False
    return True


def _nan_loss_at(monkeypatch, steps: set[int]) -> None:
    """Make the training loss NaN on the given (1-based) optimizer steps, as a diverging batch would."""
    original_loss, original_step = TrainStep.loss, TrainStep.__call__
    stepping = [0]  # the optimizer step now running

    def step(self, *args, **kwargs):
        stepping[0] += 1
        return original_step(self, *args, **kwargs)

    def loss(self, images, labels):
        value = original_loss(self, images, labels)
        return value * float("nan") if stepping[0] in steps else value

    monkeypatch.setattr(TrainStep, "__call__", step)
    monkeypatch.setattr(TrainStep, "loss", loss)


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_nan_loss_steps_are_skipped_and_logged_and_training_continues(tmp_path, monkeypatch, precision):
    _nan_loss_at(monkeypatch, {3, 5, 6})
    cfg = tiny_config(tmp_path, "nan", train={"max_steps": 8}, precision=PRECISIONS[precision])
    summary = Trainer(cfg).fit()
    assert summary["steps"] == 8 and math.isfinite(losses(cfg.run_dir)[8])
    records = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    skipped = [(r["step"], r["nonfinite_in_a_row"]) for r in records if r.get("skipped")]
    assert skipped == [(3, 1), (5, 1), (6, 2)]
    assert "step 3: loss or gradients hold inf/NaN: step skipped" in (cfg.run_dir / "log.txt").read_text()
    assert every_checkpoint_is_finite(cfg.run_dir)


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_nan_loss_beyond_the_allowed_skips_stops_the_run_with_finite_checkpoints(tmp_path, monkeypatch, precision):
    _nan_loss_at(monkeypatch, set(range(4, 100)))
    train = {"max_steps": 20, "checkpoint_every_steps": 2}
    cfg = tiny_config(tmp_path, "diverge", train=train, precision={**PRECISIONS[precision], "max_nonfinite_skips": 2})
    with pytest.raises(TrainingDiverged, match="inf/NaN 3 steps in a row .*precision.max_nonfinite_skips=2"):
        Trainer(cfg).fit()
    # Steps 4 and 5 were skipped (weights untouched, step 4 still saved); step 6 stopped the run before its save.
    assert [p.name for p in ckpt.step_dirs(cfg.run_dir)] == ["step_00000002", "step_00000003", "step_00000004"]
    assert every_checkpoint_is_finite(cfg.run_dir)


def test_non_finite_optimizer_state_is_never_saved_under_zero1(tmp_path):
    from vitrain.parallel import shutdown

    cfg = tiny_config(tmp_path, "zero1", train={"max_steps": 2}, parallel={"strategy": "zero1"})
    try:
        trainer = Trainer(cfg)  # one process in a one-process group: ZeroRedundancyOptimizer owns every shard
        trainer.fit()
        before = [p.name for p in ckpt.step_dirs(cfg.run_dir)]
        moments = next(iter(trainer.engine.optimizer.optim.state.values()))
        next(v for v in moments.values() if v.ndim).view(-1)[0] = float("nan")
        trainer.step += 1
        with pytest.raises(TrainingDiverged, match="optimizer state .* holds inf/NaN"):
            trainer.save()
        assert [p.name for p in ckpt.step_dirs(cfg.run_dir)] == before
    finally:
        shutdown()


def test_non_finite_weights_are_never_saved(tmp_path):
    cfg = tiny_config(tmp_path, "bad", train={"max_steps": 2})
    trainer = Trainer(cfg)
    trainer.fit()
    before = [p.name for p in ckpt.step_dirs(cfg.run_dir)]
    with torch.no_grad():
        next(trainer.model.parameters()).view(-1)[0] = float("inf")
    trainer.step += 1
    with pytest.raises(TrainingDiverged, match="holds inf/NaN: training diverged, so it is not saved"):
        trainer.save()
    assert [p.name for p in ckpt.step_dirs(cfg.run_dir)] == before


# ------------------------------------------------------------------------------------------ two ranks, one fails


def _two_rank_cli(tmp_path: Path, fault: str, *args: str) -> list[tuple[int, str, float]]:
    """Both ranks of a gloo job as separate processes (as torchrun starts them): [(exit code, stderr, exit time)]."""
    port = free_port()
    env_base = {**os.environ, "VITRAIN_FAULT_LOG": str(tmp_path / "fault"), **gpu_free_env(2)}
    procs, logs = [], []
    try:
        for rank in range(2):
            logs.append(open(tmp_path / f"stderr.{rank}", "w+"))  # files, not pipes: no rank blocks on a full pipe
            env = {**env_base, **torchrun_env(rank, port)}
            cmd = [sys.executable, str(RUNNER), fault, "train", *args]
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=logs[-1]))
        exited: dict[int, float] = {}
        deadline = time.time() + 180
        while len(exited) < 2 and time.time() < deadline:
            for rank, proc in enumerate(procs):
                if rank not in exited and proc.poll() is not None:
                    exited[rank] = time.time()
            time.sleep(0.05)
        assert len(exited) == 2, "a rank did not exit within 180 s"
        results = []
        for rank, (proc, log) in enumerate(zip(procs, logs, strict=True)):
            log.seek(0)
            results.append((proc.returncode, log.read(), exited[rank]))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()


def _fault_time(tmp_path: Path) -> float:
    times = [float(p.read_text().split()[0]) for p in tmp_path.glob("fault.*")]
    assert times, "the fault never fired"
    return min(times)


def _last_line(stderr: str) -> str:
    return stderr.strip().splitlines()[-1]


TWO_RANK_ARGS = [
    *model_overrides(MODEL),  # tiny_config's model: a run is resumed with it
    "data.source=synthetic", "data.synthetic_samples=64", "train.batch_size=8",
    "train.epochs=3", "train.threads=1", "train.checkpoint_every_steps=2", "precision.mode=fp32",
    "log.progress=false", "log.every_steps=1",
]  # fmt: skip


# slow: 9 s on a Zen 4; an unwritable run folder ends both ranks in one line in the default suite
@pytest.mark.slow
def test_a_full_disk_on_one_rank_ends_both_ranks_with_one_line_and_keeps_the_last_checkpoint(tmp_path):
    out = tmp_path / "runs"
    args = [*TWO_RANK_ARGS, f"log.out_dir={out}", "name=full", "parallel.strategy=zero3"]
    results = _two_rank_cli(tmp_path, "enospc:1:2", *args)
    fault_at = _fault_time(tmp_path)
    lines = set()
    for code, stderr, exited_at in results:
        assert code == 2, stderr
        assert exited_at - fault_at < 30
        assert "Traceback" not in stderr
        lines.add(_last_line(stderr))
    assert len(lines) == 1
    (line,) = lines
    assert line.startswith("vitrain: error: saving checkpoint") and "failed on rank 1" in line
    assert "No space left on device; free space on that disk and run the same command again" in line
    run_dir = out / "full"
    assert [p.name for p in ckpt.step_dirs(run_dir)] == ["step_00000002"]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    resumed = Trainer(tiny_config(out, "full", parallel={"strategy": "zero3"}, train={"max_steps": 6}), resume=True)
    assert resumed.resume_path == run_dir / "checkpoints" / "step_00000002"
    assert resumed.fit()["steps"] == 6


def test_a_non_finite_weight_on_one_rank_ends_both_ranks_with_the_same_line(tmp_path):
    out = tmp_path / "runs"
    args = [*TWO_RANK_ARGS, f"log.out_dir={out}", "name=nan", "parallel.strategy=zero3"]
    results = _two_rank_cli(tmp_path, "nan_weight:1:2", *args)
    fault_at = _fault_time(tmp_path)
    lines = {_last_line(stderr) for _, stderr, _ in results}
    assert [code for code, _, _ in results] == [2, 2], results
    assert all(exited_at - fault_at < 30 for _, _, exited_at in results)
    assert len(lines) == 1 and "holds inf/NaN: training diverged, so it is not saved" in lines.pop()
    assert [p.name for p in ckpt.step_dirs(out / "nan")] == ["step_00000002"]


def test_an_unwritable_run_folder_ends_both_ranks_with_one_line(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the runs folder should be")
    args = [*TWO_RANK_ARGS, f"log.out_dir={blocker / 'runs'}", "name=x", "parallel.strategy=ddp"]
    results = _two_rank_cli(tmp_path, "none", *args)
    assert [code for code, _, _ in results] == [2, 2]
    lines = {_last_line(stderr) for _, stderr, _ in results}
    line = lines.pop()
    assert not lines and line.startswith(f"vitrain: error: log.out_dir={blocker / 'runs'}: cannot"), line
    assert f"{blocker} is a file" in line
    assert blocker.read_text() == "a file where the runs folder should be"


# ------------------------------------------------------------------------------------------ SIGKILL anywhere

KILL_ARGS = [
    *model_overrides(dataclasses.replace(MODEL, image_size=16)),
    "model.drop_path=0.1", "model.dropout=0.1", "data.source=synthetic",
    "data.synthetic_samples=80", "data.crop_padding=2", "data.hflip=0.5", "train.batch_size=8", "train.epochs=12",
    "train.threads=1", "train.checkpoint_every_steps=3", "train.keep_checkpoints=2", "precision.mode=fp32",
    "log.progress=false", "log.every_steps=5",
]  # fmt: skip


def _run(fault: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(RUNNER), fault, "train", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from vitrain.config import config_from_dict

    step = ckpt.latest(run_dir)
    model = create_model(config_from_dict(ckpt.read_meta(step)["config"]).model)
    ckpt.load_model_weights(step, model)
    return model.state_dict()


def kill_and_resume(tmp_path: Path, kills: int, in_writes: int, seed: int) -> None:
    """SIGKILL a run `kills` times (`in_writes` of them inside a checkpoint write), resuming after each; the final
    weights must equal an uninterrupted run's bit for bit."""
    out = tmp_path / "runs"
    common = [*KILL_ARGS, f"log.out_dir={out}"]
    reference = _run("none", *common, "name=reference")
    assert reference.returncode == 0, reference.stderr
    rng = random.Random(seed)
    plan = ["write"] * in_writes + ["anywhere"] * (kills - in_writes)
    rng.shuffle(plan)
    history = []
    for i, where in enumerate(plan):
        # Inside a write: the OP-th fsync/rename/replace/rmtree from the start of this process's SAVE-th save.
        # Anywhere: a random delay after a random step (a step, an evaluation, a save or the loader).
        fault = f"kill_op:{rng.randint(1, 2)}:{rng.randint(1, 24)}" if where == "write" else (
            f"kill_after:{rng.randint(1, 6)}:{rng.randint(0, 60)}"
        )  # fmt: skip
        resume = ["--resume"] if i else []
        killed = _run(fault, *common, "name=victim", *resume)
        history.append(fault)
        assert killed.returncode == -9, f"kill {i} ({fault}) did not land: exit {killed.returncode}\n{killed.stderr}"
    finished = _run("none", *common, "name=victim", "--resume")
    assert finished.returncode == 0, f"after kills {history}: {finished.stderr}"
    want, got = _final_weights(out / "reference"), _final_weights(out / "victim")
    steps = [json.loads((out / name / "summary.json").read_text())["steps"] for name in ("reference", "victim")]
    assert steps[0] == steps[1] == 108  # 12 epochs of 9 steps
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), f"{key} differs after kills {history}"


# slow: 36 s on a Zen 4; the default run kills workers under torchrun and during writes in the tests beside it
@pytest.mark.slow
def test_sigkill_at_random_moments_and_inside_writes_then_resume_is_bit_for_bit(tmp_path):
    kill_and_resume(tmp_path, kills=3, in_writes=2, seed=1)  # the slow test below kills 20 times


@pytest.mark.slow
def test_sigkill_at_20_random_moments_8_inside_writes_then_resume_is_bit_for_bit(tmp_path):
    kill_and_resume(tmp_path, kills=20, in_writes=8, seed=2026)


# ------------------------------------------------------------------------------------------ torchrun restarts


def _torchrun(*args: str, max_restarts: int = 0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.1", "--no-python",
            sys.executable, str(RUNNER), *args,
        ],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, **gpu_free_env(2)},
    )  # fmt: skip


def test_torchrun_restarts_a_killed_worker_and_the_run_ends_as_if_never_interrupted(tmp_path):
    out = tmp_path / "runs"
    common = [*TWO_RANK_ARGS, "train.epochs=5", f"log.out_dir={out}", "parallel.strategy=ddp"]
    reference = _torchrun("none", "train", *common, "name=reference")
    assert reference.returncode == 0, reference.stderr
    # Rank 1 is SIGKILLed after its 13th step on the first try; torchrun restarts both workers once.
    restarted = _torchrun("kill_step:1:13", "train", *common, "name=victim", max_restarts=1)
    assert restarted.returncode == 0, restarted.stderr
    log = (out / "victim" / "log.txt").read_text()
    step12 = out / "victim" / "checkpoints" / "step_00000012"
    assert f"torchrun restart: continuing {out / 'victim'} from {step12}" in log
    assert not (out / "victim-1").exists()
    expected, got = losses(out / "reference"), losses(out / "victim")  # the last record of each step counts
    assert sorted(got) == sorted(expected) == list(range(1, 16))  # 5 epochs of 3 steps
    assert got == expected
    want, have = _final_weights(out / "reference"), _final_weights(out / "victim")
    assert all(torch.equal(have[k], v) for k, v in want.items())


@pytest.mark.parametrize(
    "error, fix",
    [
        (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"), "the disk is most"),
        (OSError(errno.EROFS, "Read-only file system"), "; make that folder writable, or point log.out_dir"),
        (OSError(errno.EACCES, "Permission denied"), "; make that folder writable, or point log.out_dir"),
        (ValueError("something else"), None),
    ],
)
def test_a_write_the_file_system_refused_says_what_to_do(error, fix):
    from vitrain.parallel.distributed import _failure_message

    line = _failure_message("saving checkpoint runs/x/checkpoints/step_00000002", error, 0)
    assert line.startswith("saving checkpoint runs/x/checkpoints/step_00000002 failed: ")
    assert (fix in line) if fix is not None else line.endswith(": something else")
