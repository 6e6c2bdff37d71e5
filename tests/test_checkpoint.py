"""Checkpoints load under another world size or strategy, are written atomically, pruned, and refuse other models."""

from __future__ import annotations

import shutil

import pytest

from tests.distributed_helpers import losses, run_two_ranks, tiny_config
from vitrain import checkpoint as ckpt
from vitrain.engine import Trainer
from vitrain.errors import CheckpointError
from vitrain.models import create_model
from vitrain.parallel import broadcast_object
from vitrain.parallel.distributed import rank

TEN_STEPS = {"epochs": 4, "max_steps": 10, "checkpoint_every_steps": 5}  # 3 steps per epoch


def _step5(out_dir, name):
    return out_dir / name / "checkpoints" / "step_00000005"


def fork(step_dir, out_dir, name):
    """Copy a checkpoint into a run folder of its own: --resume continues a checkpoint in its own run folder."""
    target = out_dir / name / "checkpoints" / step_dir.name
    shutil.copytree(step_dir, target)
    return str(target)


def _two_rank_job(out_dir):
    zero3 = {"strategy": "zero3"}
    # Uninterrupted zero3 run that also checkpoints at step 5 (saving does not change the losses).
    Trainer(tiny_config(out_dir, "zero3_full", batch_size=8, train=TEN_STEPS, parallel=zero3)).fit()
    # 1 -> 2: continue the one-process run's step-5 checkpoint on 2 ranks.
    resume = fork(_step5(out_dir, "single_full"), out_dir, "single_to_zero3") if rank() == 0 else None
    resume = broadcast_object(resume)
    Trainer(tiny_config(out_dir, "single_to_zero3", batch_size=8, train=TEN_STEPS, parallel=zero3), resume).fit()
    # zero3 -> ddp and zero3 -> zero1 on the same 2 ranks.
    for strategy in ("ddp", "zero1"):
        name = f"zero3_to_{strategy}"
        resume = broadcast_object(fork(_step5(out_dir, "zero3_full"), out_dir, name) if rank() == 0 else None)
        cfg = tiny_config(out_dir, name, batch_size=8, train=TEN_STEPS, parallel={"strategy": strategy})
        Trainer(cfg, resume).fit()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("ckpt")
    Trainer(tiny_config(out_dir, "single_full", train=TEN_STEPS)).fit()
    run_two_ranks(_two_rank_job, out_dir)
    # 2 -> 1: the zero3 checkpoint continued in this single process.
    resume = fork(_step5(out_dir, "zero3_full"), out_dir, "zero3_to_single")
    Trainer(tiny_config(out_dir, "zero3_to_single", train=TEN_STEPS), resume).fit()
    # zero1 writes each rank's optimizer shard; one process reads the union (its end-of-epoch save at step 6).
    zero1_step6 = out_dir / "zero3_to_zero1" / "checkpoints" / "step_00000006"
    resume = fork(zero1_step6, out_dir, "zero1_to_single")
    Trainer(tiny_config(out_dir, "zero1_to_single", train=TEN_STEPS), resume).fit()
    return out_dir


def _assert_continues(runs, resumed, uninterrupted, first_step=6):
    got, want = losses(runs / resumed), losses(runs / uninterrupted)
    assert sorted(got) == list(range(first_step, 11))
    for step in got:
        assert got[step] == pytest.approx(want[step], abs=1e-5), f"{resumed} step {step}"


def test_zero3_on_two_ranks_resumes_in_one_process(runs):
    _assert_continues(runs, "zero3_to_single", "zero3_full")


def test_one_process_resumes_as_zero3_on_two_ranks(runs):
    _assert_continues(runs, "single_to_zero3", "single_full")


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_zero3_checkpoint_resumes_under_another_strategy(runs, strategy):
    _assert_continues(runs, f"zero3_to_{strategy}", "zero3_full")


def test_zero1_checkpoint_resumes_in_one_process(runs):
    _assert_continues(runs, "zero1_to_single", "zero3_full", first_step=7)


