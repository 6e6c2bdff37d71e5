"""Resume continues a checkpoint in its own run folder, exactly (per-rank RNG included), past interrupted writes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.data_helpers import make_tree, write_shards
from tests.distributed_helpers import losses, run_two_ranks, tiny_config, whole_and_resumed
from tests.test_checkpoint import TEN_STEPS
from tests.test_trainer import snapshot
from vitrain import checkpoint as ckpt
from vitrain.config import to_dict
from vitrain.engine import Trainer, runs
from vitrain.errors import CheckpointError
from vitrain.parallel import broadcast_object
from vitrain.parallel.distributed import rank

# Dropout and drop-path draw from the RNG: a resume matches only when every rank's RNG state is restored.
RANDOM_MASKS = {"drop_path": 0.2, "dropout": 0.1}


def _stop_at(cfg, step):
    cfg.train.max_steps = step
    return cfg


def test_resume_with_random_masks_continues_bit_for_bit(tmp_path):
    whole = tiny_config(tmp_path, "whole", train=TEN_STEPS, model=RANDOM_MASKS)
    Trainer(whole).fit()
    part = _stop_at(tiny_config(tmp_path, "part", train=TEN_STEPS, model=RANDOM_MASKS), 5)
    Trainer(part).fit()
    Trainer(_stop_at(part, 10), resume=True).fit()
    expected, got = losses(whole.run_dir), losses(part.run_dir)
    assert sorted(got) == list(range(1, 11))
    assert [got[s] for s in range(6, 11)] == [expected[s] for s in range(6, 11)]  # exactly, not approximately


@pytest.mark.parametrize("loader", ["shards", "plain"])
def test_a_torch_dataloader_source_resumed_mid_epoch_with_random_masks_continues_bit_for_bit(tmp_path, loader):
    # A DataLoader made for the rest of the epoch after a resume must not draw from the RNG the masks draw from.
    if loader == "shards":
        write_shards(tmp_path / "data", [7, 7, 6])  # 20% of each held out: 17 train, 4 steps of 4 an epoch
        data = {"source": "shards", "shuffle_buffer": 6}
    else:
        make_tree(tmp_path / "data", {"train": 16, "test": 4})
        data = {"source": "folder", "loader": "plain"}
    data |= {"root": str(tmp_path / "data"), "loader_workers": 0, "hflip": 0.5, "crop_padding": 1}
    model = {**RANDOM_MASKS, "num_classes": 2}
    whole, part, _ = whole_and_resumed(tmp_path, {**TEN_STEPS, "batch_size": 4}, stop_at=5, data=data, model=model)
    expected, got = losses(whole.run_dir), losses(part.run_dir)
    assert sorted(got) == list(range(1, 11))
    assert [got[s] for s in range(6, 11)] == [expected[s] for s in range(6, 11)]  # stopped after epoch 1's first step


def test_resume_path_continues_in_the_checkpoints_own_run_folder(tmp_path):
    source = tiny_config(tmp_path, "source", train={**TEN_STEPS, "max_steps": 5})
    Trainer(source).fit()
    step5 = ckpt.latest(source.run_dir)
    other = tiny_config(tmp_path, "other", train=TEN_STEPS)
    trainer = Trainer(other, resume=str(step5))
    assert trainer.run_dir == source.run_dir
    trainer.fit()
    assert not other.run_dir.exists()
    assert ckpt.latest(source.run_dir).name == "step_00000010"


def test_resume_run_dir_takes_its_newest_complete_checkpoint(tmp_path):
    cfg = tiny_config(tmp_path, "run", train={**TEN_STEPS, "max_steps": 5})
    Trainer(cfg).fit()
    trainer = Trainer(_stop_at(cfg, 10), resume=str(cfg.run_dir))
    assert trainer.resume_path == cfg.run_dir / "checkpoints" / "step_00000005"
    trainer.fit()
    assert ckpt.latest(cfg.run_dir).name == "step_00000010"


def test_resuming_from_another_run_never_touches_the_folder_of_this_name(tmp_path):
    a = tiny_config(tmp_path, "a", train={**TEN_STEPS, "max_steps": 5, "keep_checkpoints": 1})
    b = tiny_config(tmp_path, "b", train={**TEN_STEPS, "keep_checkpoints": 1})
    Trainer(a).fit()
    Trainer(b).fit()
    before = snapshot(b.run_dir)
    Trainer(b, resume=str(ckpt.latest(a.run_dir))).fit()  # named b, continues a's checkpoint in a's folder
    assert snapshot(b.run_dir) == before
    assert [p.name for p in ckpt.step_dirs(a.run_dir)][-1] == "step_00000010"


def test_an_incomplete_step_folder_is_skipped_with_a_warning_and_resume_falls_back(tmp_path):
    cfg = tiny_config(tmp_path, "run", train={**TEN_STEPS, "max_steps": 10})
    Trainer(cfg).fit()
    newest = ckpt.latest(cfg.run_dir)
    (newest / ckpt.COMPLETE_FILE).unlink()  # as if the write had stopped before its marker
    with pytest.warns(UserWarning, match=f"checkpoint {newest} is incomplete"):
        fallback = ckpt.latest(cfg.run_dir)
    assert fallback.name < newest.name and ckpt.is_complete(fallback)
    with pytest.warns(UserWarning, match="is incomplete"):
        trainer = Trainer(cfg, resume=True)
    assert trainer.resume_path == fallback


@pytest.mark.parametrize("max_steps", [10, 2])  # a complete step before it to continue, or none: starting over
def test_an_incomplete_step_folder_is_moved_aside_not_overwritten_by_the_resumed_run(tmp_path, max_steps):
    cfg = tiny_config(tmp_path, "run", train={**TEN_STEPS, "max_steps": max_steps})
    Trainer(cfg).fit()
    newest = ckpt.latest(cfg.run_dir)
    (newest / ckpt.COMPLETE_FILE).write_text("{garbled")  # the marker damaged: its files may be whole
    files = {p.name: p.read_bytes() for p in newest.iterdir()}
    with pytest.warns(UserWarning, match="is incomplete"):
        Trainer(cfg, resume=True).fit()  # trains up to the same step again, and saves it
    kept = newest.with_name(f"superseded-{newest.name}")
    assert {p.name: p.read_bytes() for p in kept.iterdir()} == files
    assert ckpt.is_complete(newest) and ckpt.read_meta(newest)["step"] == max_steps
    why = " (no valid COMPLETE marker)" if max_steps == 2 else ""  # starting over: no earlier step to go back to
    assert f"{newest.name}{why} moved aside as superseded-step_*" in (cfg.run_dir / "log.txt").read_text()
    (newest / ckpt.COMPLETE_FILE).write_text("{garbled again")
    with pytest.warns(UserWarning, match="is incomplete"):
        Trainer(cfg, resume=True).fit()  # the folder moved aside before stays; this one takes the next name
    assert {p.name: p.read_bytes() for p in kept.iterdir()} == files
    assert (kept.with_name(f"{kept.name}-2") / ckpt.COMPLETE_FILE).read_text() == "{garbled again"


def test_a_marker_that_lists_a_missing_or_short_file_means_incomplete(tmp_path):
    cfg = tiny_config(tmp_path, "run", train={"max_steps": 2})
    Trainer(cfg).fit()
    step = ckpt.latest(cfg.run_dir)
    assert ckpt.is_complete(step)
    shard = next(step.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1])
    assert not ckpt.is_complete(step)


def test_leftovers_of_interrupted_writes_are_cleaned_on_resume(tmp_path):
    cfg = tiny_config(tmp_path, "run", train={**TEN_STEPS, "max_steps": 5})
    Trainer(cfg).fit()
    root = cfg.run_dir / "checkpoints"
    step5 = root / "step_00000005"
    (root / ".tmp-step_00000008").mkdir()  # a save killed while writing
    (root / ".trash-step_00000002").mkdir()  # a prune killed while deleting
    step5.rename(root / ".old-step_00000005")  # a re-save of step 5 killed between its two renames
    trainer = Trainer(_stop_at(cfg, 10), resume=True)
    assert trainer.resume_path == step5 and ckpt.is_complete(step5)
    trainer.fit()
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == []
    log = (cfg.run_dir / "log.txt").read_text()
    assert "restored step_00000005" in log and "removed .tmp-step_00000008" in log


def test_going_back_to_an_earlier_step_moves_the_newer_ones_aside(tmp_path):
    cfg = tiny_config(tmp_path, "run", train={**TEN_STEPS, "checkpoint_every_steps": 2, "keep_checkpoints": 2})
    Trainer(cfg).fit()
    root = cfg.run_dir / "checkpoints"
    earlier, *newer = ckpt.step_dirs(cfg.run_dir)  # the best (if older) and the newest two
    assert newer and newer[-1].name == "step_00000010"
    Trainer(cfg, resume=str(earlier)).fit()
    # The newer steps were set aside, not pruned in place of the new ones nor taken for the newest.
    assert sorted(p.name for p in root.glob("superseded-*")) == [f"superseded-{p.name}" for p in newer]
    assert ckpt.latest(cfg.run_dir).name == "step_00000010"
    assert ckpt.read_meta(ckpt.latest(cfg.run_dir))["step"] == 10
    assert "moved aside as superseded-step_*" in (cfg.run_dir / "log.txt").read_text()


def test_going_back_with_another_model_is_refused_before_anything_moves(tmp_path):
    cfg = tiny_config(tmp_path, "run", train={**TEN_STEPS, "checkpoint_every_steps": 2})
    Trainer(cfg).fit()
    before = snapshot(cfg.run_dir)
    earlier = ckpt.step_dirs(cfg.run_dir)[0]
    other = tiny_config(tmp_path, "run", train=TEN_STEPS, model={"depth": 3})
    with pytest.raises(CheckpointError, match=r"was trained with model.depth=\d, this run has 3 \(its config.yaml"):
        Trainer(other, resume=str(earlier))
    assert snapshot(cfg.run_dir) == before  # no newer step was moved aside, nothing was cleaned or written


def test_a_finished_write_that_missed_its_rename_is_put_in_place(tmp_path):
    cfg = tiny_config(tmp_path, "run", train={**TEN_STEPS, "max_steps": 5})
    Trainer(cfg).fit()
    root = cfg.run_dir / "checkpoints"
    (root / "step_00000005").rename(root / ".tmp-step_00000005")  # killed after COMPLETE, before the rename
    trainer = Trainer(_stop_at(cfg, 10), resume=True)
    assert trainer.resume_path == root / "step_00000005"


def test_two_new_runs_started_at_once_never_share_a_folder(tmp_path):
    cfg = tiny_config(tmp_path, "same", train={"max_steps": 1})
    first, second = Trainer(cfg), Trainer(cfg)  # both chose the empty folder before either wrote to it
    assert first.run_dir == second.run_dir
    first.fit()
    before = snapshot(first.run_dir)
    with pytest.raises(CheckpointError, match="was taken by another run started at the same time"):
        second.fit()
    assert snapshot(first.run_dir) == before


def test_resume_of_a_folder_without_a_run_or_checkpoint_is_refused(tmp_path):
    (tmp_path / "runs" / "empty").mkdir(parents=True)
    cfg = tiny_config(tmp_path / "runs", "empty")
    with pytest.raises(CheckpointError, match="holds no complete checkpoint and no vitrain run"):
        Trainer(cfg, resume=True)


def test_resume_of_a_run_killed_before_its_first_checkpoint_starts_it_over_in_place(tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path, "run", train={"max_steps": 2})
    with monkeypatch.context() as patch:  # the run writes its folder, then dies before any checkpoint
        patch.setattr(Trainer, "_fit", lambda self, log: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):
            Trainer(cfg).fit()
    assert (cfg.run_dir / "run.json").exists() and ckpt.latest(cfg.run_dir) is None
    trainer = Trainer(cfg, resume=True)
    assert trainer.run_dir == cfg.run_dir and trainer.resume_path is None
    trainer.fit()
    assert "holds no complete checkpoint yet: starting it over from step 0" in (cfg.run_dir / "log.txt").read_text()


# ------------------------------------------------------------------------------------------ per-rank RNG


def _two_rank_rng_job(out_dir):
    ddp = {"strategy": "ddp"}
    # Each rank draws its own masks: the RNG streams differ between ranks right after set-up.
    trainer = Trainer(tiny_config(out_dir, "draws", batch_size=8, parallel=ddp, model=RANDOM_MASKS))
    masks = [None, None]
    dropout_mask = torch.nn.functional.dropout(torch.ones(32), p=0.5, training=True) > 0
    torch.distributed.all_gather_object(masks, dropout_mask.tolist())
    if rank() == 0:
        (out_dir / "masks.json").write_text(json.dumps(masks))
    del trainer
    whole = tiny_config(out_dir, "ddp_whole", batch_size=8, train=TEN_STEPS, parallel=ddp, model=RANDOM_MASKS)
    Trainer(whole).fit()
    part = tiny_config(out_dir, "ddp_part", batch_size=8, train=TEN_STEPS, parallel=ddp, model=RANDOM_MASKS)
    Trainer(_stop_at(part, 5)).fit()
    Trainer(_stop_at(part, 10), resume=True).fit()
    # The 2-rank checkpoint at step 5 continued by 1 process: rank 0 keeps its state, rank 1's is not used.
    if rank() == 0:
        shutil.copytree(ckpt.latest(out_dir / "ddp_part"), out_dir / "to_one" / "checkpoints" / "step_00000010")
    broadcast_object(None)


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("rng")
    run_two_ranks(_two_rank_rng_job, out_dir)
    return out_dir


def test_ranks_draw_different_dropout_and_drop_path_masks(two_rank_runs):
    rank0, rank1 = json.loads((two_rank_runs / "masks.json").read_text())
    assert rank0 != rank1


def test_two_ranks_resume_with_random_masks_bit_for_bit(two_rank_runs):
    expected, got = losses(two_rank_runs / "ddp_whole"), losses(two_rank_runs / "ddp_part")
    assert sorted(got) == list(range(1, 11))
    assert [got[s] for s in range(6, 11)] == [expected[s] for s in range(6, 11)]


def test_loading_on_another_world_size_says_what_happens_to_the_rng_states(two_rank_runs):
    cfg = tiny_config(two_rank_runs, "to_one", train={**TEN_STEPS, "max_steps": 11}, model=RANDOM_MASKS)
    Trainer(cfg, resume=str(two_rank_runs / "to_one")).fit()
    log = (two_rank_runs / "to_one" / "log.txt").read_text()
    assert "checkpoint from 2 processes, 1 now: ranks 0-0 continue their own RNG states" in log
    assert "the states of ranks 1-1 are not used" in log


def _lrs(run_dir) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["lr"] for r in records if "lr" in r}


CHECKPOINT_META = runs.checkpoint_meta


def _meta_before_steps_per_epoch(trainer, is_best=False):
    """checkpoint_meta as written before meta.json kept where the schedule stands."""
    meta = CHECKPOINT_META(trainer, is_best)
    del meta["schedule_step"], meta["steps_per_epoch"]
    return meta


@pytest.mark.parametrize("written_by", ["this vitrain", "an older vitrain"])
def test_a_resume_with_other_steps_per_epoch_continues_the_schedule_at_the_same_point_of_training(
    tmp_path, monkeypatch, written_by
):
    # 64 training samples of 16: 4 steps per epoch; stopped after 2 (half of epoch 1), resumed with 2 micro-batches
    # a step: 2 steps per epoch. An older checkpoint has no steps per epoch: they are counted from its config.
    data = {"synthetic_samples": 80}  # 16 of them held out
    half = tiny_config(tmp_path, "half", train={"max_steps": 2, "epochs": 3}, data=data)
    if written_by == "an older vitrain":
        monkeypatch.setattr(runs, "checkpoint_meta", _meta_before_steps_per_epoch)
    Trainer(half).fit()
    monkeypatch.undo()
    half.train.max_steps, half.train.accum_steps = 0, 2
    resumed = Trainer(half, resume=True)
    resumed.fit()
    said = "the lr schedule continues at its step 1 of 2 per epoch (the checkpoint's 2 of 4), the same point of"
    assert said in " ".join(resumed.notes)
    whole = tiny_config(tmp_path, "whole", train={"max_steps": 0, "epochs": 3, "accum_steps": 2}, data=data)
    Trainer(whole).fit()
    # The uninterrupted 2-step epochs' rates from their step 2 on; before, the resumed run read step 2 of 6 as its
    # step 3 (warmup ended a step early) and trained a step past the schedule's end at the minimum rate.
    got, reference = _lrs(tmp_path / "half"), _lrs(tmp_path / "whole")
    assert sorted(got) == list(range(1, 8)) and sorted(reference) == list(range(1, 7))
    assert [got[s] for s in range(3, 8)] == pytest.approx([reference[s] for s in range(2, 7)], rel=1e-12)


def test_an_older_checkpoint_whose_steps_per_epoch_cannot_be_counted_is_said_to_continue_unmapped(tmp_path):
    from types import SimpleNamespace

    cfg = tiny_config(tmp_path, "run")
    meta = {"config": to_dict(cfg), "world_size": 2, "step": 6}  # 2 replicas then, 1 now
    stream = SimpleNamespace()  # a loader that cannot count another split (the streaming one)
    one = SimpleNamespace(data_size=1)
    trainer = SimpleNamespace(cfg=cfg, steps_per_epoch=10, notes=[], train_loader=stream, dist=one)
    assert runs._schedule_step(meta, trainer) == 6
    assert "the lr schedule continues at its step 6 counted in this run's 10 steps per epoch" in trainer.notes[0]
    trainer.train_loader, trainer.notes = SimpleNamespace(batches_with=lambda replicas: 10 // replicas), []
    assert runs._schedule_step(meta, trainer) == 12  # 5 steps per epoch then, 10 now: the same share of training
    assert "(the checkpoint's 6 of 5)" in trainer.notes[0]


@pytest.mark.parametrize("impl", ["loop", "flat"])
def test_a_resume_takes_the_parameter_groups_from_its_config_and_the_moments_from_the_checkpoint(
    tmp_path, monkeypatch, impl
):
    # The checkpoint's groups came from the optim.* values and the grouping rule it was written with. Before, the
    # per-tensor kernels (loop, fused: CUDA's auto) took them back: optim.weight_decay=0.1 given on resume ran at
    # the saved 0.05, and a grouping since changed (head_dist a head, dist_token without decay) was refused, or
    # mapped onto the wrong groups, which then lacked their betas (KeyError at the first step). flat kept this run's.
    from vitrain.optim import optimizers

    cfg = tiny_config(tmp_path, "run", train={"max_steps": 2}, optim={"impl": impl, "head_lr_scale": 2.0})
    monkeypatch.setattr(optimizers, "HEAD_PREFIXES", ())  # the run was written under another grouping rule
    saved = Trainer(cfg)
    saved.fit()
    moments = {
        n: s["exp_avg"].clone() for n, s in ckpt.training_state(saved.model, saved.engine.optimizer)[1]["state"].items()
    }
    monkeypatch.undo()
    cfg.optim.weight_decay = 0.1
    resumed = Trainer(cfg, resume=True)
    resumed.fit()  # at its last step already: loads the checkpoint, trains no more
    optimizer = resumed.engine.optimizer
    scales = {(g["lr_scale"], g["weight_decay"]) for g in optimizer.param_groups}
    assert scales == {(1.0, 0.0), (1.0, 0.1), (2.0, 0.0), (2.0, 0.1)}
    state = ckpt.training_state(resumed.model, optimizer)[1]["state"]
    assert set(state) == set(moments)
    for name, moment in moments.items():
        assert torch.equal(state[name]["exp_avg"], moment), name


def test_a_resume_while_another_process_trains_the_run_stops_before_touching_its_folder(tmp_path):
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    (run_dir / ckpt.CHECKPOINT_DIR / ".tmp-step_00000024").mkdir(parents=True)  # the other process's save, in flight
    (run_dir / runs.RUN_FILE).write_text("{}\n")
    holder = subprocess.Popen(
        [sys.executable, "-c", f"from vitrain.engine import runs; runs.hold_run({str(run_dir)!r}); print('held', "
         "flush=True); input()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointError, match=f"is being trained by process {holder.pid} on .*; wait for it"):
            runs.choose_run(run_dir, resume=True)
        assert (run_dir / ckpt.CHECKPOINT_DIR / ".tmp-step_00000024").is_dir()  # its save left alone
    finally:
        holder.communicate("\n", timeout=60)
    try:
        choice = runs.choose_run(run_dir, resume=True)  # that process ended: its lock went with it
        assert "removed .tmp-step_00000024" in " ".join(choice.notes)
    finally:
        runs.release_run(run_dir)


def test_a_run_whose_checkpoints_folder_is_a_file_is_refused_before_it_trains(tmp_path):
    cfg = tiny_config(tmp_path, "run", train={"max_steps": 1})
    Trainer(cfg).fit()
    shutil.rmtree(cfg.run_dir / ckpt.CHECKPOINT_DIR)
    (cfg.run_dir / ckpt.CHECKPOINT_DIR).write_text("not a folder")
    before = snapshot(cfg.run_dir)
    with pytest.raises(CheckpointError, match=r"checkpoints is a file, not the run's checkpoints folder; move it"):
        Trainer(cfg, resume=True)
    assert snapshot(cfg.run_dir) == before


def test_a_finished_fit_lets_go_of_the_run_for_another_process(tmp_path):
    # A library's fit() without close(), then the run resumed in processes it launches (tests/test_pipeline.py).
    import subprocess
    import sys

    cfg = tiny_config(tmp_path, "run", train={"max_steps": 1})
    Trainer(cfg).fit()
    code = f"from vitrain.engine import runs; runs.hold_run({str(cfg.run_dir)!r}); print('held')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "held", done.stderr


def test_the_lock_is_held_for_each_trainer_of_the_run_and_goes_with_the_last(tmp_path):
    # An older Trainer of the run closed (or collected) while a newer one is set up to train it: the newer keeps the
    # run locked; once it is dropped unused, the run is free for another process.
    import gc
    import subprocess
    import sys

    cfg = tiny_config(tmp_path, "run", train={"max_steps": 1})
    older = Trainer(cfg)
    older.fit()
    newer = Trainer(tiny_config(tmp_path, "run", train={"max_steps": 2}), resume=True)
    older.close()
    code = f"from vitrain.engine import runs; runs.hold_run({str(cfg.run_dir)!r}); print('held')"

    def another_process():
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)

    refused = another_process()
    assert refused.returncode != 0 and "is being trained by process" in refused.stderr
    del newer
    gc.collect()
    assert another_process().stdout.strip() == "held"
