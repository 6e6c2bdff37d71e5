"""The training loop: summary and logs, checkpoints, exact resume, and runs that refuse to clobber work."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

from tests.conftest import REPO, run_cli, tiny_overrides
from vitrain import checkpoint as ckpt
from vitrain.config import load_config
from vitrain.engine import Trainer
from vitrain.engine.runlog import progress_bar
from vitrain.errors import CheckpointError
from vitrain.models import create_model


def snapshot(folder) -> dict[str, bytes]:
    """Every file under a folder with its bytes, to show that nothing in it changed."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def read_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def step_records(run_dir) -> dict[int, dict]:
    """Last record logged for each training step (a killed run may have logged steps it did not save)."""
    return {r["step"]: r for r in read_metrics(run_dir) if "loss" in r}


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("stream", "jupyter", "enabled", "drawn"),
    [
        (_Terminal, False, True, True),
        (_Terminal, False, False, False),  # log.progress=false
        (io.StringIO, False, True, False),  # a file or a CI log
        (io.StringIO, True, True, True),  # a notebook's output, not a terminal either
    ],
)
def test_the_progress_bar_draws_only_where_its_redraws_render(monkeypatch, stream, jupyter, enabled, drawn):
    monkeypatch.setattr(sys, "stderr", stream())
    if jupyter:
        monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
    else:
        monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    bar = progress_bar(3, 0, "epoch 1/1", enabled)
    bar.update(3)
    bar.close()
    assert bool(sys.stderr.getvalue()) == drawn


def test_short_run_writes_summary_logs_and_checkpoints(tmp_path):
    cfg = load_config(None, tiny_overrides(tmp_path, "train.epochs=2"))
    summary = Trainer(cfg).fit()
    run_dir = cfg.run_dir
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert on_disk == summary
    for key in ("val_top1", "images_per_s", "wall_s", "epochs", "params", "checkpoint"):
        assert key in summary
    assert 0.0 <= summary["val_top1"] <= 1.0 and summary["images_per_s"] > 0
    assert summary["epochs"] == 2 and summary["steps"] == 2 * (1437 // 64)
    assert ckpt.latest(run_dir) is not None and ckpt.best(run_dir) is not None
    assert summary["checkpoint"] == str(ckpt.latest(run_dir))
    assert [p.name for p in (run_dir / "checkpoints").iterdir() if "tmp" in p.name] == [], "temporaries must go"
    evals = [r for r in read_metrics(run_dir) if "val_top1" in r]
    assert [r["epoch"] for r in evals] == [1, 2]


@pytest.mark.slow  # the whole 30-epoch recipe, 60-90 s: pytest -m slow (the README's first command runs it too)
def test_digits_recipe_reaches_95_percent_on_held_out_digits(tmp_path):
    """README command 1: the default recipe on scikit-learn's real digits, held-out 20% split."""
    from vitrain.config import CONFIG_DIR

    # fp32 on any CPU: the accuracy bar is the fp32 recipe's (auto would pick bf16 where the CPU has AMX).
    overrides = [f"log.out_dir={tmp_path}", "log.progress=false", "precision.mode=fp32"]
    cfg = load_config(CONFIG_DIR / "digits.yaml", overrides)
    summary = Trainer(cfg).fit()
    assert summary["val_top1"] >= 0.95
    losses = [r["loss"] for r in read_metrics(cfg.run_dir) if "loss" in r]
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5])


@pytest.fixture(scope="module")
def big_and_accumulated(tmp_path_factory):
    """The same 3 steps of 64 images, as one batch of 64 and as 2 accumulated micro-batches of 32 (configs, trained)."""
    out = tmp_path_factory.mktemp("accumulation")
    big = load_config(None, tiny_overrides(out, "name=big", "train.batch_size=64", "train.max_steps=3"))
    acc = load_config(
        None, tiny_overrides(out, "name=acc", "train.batch_size=32", "train.accum_steps=2", "train.max_steps=3")
    )
    Trainer(big).fit()
    Trainer(acc).fit()
    return big, acc


def test_gradient_accumulation_matches_one_large_batch(big_and_accumulated):
    big, acc = big_and_accumulated
    a, b = create_model(big.model), create_model(acc.model)
    ckpt.load_model_weights(ckpt.latest(big.run_dir), a)
    ckpt.load_model_weights(ckpt.latest(acc.run_dir), b)
    # Same samples per step in a different grouping: equal up to float summation order, not bitwise.
    for (key, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5, msg=key)


def test_an_accumulated_step_logs_the_mean_loss_of_its_micro_batches(big_and_accumulated):
    # A step of 64 images logs their mean loss, whether they came as one batch or as 2 micro-batches of 32; before,
    # the accumulated step logged its last micro-batch's alone (step 1: 2.325479 against 2.325912, grad_norm equal).
    big, acc = big_and_accumulated
    expected, got = step_records(big.run_dir), step_records(acc.run_dir)
    assert sorted(got) == sorted(expected) == [1, 2, 3]
    for step, record in expected.items():
        assert got[step]["loss"] == pytest.approx(record["loss"], abs=1e-6), f"step {step}"
        assert got[step]["grad_norm"] == pytest.approx(record["grad_norm"], rel=1e-5), f"step {step}"


def test_rerun_without_resume_starts_a_new_folder_and_keeps_the_checkpoint(tmp_path):
    cfg = load_config(None, tiny_overrides(tmp_path, "train.max_steps=2"))
    Trainer(cfg).fit()
    before = snapshot(cfg.run_dir)
    second = Trainer(cfg)
    assert second.run_dir == cfg.run_dir.with_name("run-1")
    summary = second.fit()
    assert summary["checkpoint"].startswith(str(cfg.run_dir.with_name("run-1")))
    assert snapshot(cfg.run_dir) == before