def test_two_rank_checkpoint_holds_one_shard_file_per_rank(runs):
    step5 = _step5(runs, "zero3_full")
    assert sorted(p.name for p in step5.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert ckpt.read_meta(step5)["world_size"] == 2


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    cfg = tiny_config(tmp_path, "keep", train={"max_steps": 8, "checkpoint_every_steps": 2, "keep_checkpoints": 2})
    Trainer(cfg).fit()
    kept = [p.name for p in ckpt.step_dirs(cfg.run_dir)]
    best = ckpt.best(cfg.run_dir)
    # The 4 end-of-epoch/periodic saves 2,4,6,8 leave the newest two, plus the best one if it is older.
    assert kept[-2:] == ["step_00000006", "step_00000008"]
    assert set(kept) == {"step_00000006", "step_00000008", best.name}


def test_an_interrupted_write_is_invisible(tmp_path):
    cfg = tiny_config(tmp_path, "crash", train={"max_steps": 2})
    Trainer(cfg).fit()
    # A crash mid-save leaves a temporary directory; it is never taken for a checkpoint.
    (cfg.run_dir / "checkpoints" / ".tmp-step_00000099").mkdir()
    assert ckpt.latest(cfg.run_dir).name == "step_00000002"


def test_checkpoint_of_another_model_is_refused(tmp_path):
    cfg = tiny_config(tmp_path, "small", train={"max_steps": 1})
    Trainer(cfg).fit()
    other = tiny_config(tmp_path, "wide", model={"width": 64})
    expected = r"holds a different model: cls_token is \(1, 1, 32\) there, \(1, 1, 64\) in this config"
    with pytest.raises(CheckpointError, match=expected):
        ckpt.load_model_weights(ckpt.latest(cfg.run_dir), create_model(other.model))


def test_resuming_another_model_config_is_refused_before_training(tmp_path):
    cfg = tiny_config(tmp_path, "a", train={"max_steps": 1})
    Trainer(cfg).fit()
    other = tiny_config(tmp_path, "b", model={"depth": 3})
    with pytest.raises(CheckpointError, match=r"was trained with model.depth=\d, this run has 3 \(its config.yaml"):
        Trainer(other, str(ckpt.latest(cfg.run_dir))).fit()


def test_a_file_is_not_a_checkpoint(tmp_path):
    path = tmp_path / "last.pt"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="is a file; a vitrain checkpoint is a directory"):
        ckpt.read_meta(path)


def test_resume_without_a_checkpoint_says_so(tmp_path):
    with pytest.raises(CheckpointError, match="--resume: no checkpoint at"):
        Trainer(tiny_config(tmp_path, "fresh"), resume=True)


def test_a_run_directory_resolves_to_its_newest_checkpoint(runs):
    newest = ckpt.latest(runs / "zero3_full")
    assert newest.name == "step_00000010"
    assert ckpt.resolve(runs / "zero3_full") == newest
    assert ckpt.resolve(runs / "zero3_full" / "checkpoints") == newest
    assert ckpt.resolve(_step5(runs, "zero3_full")) == _step5(runs, "zero3_full")


ZERO1_OPTIMIZERS = {"adamw": {}, "sgd": {"lr": 0.05}, "lamb": {}, "lars": {"lr": 0.5}}


def _zero1_resume_job(out_dir):
    for name, extra in ZERO1_OPTIMIZERS.items():
        optim = {"name": name, **extra}
        sections = {"train": TEN_STEPS, "parallel": {"strategy": "zero1"}, "optim": optim}
        Trainer(tiny_config(out_dir, f"{name}_full", batch_size=8, **sections)).fit()
        part = tiny_config(out_dir, f"{name}_part", batch_size=8, **sections)
        part.train.max_steps = 5
        Trainer(part).fit()
        part.train.max_steps = 10
        Trainer(part, resume=True).fit()  # each rank reads back the state of the parameters it owns


@pytest.fixture(scope="module")
def zero1_runs(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("zero1")
    run_two_ranks(_zero1_resume_job, out_dir)
    return out_dir


@pytest.mark.parametrize("optimizer", list(ZERO1_OPTIMIZERS))
def test_zero1_resumes_exactly_for_every_optimizer(zero1_runs, optimizer):
    got, want = losses(zero1_runs / f"{optimizer}_part"), losses(zero1_runs / f"{optimizer}_full")
    assert sorted(got) == list(range(1, 11))
    assert [got[s] for s in range(6, 11)] == [want[s] for s in range(6, 11)]
    assert len({round(v, 6) for v in want.values()}) > 1
