"""The switches of the CIFAR-10 time-to-accuracy recipe: conv stem, weight average, flip averaging, time budget,
time-horizon schedule, evaluations on the clock, `vitrain plot` and TensorBoard events."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.conftest import REPO, TINY_MODEL, run_cli, shared_data
from tests.distributed_helpers import losses, tiny_config, whole_and_resumed
from vitrain import checkpoint as ckpt
from vitrain.config import ModelConfig, load_config, resolve_config_path
from vitrain.data.augment import progressive_size
from vitrain.engine import Trainer, runs
from vitrain.engine.ema import WeightAverage
from vitrain.errors import ConfigError
from vitrain.models import create_model
from vitrain.models.vit import resized_positions
from vitrain.plot import read_curves
from vitrain.tasks.evaluate import evaluate

# ---------------------------------------------------------------------------------------------- conv stem


@pytest.mark.parametrize(
    ("patch", "channels", "strides"),
    [(4, (), (2, 2)), (4, (16, 32, 64), (1, 2, 2)), (8, (), (2, 2, 2)), (2, (8, 16), (1, 2))],
)
def test_conv_stem_has_the_token_grid_and_the_exact_counts(patch, channels, strides):
    cfg = ModelConfig(
        image_size=32, patch_size=patch, num_classes=10, width=64, depth=2, heads=2, pool="gap",
        patch_embed="conv", stem_channels=channels,
    )  # fmt: skip
    assert tuple(s for _, s in cfg.stem) == strides
    model = create_model(cfg)
    tokens = model.patch_embed(torch.randn(3, 3, 32, 32))
    assert tokens.shape == (3, (32 // patch) ** 2, 64)
    assert model.complexity().params == sum(p.numel() for p in model.parameters())
    # Multiply-adds of the convs counted from the layers' real output sizes.
    macs, x = 0, torch.randn(1, 3, 32, 32)
    for layer in [*model.patch_embed.stem, model.patch_embed.proj]:
        y = layer(x)
        if isinstance(layer, nn.Conv2d):
            macs += y.numel() * layer.in_channels * layer.kernel_size[0] * layer.kernel_size[1]
        x = y
    linear = create_model(ModelConfig(**{**cfg.__dict__, "patch_embed": "linear"}))
    stem_linear = 3 * patch * patch * 64 * (32 // patch) ** 2
    assert model.complexity().macs - linear.complexity().macs == macs - stem_linear


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.patch_size=6", "model.image_size=36"], "must be a power of two"),
        (["model.stem_channels=[16]"], "needs at least 2"),
        (["model.stem_channels=[16,0]"], "must be positive"),
    ],
)
def test_conv_stem_refuses_impossible_shapes(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(resolve_config_path("cifar10"), ["model.patch_embed=conv", *overrides])


# ---------------------------------------------------------------------------------------------- weight average


def test_weight_average_follows_the_warmed_up_decay():
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    ema = WeightAverage(model, decay=0.9, warmup=True)
    start = [t.clone() for t in ema.module.state_dict().values()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model.train()(torch.randn(8, 4))  # moves the BatchNorm statistics and its integer counter
    ema.update()  # step 0: decay min(0.9, 1/10) = 0.1, weight 0.9
    for (name, now), before, src in zip(
        ema.module.state_dict().items(), start, model.state_dict().values(), strict=True
    ):
        if now.is_floating_point():
            torch.testing.assert_close(now, before + 0.9 * (src - before), msg=name)
        else:
            assert torch.equal(now, src), name
    assert ema.current_decay() == pytest.approx(2 / 11)
    ema.updates = 10_000
    assert ema.current_decay() == 0.9
    assert WeightAverage(model, decay=0.9, warmup=False).current_decay() == 0.9


def test_ema_is_evaluated_checkpointed_and_resumed_exactly(tmp_path):
    ema = {"ema": 0.9, "epochs": 4, "max_steps": 10, "checkpoint_every_steps": 5}
    whole, part, resumed = whole_and_resumed(tmp_path, ema, stop_at=5)
    assert resumed.engine.ema.updates == 10
    records = [json.loads(line) for line in (whole.run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "val_top1" in r]
    assert evals and all("ema_val_top1" in r and "ema_val_loss" in r for r in evals)
    # The average differs from the weights, and the resumed run's average is the uninterrupted one's, exactly.
    assert evals[-1]["ema_val_loss"] != evals[-1]["val_loss"]
    lines = (json.loads(line) for line in (part.run_dir / "metrics.jsonl").open())
    final = {r["step"]: r for r in lines if "val_top1" in r}  # evaluation records (a checkpoint's has its own)
    assert final[10]["ema_val_loss"] == evals[-1]["ema_val_loss"]
    state = {k: v.clone() for k, v in resumed.engine.ema.state().items()}
    fresh = Trainer(
        tiny_config(tmp_path, "again", train={**ema, "max_steps": 10}), resume=str(ckpt.latest(whole.run_dir))
    )
    runs.restore(fresh, fresh.resume_path)  # the collective load `fit` starts with
    for name, tensor in fresh.engine.ema.state().items():
        assert torch.equal(tensor, state[name]), name


def test_ema_is_refused_where_weights_are_sharded(tmp_path):
    with pytest.raises(ConfigError, match="train.ema"):
        tiny_config(tmp_path, "x", train={"ema": 0.99}, parallel={"strategy": "zero3"})


# ---------------------------------------------------------------------------------------------- flip averaging


class _Loader:
    """BatchLoader's evaluation interface over fixed batches."""

    device = torch.device("cpu")

    def __init__(self, batches):
        self.batches = batches

    def epoch(self, epoch):
        return iter(self.batches)


