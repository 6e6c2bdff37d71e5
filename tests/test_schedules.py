"""Learning-rate schedules, linear lr scaling and the lr range test."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from tests.conftest import TINY_MODEL, TRUNK_FIELDS, model_overrides
from vitrain.cli import main
from vitrain.config import CONFIG_DIR, ScheduleConfig, load_config
from vitrain.engine.lr_find import suggest_lr
from vitrain.errors import ConfigError
from vitrain.optim import Schedule, scaled_lr


def schedule(name: str, total: int = 100, per_epoch: int = 10, peak: float = 1.0, **kwargs) -> Schedule:
    return Schedule(ScheduleConfig(name=name, **kwargs), peak, total, per_epoch)


def test_warmup_cosine_ramps_linearly_then_decays_to_min_lr():
    s = schedule("warmup_cosine", warmup_epochs=1, min_lr=0.01)
    assert [s(i) for i in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert s(10) == pytest.approx(1.0)
    assert s(55) == pytest.approx(0.01 + 0.5 * 0.99)
    assert s(100) == pytest.approx(0.01)


def test_onecycle_starts_low_peaks_at_pct_and_ends_far_below():
    s = schedule("onecycle", onecycle_pct=0.3, div_factor=25, final_div_factor=1e4)
    assert s(0) == pytest.approx(1 / 25)
    assert s(29) == 1.0  # the ramp's last step: 0.3 x 100 - 1, as torch's OneCycleLR
    assert max(s(i) for i in range(100)) == 1.0
    assert s(99) == pytest.approx(1 / 25 / 1e4)  # the run's last step runs at the final lr
    assert s(100) == s(99)


def torch_onecycle(peak: float, total: int, pct: float, div: float, final_div: float) -> list[float]:
    """The lr each of torch's optimizer steps runs at under OneCycleLR (read before the step, then scheduler.step)."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=peak, total_steps=total, pct_start=pct, anneal_strategy="cos", cycle_momentum=False,
        div_factor=div, final_div_factor=final_div, three_phase=False,
    )  # fmt: skip
    lrs = []
    for _ in range(total):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize(
    "total, pct, div, final_div",
    [(66, 0.3, 25.0, 1e4), (100, 0.25, 10.0, 100.0), (7, 0.3, 25.0, 1e4), (3, 0.3, 25.0, 1e4), (1, 0.5, 25.0, 1e4)],
)
def test_onecycle_is_torchs_one_cycle_lr_step_for_step(total, pct, div, final_div):
    # Before, the ramp ran over int(pct x T) steps and the decay to step T: over 66 steps the last ran at 2.24e-6
    # (torch: 8e-9), the one before at 8.9e-6 (2.3e-6), the ramp 0.5-2% low. (7, 0.3): the ramp ends mid-step;
    # (3, 0.3) and (1, 0.5): before step 0.
    s = schedule("onecycle", total=total, peak=2e-3, onecycle_pct=pct, div_factor=div, final_div_factor=final_div)
    assert [s(i) for i in range(total)] == pytest.approx(torch_onecycle(2e-3, total, pct, div, final_div), rel=1e-12)


def test_a_one_step_onecycle_ramp_starts_at_its_low_lr():
    # pct x T = 1: torch's OneCycleLR divides 0 by 0 at step 0; the ramp's one step runs at lr / div_factor.
    s = schedule("onecycle", total=10, onecycle_pct=0.1, div_factor=25, final_div_factor=1e4)
    assert s(0) == pytest.approx(1 / 25)
    assert s(9) == pytest.approx(1 / 25 / 1e4)