def test_resume_with_another_model_is_refused_and_keeps_the_checkpoint(tmp_path):
    cfg = load_config(None, tiny_overrides(tmp_path, "train.max_steps=2"))
    Trainer(cfg).fit()
    before = snapshot(cfg.run_dir / "checkpoints")
    other = load_config(None, tiny_overrides(tmp_path, "train.max_steps=2", "model.width=64"))
    with pytest.raises(CheckpointError, match=r"was trained with model.width=32, this run has 64"):
        Trainer(other, resume=True).fit()
    assert snapshot(cfg.run_dir / "checkpoints") == before


def test_a_max_steps_stop_on_an_epochs_last_step_counts_the_epoch_and_a_resume_finds_nothing_left(tmp_path, capfd):
    whole = Trainer(load_config(None, tiny_overrides(tmp_path, "name=whole")))
    steps = whole.steps_per_epoch
    whole.close()
    cfg = load_config(None, tiny_overrides(tmp_path, "name=run", f"train.max_steps={steps}"))
    summary = Trainer(cfg).fit()
    assert summary["epochs"] == 1  # it read 0: the epoch's last step was also the stop
    more = load_config(None, tiny_overrides(tmp_path, "name=run", f"train.max_steps={2 * steps}"))
    again = Trainer(more, resume=True)
    assert again.fit() == summary  # its one epoch is trained: nothing left (it trained an empty epoch, evaluated
    # the same weights again and wrote images_per_s=0 over the summary)
    # A resume with nothing left says so on stderr and writes nothing in the run folder (log.txt included).
    assert "finished its 1 epochs" in capfd.readouterr().err
    assert "finished its 1 epochs" not in (cfg.run_dir / "log.txt").read_text()


def test_the_first_step_of_a_resumed_process_is_not_timed(tmp_path, monkeypatch):
    from vitrain.engine.runlog import Speed

    cfg = load_config(None, tiny_overrides(tmp_path, "train.epochs=2", "train.max_steps=2"))
    Trainer(cfg).fit()
    flags, add = [], Speed.add

    def timed_add(self, *args):  # whether the step went into the timed figures
        before = self.train_s
        add(self, *args)
        flags.append(self.train_s != before)

    monkeypatch.setattr(Speed, "add", timed_add)
    more = load_config(None, tiny_overrides(tmp_path, "train.epochs=2", "train.max_steps=4"))
    summary = Trainer(more, resume=True).fit()
    assert flags == [False, True]  # the resumed process's first step is its warm-up, as a new run's is
    assert summary["images_per_s"] > 0


@pytest.mark.parametrize("impl", ["fused", "flat"])
def test_resume_after_max_steps_continues_exactly(tmp_path, impl):
    """Stop at step 30 and resume: steps 31.. equal the uninterrupted run (loss, lr and data order)."""
    common = ["train.epochs=2", "data.crop_padding=1", f"optim.impl={impl}"]
    whole = load_config(None, tiny_overrides(tmp_path, "name=whole", *common))
    Trainer(whole).fit()
    part = load_config(None, tiny_overrides(tmp_path, "name=part", *common, "train.max_steps=30"))
    Trainer(part).fit()
    part.train.max_steps = 0
    Trainer(part, resume=True).fit()
    expected, got = step_records(whole.run_dir), step_records(part.run_dir)
    assert sorted(got) == sorted(expected)
    for step in range(31, max(expected) + 1):
        assert got[step]["lr"] == expected[step]["lr"]
        assert got[step]["loss"] == expected[step]["loss"]


# slow (27 s on a Zen 4): killed runs resume bit for bit in test_faults.py and test_preemption.py by default
@pytest.mark.parametrize("kill_after_step", [pytest.param(10, marks=pytest.mark.slow)])
def test_killed_run_resumes_from_last_checkpoint_at_the_same_step(tmp_path, kill_after_step):
    common = tiny_overrides(tmp_path, "train.epochs=2", "train.checkpoint_every_steps=5", "data.crop_padding=1")
    reference = run_cli("train", *common, "name=reference")
    assert reference.returncode == 0, reference.stderr
    killed = subprocess.Popen(
        [sys.executable, "-m", "vitrain", "train", *common, "name=killed"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    run_dir = tmp_path / "runs" / "killed"
    deadline = time.time() + 120
    while time.time() < deadline:
        records = step_records(run_dir) if (run_dir / "metrics.jsonl").exists() else {}
        if records and max(records) >= kill_after_step and ckpt.latest(run_dir) is not None:
            break
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    last = ckpt.latest(run_dir)
    saved_step = ckpt.read_meta(last)["step"]
    assert saved_step % 5 == 0 and saved_step >= 5
    resumed = run_cli("train", *common, "name=killed", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    per_epoch = summary["steps"] // summary["epochs"]
    # The lines count epochs from 1, as the progress bar: the one under way mid-epoch, else the last one finished.
    under_way = -(-saved_step // per_epoch)
    assert f"resumed from {last} at step {saved_step} (epoch {under_way}/2)" in resumed.stderr
    assert f"epoch 2/2 step {summary['steps']} (" in resumed.stderr  # the final evaluation's line
    expected, got = step_records(tmp_path / "runs" / "reference"), step_records(run_dir)
    for step in range(saved_step + 1, max(expected) + 1):
        assert got[step]["lr"] == expected[step]["lr"]
        assert got[step]["loss"] == expected[step]["loss"]