def test_flip_averaging_scores_the_summed_logits_beside_the_plain_ones():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 5))
    batches = [(torch.randn(16, 3, 4, 4), torch.randint(0, 5, (16,))) for _ in range(3)]
    plain = evaluate(model, _Loader(batches))
    both = evaluate(model, _Loader(batches), flip=True)
    assert {k: both[k] for k in plain} == plain  # the plain figures are untouched
    hits = sum(
        int(((model(x) + model(x.flip(-1))).argmax(1) == y).sum()) for x, y in batches
    )  # what flip averaging must give, computed directly
    assert both["val_top1_flip"] == hits / 48
    assert both["val_top1_flip"] != plain["val_top1"]  # the mirror images change the answer for this model
    # A model that cannot tell an image from its mirror image scores the same either way.
    symmetric = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 5))
    same = evaluate(symmetric, _Loader(batches), flip=True)
    assert same["val_top1_flip"] == same["val_top1"]


# ---------------------------------------------------------------------------------------------- time budget


def test_time_limit_stops_training_and_evaluates_once_more(tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path, "budget", train={"epochs": 50, "max_steps": 0, "time_limit_s": 100.0})
    trainer = Trainer(cfg)
    clock = iter(range(10**6))
    monkeypatch.setattr(trainer, "wall_s", lambda: 10.0 * next(clock))  # 10 s per reading of the clock
    summary = trainer.fit()
    assert 0 < summary["steps"] < 50 * 4
    log = (trainer.run_dir / "log.txt").read_text()
    assert "train.time_limit_s=100: stopping at step" in log
    evals = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").open() if "val_top1" in line]
    assert evals[-1]["step"] == summary["steps"]


def test_evaluations_record_wall_clock_and_run_at_the_marks(tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path, "marks", train={"epochs": 2, "max_steps": 0, "eval_at_s": (25.0, 55.0)})
    trainer = Trainer(cfg)
    now = {"t": 0.0}

    def tick():
        now["t"] += 5.0
        return now["t"]

    monkeypatch.setattr(trainer, "wall_s", tick)
    trainer.fit()
    evals = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").open() if "val_top1" in line]
    assert all(e["wall_s"] >= 0 and e["eval_s"] >= 0 for e in evals)
    # 4 steps per epoch: 2 epoch-end evaluations plus one per mark passed during training.
    assert len(evals) == 4
    assert sorted({e["epoch"] for e in evals}) == [0, 1, 2]