def test_a_onecycle_run_logs_torchs_one_cycle_lr_at_each_step(tmp_path):
    # The trainer reads step s's lr (s from 1 in metrics.jsonl) at schedule step s - 1, before the step runs, as
    # torch's optimizer step s - 1 runs at OneCycleLR's lr: the whole run's lrs, the final one included.
    out = tmp_path / "runs"
    overrides = [*model_overrides(dataclasses.replace(TINY_MODEL, depth=1)), "train.batch_size=256", "train.epochs=2"]
    overrides += ["log.progress=false", "log.every_steps=1", "schedule.name=onecycle", f"log.out_dir={out}"]
    assert main(["train", "digits", *overrides, "name=onecycle"]) == 0
    records = [json.loads(line) for line in (out / "onecycle" / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["lr"] for r in records if "lr" in r}
    s = load_config(CONFIG_DIR / "digits.yaml", ["schedule.name=onecycle"]).schedule
    expected = torch_onecycle(2e-3, len(logged), s.onecycle_pct, s.div_factor, s.final_div_factor)  # digits' lr
    assert sorted(logged) == list(range(1, len(expected) + 1))
    assert [logged[s] for s in sorted(logged)] == pytest.approx(expected, rel=1e-12)


def test_cyclic_falls_to_min_mid_cycle_and_shrinks_each_cycle():
    s = schedule("cyclic", warmup_epochs=0, min_lr=0.0, cycle_epochs=2, cycle_decay=0.5)  # 20-step cycles
    assert s(0) == pytest.approx(1.0)
    assert s(10) == pytest.approx(0.0)
    assert s(5) == pytest.approx(0.5)
    assert s(20) == pytest.approx(0.5)  # second cycle peaks at half
    assert s(30) == pytest.approx(0.0)


def test_step_multiplies_by_gamma_at_each_milestone():
    s = schedule("step", warmup_epochs=0, milestones=(3, 6), gamma=0.1)
    assert [s(29), s(30), s(59), s(60)] == pytest.approx([1.0, 0.1, 0.1, 0.01])


def test_step_without_milestones_is_refused():
    with pytest.raises(ConfigError, match="schedule.name=step needs schedule.milestones"):
        load_config(CONFIG_DIR / "digits.yaml", ["schedule.name=step"])
    for milestones in ("[-1,5]", "[0,5]"):  # the rate was cut before training started
        with pytest.raises(ConfigError, match=r"schedule.milestones=\[-?[01]\.0, 5\.0\] must be epochs > 0"):
            load_config(CONFIG_DIR / "digits.yaml", ["schedule.name=step", f"schedule.milestones={milestones}"])


def test_linear_scaling_multiplies_lr_by_global_batch_over_base():
    cfg = ScheduleConfig(scale_lr="linear", base_batch_size=256)
    assert scaled_lr(1e-3, cfg, 1024) == pytest.approx(4e-3)
    assert scaled_lr(1e-3, ScheduleConfig(), 1024) == 1e-3


def test_suggested_lr_is_where_the_loss_falls_fastest():
    lrs = [10 ** (-6 + i * 0.25) for i in range(25)]  # 1e-6 .. 1
    # flat, then a steep drop centred on 1e-3 (index 12), then blowing up
    losses = [2.0 - 1.5 / (1 + math.exp(-(i - 12) * 2.0)) + (0.5 * (i - 20) ** 2 if i > 20 else 0) for i in range(25)]
    assert suggest_lr(lrs, losses) == pytest.approx(1e-3)


def test_lr_find_command_writes_csv_and_suggests_an_lr(tmp_path, capsys):
    code = main(
        [
            "lr-find",
            *model_overrides(dataclasses.replace(TINY_MODEL, depth=1), TRUNK_FIELDS),
            "log.progress=false",
            "train.batch_size=32",
            "--steps",
            "25",
            "--start",
            "1e-5",
            "--end",
            "10",
            "--out",
            str(tmp_path / "lrf"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    lines = (tmp_path / "lrf" / "lr_find.csv").read_text().splitlines()
    assert lines[0] == "lr,loss,smoothed_loss" and len(lines) >= 4
    suggested = float(out.split("suggested lr: ")[1].split()[0])
    assert 1e-5 <= suggested <= 10
    try:
        import matplotlib  # noqa: F401

        assert (tmp_path / "lrf" / "lr_find.png").exists()
    except ImportError:
        assert "pip install 'vitrain[plot]'" in out


def test_lr_find_rejects_a_backwards_range(capsys):
    assert main(["lr-find", "--start", "1", "--end", "0.1"]) == 2
    assert "lr-find needs --start < --end; got --start=1.0 --end=0.1" in capsys.readouterr().err