def test_time_horizon_reads_the_schedule_at_the_share_of_the_budget_spent(tmp_path):
    cfg = tiny_config(tmp_path, "horizon", train={"epochs": 10, "time_limit_s": 110.0}, schedule={"horizon": "time"})
    trainer = Trainer(cfg)
    trainer.setup_s, trainer.last_eval_s, trainer.step = 10.0, 0.0, 3
    trainer.wall_s = lambda: 60.0  # half of the 100 s left for training after setup
    assert trainer.schedule_position() == pytest.approx(0.5 * trainer.total_steps)
    trainer.last_eval_s = 50.0  # a long evaluation leaves only 50 s to train in: the budget is spent
    assert trainer.schedule_position() == trainer.total_steps
    trainer.wall_s = lambda: 10.0
    assert trainer.schedule_position() == 3  # never behind the step count
    with pytest.raises(ConfigError, match="train.time_limit_s"):
        tiny_config(tmp_path, "x", schedule={"horizon": "time"})


# ---------------------------------------------------------------------------------------------- curves


def test_plot_draws_both_runs_from_their_metrics(tmp_path):
    pytest.importorskip("matplotlib", reason="vitrain plot needs the plot extra (pip install 'vitrain[plot]')")
    runs = []
    for name in ("a", "b"):
        cfg = tiny_config(tmp_path, name, train={"max_steps": 4, "ema": 0.5})
        Trainer(cfg).fit()
        runs.append(str(cfg.run_dir))
    curves = read_curves(runs[0])
    assert len(curves.train["loss"]) == 4 and not any(math.isnan(v) for v in curves.train["wall_s"])
    assert curves.evals["val_top1"] and curves.evals["ema_val_top1"]
    out = tmp_path / "both.png"
    done = run_cli("plot", *runs, "--names", "one,two", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_plot_of_a_folder_without_metrics_exits_2_naming_it(tmp_path):
    done = run_cli("plot", str(tmp_path))
    assert done.returncode == 2
    assert str(tmp_path / "metrics.jsonl") in done.stderr and "vitrain train" in done.stderr


def test_tensorboard_events_load_in_tensorboards_reader(tmp_path):
    pytest.importorskip("tensorboard", reason="log.tensorboard needs the extra: pip install 'vitrain[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = tiny_config(tmp_path, "tb", train={"max_steps": 3}, log={"tensorboard": True})
    Trainer(cfg).fit()
    events = EventAccumulator(str(cfg.run_dir / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"train/loss", "train/lr", "val/val_top1"} <= set(tags)
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]
    assert events.Scalars("train/loss")[0].value == pytest.approx(losses(cfg.run_dir)[1])


def test_tensorboard_without_the_package_says_how_to_get_it(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    cfg = tiny_config(tmp_path, "tb", train={"max_steps": 1}, log={"tensorboard": True})
    with pytest.raises(ConfigError, match=r"pip install 'vitrain\[tensorboard\]'"):
        Trainer(cfg).fit()


def test_recipe_and_baseline_configs_load():
    fast = load_config(resolve_config_path("cifar10-fast"))
    assert fast.model.patch_embed == "conv" and fast.schedule.horizon == "time" and fast.train.time_limit_s <= 1200
    base = load_config(resolve_config_path("cifar10-baseline"))
    assert (base.model.width, base.model.depth, base.model.patch_size, base.optim.lr) == (192, 12, 4, 1e-3)
    assert Path(base.data.root).name == "cifar10-jpg.zip"


# ---------------------------------------------------------------------------------------------- progressive resizing


def test_progressive_size_grows_in_patch_steps_over_the_ramp():
    sizes = [progressive_size(p / 20, 16, 32, (0.25, 0.75), 4) for p in range(21)]
    assert sizes[:6] == [16] * 6  # until a quarter of the run
    assert sizes[-6:] == [32] * 6  # from three quarters on
    assert sizes == sorted(sizes) and all(s % 4 == 0 for s in sizes)
    assert {20, 24, 28} <= set(sizes)
    assert progressive_size(0.0, 0, 32, (0.25, 0.75), 4) == 32  # off


@pytest.mark.parametrize("pool", ["cls", "gap"])
def test_smaller_images_get_resampled_positions_and_the_full_size_is_unchanged(pool):
    cfg = dataclasses.replace(TINY_MODEL, image_size=32, in_chans=3, depth=1, pool=pool)
    model = create_model(cfg)
    with torch.no_grad():
        model.pos_embed.normal_()
    pos = resized_positions(model.pos_embed, model.num_prefix_tokens, 8)
    torch.testing.assert_close(pos, model.pos_embed)  # the same grid: the same table
    small = resized_positions(model.pos_embed, model.num_prefix_tokens, 4)
    assert small.shape == (1, model.num_prefix_tokens + 16, 32)
    if pool == "cls":
        assert torch.equal(small[:, 0], model.pos_embed[:, 0])
    out = model(torch.randn(2, 3, 16, 16))
    out.sum().backward()
    assert out.shape == (2, 10) and model.pos_embed.grad.abs().sum() > 0


def test_trainer_trains_at_the_small_size_first(tmp_path, monkeypatch):
    cfg = tiny_config(
        tmp_path,
        "sizes",
        model={"image_size": 16, "patch_size": 4},
        data={"min_size": 8, "size_ramp": (0.5, 0.5)},
        train={"epochs": 2, "max_steps": 0},
    )
    trainer = Trainer(cfg)
    seen = []
    engine = trainer.engine
    forward_backward = engine.forward_backward
    monkeypatch.setattr(
        engine, "forward_backward", lambda x, y, *rest: seen.append(x.shape[-1]) or forward_backward(x, y, *rest)
    )
    trainer.fit()
    assert seen == [8] * 3 + [16] * 3  # 3 steps per epoch; the second half at model.image_size
    with pytest.raises(ConfigError, match="data.min_size"):
        tiny_config(tmp_path, "x", model={"image_size": 16}, data={"min_size": 6})


@pytest.mark.slow
def test_time_to_accuracy_benchmark_runs_both_recipes_and_writes_table_json_and_plot(tmp_path):
    """The benchmark end to end on the real CIFAR-10 zip, at a 90-second budget per row (~4 minutes)."""
    data = shared_data("cifar10-jpg.zip")
    pytest.importorskip("matplotlib", reason="the benchmark's plot needs the plot extra")
    script = REPO / "benchmarks" / "cifar_time_to_accuracy.py"
    args = ["--rows", "recipe,baseline", "--budget-min", "1.5", "--data", str(data), "--out", str(tmp_path)]
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {row["row"]: row for row in json.loads((tmp_path / "results.json").read_text())["rows"]}
    assert set(rows) == {"recipe", "baseline"}
    for row in rows.values():
        assert "error" not in row, row
        assert [t for t, _ in row["curve"]] == sorted(t for t, _ in row["curve"]) and row["curve"]
    recipe, baseline = rows["recipe"], rows["baseline"]
    assert recipe["command_wall_s"] <= 90 + 15  # the budget, give or take the process's start and exit
    assert recipe["top1_20min"] > 0.1 and len(recipe["curve"]) >= 2  # better than chance
    # The baseline's one evaluation (fp32 ViT-Ti, 10,000 images) is nearly a minute: at this tiny budget it may end
    # past it, and then the table gives no end-of-budget figure rather than one over the budget.
    assert (baseline["top1_20min"] is None) == (baseline["command_wall_s"] > 90)
    table = (tmp_path / "table.md").read_text()
    assert "| recipe |" in table and "| baseline |" in table
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
