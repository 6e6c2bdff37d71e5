"""A user's mistakes: one line naming the value and the fix, exit 2, and nothing the user had changed or lost.

Also the cases that are not mistakes but used to surprise: a resume continues the run's own config (a changed value
is said and logged), a damaged checkpoint is named, a few bad images are skipped when allowed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zipfile
from pathlib import Path

import pytest

from tests.conftest import reseal_with_checksums, tiny_overrides
from tests.data_helpers import make_tree, zip_with_bad_images
from tests.test_trainer import snapshot
from vitrain import checkpoint as ckpt
from vitrain.cli import main
from vitrain.config import Config, config_keys

TINY_RUN = ["train.epochs=1", "name=run"]


def error_line(capsys, argv: list[str]) -> str:
    """Run the CLI in process; it must exit 2 with exactly one error line and no traceback: that line."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("vitrain: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0].removeprefix("vitrain: error: ")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished 1-epoch run with two checkpoints (steps 10 and 15)."""
    out = tmp_path_factory.mktemp("mistakes")
    overrides = tiny_overrides(out, *TINY_RUN, "train.checkpoint_every_steps=10", "train.batch_size=90")
    assert main(["train", *overrides]) == 0
    return out / "runs" / "run"


def fresh_copy(trained: Path, tmp_path: Path) -> Path:
    import shutil

    copy = tmp_path / "runs" / "run"
    shutil.copytree(trained, copy)
    return copy


# ---------------------------------------------------------------------------------------------- resume


def test_resume_continues_the_runs_own_config_and_logs_a_changed_value(trained, tmp_path, capsys):
    run = fresh_copy(trained, tmp_path)
    steps = json.loads((run / "summary.json").read_text())["steps"]
    # The recipe on the command line (digits: 30 epochs) does not replace the run's train.epochs=1.
    assert main(["train", "--resume", str(run), "log.progress=false"]) == 0
    assert json.loads((run / "summary.json").read_text())["steps"] == steps
    assert not (run / "config_history.jsonl").exists()
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "train.epochs=3"]) == 0
    assert "train.epochs: 1 -> 3 (command line)" in capsys.readouterr().err
    assert json.loads((run / "summary.json").read_text())["steps"] == 3 * steps
    assert "train.epochs: 1 -> 3 (command line)" in (run / "log.txt").read_text()
    history = [json.loads(line) for line in (run / "config_history.jsonl").read_text().splitlines()]
    assert history[0]["changes"] == {"train.epochs": [1, 3]}
    kept = next(run.glob("config.before-resume-at-step_*.yaml"))
    assert "  epochs: 1\n" in kept.read_text() and "  epochs: 3\n" in (run / "config.yaml").read_text()


def test_resume_with_nothing_left_to_train_writes_nothing(trained, tmp_path, capsys):
    run = fresh_copy(trained, tmp_path)
    before = snapshot(run)
    assert main(["train", "--resume", str(run), "optim.lr=0.5"]) == 0
    assert "nothing left to train" in capsys.readouterr().err
    assert snapshot(run) == before


def test_resume_twice_at_one_step_keeps_every_config_before_it(trained, tmp_path):
    run = fresh_copy(trained, tmp_path)
    at = run / "checkpoints" / "step_00000010"
    first = (run / "config.yaml").read_text()
    assert main(["train", "--resume", str(at), "train.max_steps=11", "optim.lr=0.5"]) == 0
    second = (run / "config.yaml").read_text()
    assert main(["train", "--resume", str(at), "train.max_steps=11", "optim.lr=0.7"]) == 0
    kept = {p.name: p.read_text() for p in run.glob("config.before-resume-at-step_00000010*.yaml")}
    assert sorted(kept.values()) == sorted([first, second]), sorted(kept)
    assert "lr: 0.7" in (run / "config.yaml").read_text()


@pytest.mark.parametrize(
    "override, first_words",
    [
        ("model.depth=3", "--resume: model.depth=3 differs from the run's 2"),
        ("train.seed=7", "--resume: train.seed=7 differs from the run's 0"),
        ("data.source=synthetic", '--resume: data.source="synthetic" differs from the run\'s "digits"'),
    ],
)
def test_resume_refuses_what_a_checkpoint_cannot_continue_and_changes_nothing(
    trained, tmp_path, capsys, override, first_words
):
    run = fresh_copy(trained, tmp_path)
    before = snapshot(run)
    assert error_line(capsys, ["train", "--resume", str(run), override]).startswith(first_words)
    assert snapshot(run) == before


# ---------------------------------------------------------------------------------------------- damage


def flip_one_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def data_files(step: Path) -> list[str]:
    return sorted(json.loads((step / ckpt.COMPLETE_FILE).read_text())["files"])


@pytest.mark.parametrize("which", range(3))
def test_a_flipped_byte_in_the_newest_step_is_named_and_resume_falls_back(trained, tmp_path, capsys, which):
    run = fresh_copy(trained, tmp_path)
    newest, previous = ckpt.step_dirs(run)[-1], ckpt.step_dirs(run)[-2]
    name = data_files(newest)[which]  # the DCP shard, its index, meta.json
    flip_one_byte(newest / name)
    main(["checkpoint", "verify", str(run)])
    out = capsys.readouterr().out
    assert f"{newest}: damaged: {name} does not match its checksum" in out and f"{previous}: intact" in out
    assert error_line(capsys, ["eval", str(run)]).startswith(f"checkpoint {newest} is damaged: {name} does not match")
    exported = tmp_path / "export"
    assert error_line(capsys, ["export", str(run), str(exported)]).startswith(f"checkpoint {newest} is damaged")
    assert not exported.exists()
    assert main(["train", "--resume", str(run), "train.epochs=2"]) == 0
    err = capsys.readouterr().err
    assert f"checkpoint {newest} is damaged ({name} does not match its checksum): resuming from the step" in err
    assert f"resumed from {previous}" in err
    assert (run / "checkpoints" / f"superseded-{newest.name}" / name).is_file()  # kept aside, not deleted


def test_a_file_cut_short_under_a_finished_marker_is_named_as_damage(trained, tmp_path, capsys):
    run = fresh_copy(trained, tmp_path)
    newest = ckpt.step_dirs(run)[-1]
    name = data_files(newest)[0]
    size = (newest / name).stat().st_size
    os.truncate(newest / name, 1000)
    said = f"{name} has 1000 bytes where its COMPLETE marker lists {size}"
    main(["checkpoint", "verify", str(run)])
    assert f"{newest}: damaged: {said}" in capsys.readouterr().out
    assert error_line(capsys, ["eval", str(newest)]).startswith(f"checkpoint {newest} is damaged ({said}); use an")


def test_checkpoint_verify_says_what_each_step_is(trained, tmp_path, capsys):
    run = fresh_copy(trained, tmp_path)
    newest = ckpt.step_dirs(run)[-1]
    (newest / ckpt.COMPLETE_FILE).unlink()
    assert main(["checkpoint", "verify", str(run)]) == 2
    captured = capsys.readouterr()
    assert f"{newest}: incomplete: no COMPLETE marker (its write was interrupted)" in captured.out
    assert "1 of 2 step folder(s)" in captured.err
    line = error_line(capsys, ["eval", str(newest)])
    assert line.startswith(f"checkpoint {newest} is incomplete (no valid COMPLETE marker")


@pytest.mark.parametrize("which", [-1, 0])  # the newest step (resume falls back) or the older one (kept beside)
def test_a_garbled_complete_marker_is_said_once_per_command(trained, tmp_path, capsys, which):
    run = fresh_copy(trained, tmp_path)
    garbled = ckpt.step_dirs(run)[which]
    (garbled / ckpt.COMPLETE_FILE).write_text('{"step": 15, "files": {"meta.json"')
    said = f"checkpoint {garbled} is incomplete"
    main(["checkpoint", "verify", str(run)])
    captured = capsys.readouterr()
    assert f"{garbled}: damaged: its COMPLETE marker cannot be read" in captured.out and said not in captured.err
    for argv in (["eval", str(run)], ["train", "--resume", str(run), "train.epochs=2"]):
        assert main(argv) == 0
        err = capsys.readouterr().err
        assert err.count(said) == 1, err


@pytest.mark.parametrize(
    "edit, said",
    [
        ({"step": None}, "step=null is not a whole number"),  # the key removed
        ({"precision": 5}, "precision=5 is not a mapping"),
        ({"loader": "x"}, 'loader="x" is not a mapping'),
        ({"world_size": "two"}, 'world_size="two" is not a whole number'),
        ({"config": [1, 2]}, "config=[1, 2] is not a mapping"),
    ],
)
def test_a_hand_edited_meta_json_is_one_line_naming_the_key(trained, tmp_path, capsys, edit, said):
    run = fresh_copy(trained, tmp_path)
    newest = ckpt.step_dirs(run)[-1]
    meta = {**json.loads((newest / ckpt.META_FILE).read_text()), **edit}
    (newest / ckpt.META_FILE).write_text(json.dumps({k: v for k, v in meta.items() if v is not None}))
    reseal_with_checksums(newest)  # handed over whole: its marker agrees with the edited file
    for argv in (["eval", str(newest)], ["train", "--resume", str(newest), "train.epochs=2"]):
        line = error_line(capsys, argv)
        assert line.startswith(f"checkpoint {newest / ckpt.META_FILE}: {said}"), line


def test_a_bad_value_in_a_checkpoints_config_names_the_file_it_was_read_from(trained, tmp_path, capsys):
    run = fresh_copy(trained, tmp_path)
    newest = ckpt.step_dirs(run)[-1]
    meta = json.loads((newest / ckpt.META_FILE).read_text())
    meta["config"]["model"]["width"] = "abc"
    (newest / ckpt.META_FILE).write_text(json.dumps(meta))
    reseal_with_checksums(newest)
    line = error_line(capsys, ["export", str(newest), str(tmp_path / "out")])
    assert line.startswith("model.width=") and line.endswith(f"(the config read from {newest / ckpt.META_FILE})")


@pytest.mark.parametrize("sums", [{"nonexist": "ab"}, "abc"])  # a checksum for no listed file, or not a mapping
def test_a_marker_whose_checksums_do_not_fit_its_files_is_damage_said_in_one_line(trained, tmp_path, capsys, sums):
    run = fresh_copy(trained, tmp_path)
    previous, newest = ckpt.step_dirs(run)[-2:]
    marker = json.loads((newest / ckpt.COMPLETE_FILE).read_text())
    (newest / ckpt.COMPLETE_FILE).write_text(json.dumps({**marker, ckpt.CHECKSUM: sums}))
    for argv in (["eval", str(newest)], ["export", str(newest), str(tmp_path / "out")]):
        assert error_line(capsys, argv).startswith(f"checkpoint {newest} is damaged: its COMPLETE marker holds ")
    assert main(["train", "--resume", str(run), "train.epochs=2"]) == 0  # from the step before it
    assert f"resumed from {previous}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "file, give",
    [
        ("checkpoints/step_00000015/meta.json", "its step folder {run}/checkpoints/step_00000015"),
        ("checkpoints/best", "the run folder {run}"),
        ("config.yaml", "the run folder {run}"),
        ("../model.pt", "a run folder (the one holding checkpoints/) or a step folder"),
    ],
)
def test_checkpoint_verify_of_a_file_says_which_folder_to_give(trained, tmp_path, capsys, file, give):
    run = fresh_copy(trained, tmp_path)
    path = run / file
    if not path.exists():
        path.write_bytes(b"an export, say")
    line = error_line(capsys, ["checkpoint", "verify", str(path)])
    assert line.startswith(f"checkpoint verify: {path} is a file, not a run or step folder; give "), line
    assert give.format(run=run) in line


# ---------------------------------------------------------------------------------------------- export


def test_an_export_over_another_formats_leaves_none_of_its_files(trained, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["export", str(trained), str(out), "--format", "timm"]) == 0
    assert (out / "timm.json").is_file()
    assert main(["export", str(trained), str(out), "--overwrite"]) == 0  # vitrain's: timm.json would contradict it
    assert sorted(p.name for p in out.iterdir()) == ["classes.json", "config.yaml", "model.safetensors"]
    mine = tmp_path / "mine"  # a folder of the user's, no export in it: their model.onnx stays
    mine.mkdir()
    (mine / "model.onnx").write_bytes(b"the user's own graph")
    assert main(["export", str(trained), str(mine)]) == 0
    assert (mine / "model.onnx").read_bytes() == b"the user's own graph"


def test_an_export_onto_a_full_disk_is_one_line_and_leaves_no_partial_file(trained, tmp_path, capsys, monkeypatch):
    from safetensors import SafetensorError

    def full(state, path, metadata=None):
        Path(path).write_bytes(b"part")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr("safetensors.torch.save_file", full)
    out = tmp_path / "out"
    line = error_line(capsys, ["export", str(trained), str(out)])
    assert line == f"export: cannot write to {out} (No space left on device (os error 28)); choose a writable folder"
    assert list(out.iterdir()) == []


def test_export_never_replaces_an_export_without_overwrite(trained, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["export", str(trained), str(out)]) == 0
    before = snapshot(out)
    line = error_line(capsys, ["export", str(trained), str(out)])
    assert line == (
        f"export: {out} already holds model.safetensors, config.yaml, classes.json; pass --overwrite to replace them "
        "or choose another folder"
    )
    assert snapshot(out) == before
    assert main(["export", str(trained), str(out), "--overwrite"]) == 0


def test_export_to_a_file_or_under_one_is_one_line(trained, tmp_path, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    assert error_line(capsys, ["export", str(trained), str(a_file)]).startswith(f"export: {a_file} is a file")
    under = a_file / "sub"
    assert error_line(capsys, ["export", str(trained), str(under)]).startswith(f"export: cannot write to {under}")
    assert a_file.read_text() == "mine"


# ---------------------------------------------------------------------------------------------- bad samples


def folder_run(tmp_path: Path, root: Path, *extra: str) -> list[str]:
    return ["train", *tiny_overrides(tmp_path, "data.source=folder", f"data.root={root}", "model.image_size=8",
                                     "model.num_classes=2", "train.batch_size=8", "name=zip", *extra)]  # fmt: skip


def test_a_val_split_the_data_lacks_says_in_the_log_that_validation_was_held_out_of_train(tmp_path):
    root = zip_with_bad_images(tmp_path / "data.zip", bad=0)
    assert main(folder_run(tmp_path, root, "data.val_split=tset", "train.max_steps=1")) == 0  # a typo of test
    log = (tmp_path / "runs" / "zip" / "log.txt").read_text()
    assert "data: no 'tset' split beside 'train' in data.root (it has test): data.val_fraction=0.2 of train is " \
        "held out as validation; set data.val_split to name one" in log  # fmt: skip
    assert main(folder_run(tmp_path, root, "train.max_steps=1", "name=found")) == 0
    assert "held out" not in (tmp_path / "runs" / "found" / "log.txt").read_text()


def test_undecodable_images_are_skipped_up_to_the_limit_named_and_counted(tmp_path, capsys):
    root = zip_with_bad_images(tmp_path / "bad.zip", bad=3)
    assert main(folder_run(tmp_path, root, "data.skip_bad=3")) == 0
    log = (tmp_path / "runs" / "zip" / "log.txt").read_text()
    for i in range(3):
        assert f"data: skipped {root}:train/a/broken{i}.png: not an image PIL can read" in log
    assert f"1 file(s) without an image suffix not read: {root}:train/b/notes.txt" in log
    assert "1 image(s) in folders below a class folder not read (the tree is " in log
    assert f"move them up into their class folder): {root}:train/b/more/deep.png" in log
    summary = json.loads((tmp_path / "runs" / "zip" / "summary.json").read_text())
    assert summary["skipped_files"] == 3 and summary["non_image_files"] == 1
    capsys.readouterr()
    line = error_line(capsys, folder_run(tmp_path, root, "data.skip_bad=2", "name=zip2"))
    assert line == (
        f"cannot decode image {root}:train/a/broken2.png (not an image PIL can read); fix or remove the file, or "
        "let the run skip undecodable images: data.skip_bad=2 allows 2, this is number 3"
    )
    assert not (tmp_path / "runs" / "zip2").exists()


# ---------------------------------------------------------------------------------------------- finding keys


def test_config_keys_lists_every_key_of_the_typed_config(capsys):
    assert main(["config", "keys"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    sections = [f for f in dataclasses.fields(Config) if dataclasses.is_dataclass(f.type) or f.name != "name"]

    def keys(prefix, section):  # a nested section (train.distill) lists its keys under its own prefix
        for key in dataclasses.fields(section):
            value = getattr(section, key.name)
            yield from (
                keys(f"{prefix}.{key.name}", value) if dataclasses.is_dataclass(value) else [f"{prefix}.{key.name}"]
            )

    expected = ["name"] + [key for section in sections for key in keys(section.name, getattr(Config(), section.name))]
    assert listed == expected
    assert "train.distill.teacher" in listed
    assert all(row.help for row in config_keys()), [row.key for row in config_keys() if not row.help]


def test_config_keys_help_is_a_whole_first_sentence():
    """A key's help runs on past e.g. and i.e. (they end no sentence) and never stops inside brackets."""
    helps = {row.key: row.help for row in config_keys()}
    assert "(e.g. 0.999), evaluated beside the weights" in helps["train.ema"]
    cut = [key for key, text in helps.items() if text.endswith(("e.g.", "i.e.")) or text.count("(") != text.count(")")]
    assert not cut, cut


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["config", "show", "digits", "data.batch_size=3"],
            "unknown config key data.batch_size; did you mean train.batch_size?",
        ),
        (["train", "model.depth"], "model.depth is a config key without a value; write model.depth=VALUE"),
        (["config", "show", "digitz"], "config file digitz not found; did you mean digits?"),
        (["config", "keys", "trian"], "config section trian does not exist; did you mean train?"),
        (
            ["train", "task.name=nosuchtask"],
            "task.name=nosuchtask is not known; use one of: classification, detection, face, video",
        ),
        (["train", "model.name=timmm:vit"], "model.name=timmm:vit: cannot import timmm"),
    ],
)
def test_a_misspelt_name_gets_a_suggestion(capsys, argv, line):
    assert error_line(capsys, argv).startswith(line)


def test_a_distributed_strategy_without_a_launch_says_it_runs_as_one_process(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["train", *tiny_overrides(tmp_path, "parallel.strategy=ddp", "train.max_steps=1", "name=ddp")]) == 0
    log = (tmp_path / "runs" / "ddp" / "log.txt").read_text()
    assert "parallel.strategy=ddp without a distributed launch runs as one process" in log


def test_an_error_that_ends_a_run_is_in_its_log(tmp_path, capsys, monkeypatch):
    from tests.test_faults import _nan_loss_at

    _nan_loss_at(monkeypatch, set(range(1, 100)))
    line = error_line(capsys, ["train", *tiny_overrides(tmp_path, "name=nan", "precision.max_nonfinite_skips=0")])
    assert f"vitrain: error: {line}" in (tmp_path / "runs" / "nan" / "log.txt").read_text()


def test_resume_checks_the_overrides_against_the_runs_config_not_the_recipes(tmp_path, capsys):
    overrides = tiny_overrides(tmp_path, "name=z3", "parallel.strategy=zero3", "train.max_steps=2")
    assert main(["train", *overrides]) == 0
    run = tmp_path / "runs" / "z3"
    # The recipe (digits) says parallel.strategy=single, under which offload=params is refused; the run is zero3.
    assert main(["train", "--resume", str(run), "parallel.offload=params", "train.max_steps=3"]) == 0
    assert 'parallel.offload: "none" -> "params" (command line)' in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_resume_refuses_a_run_whose_every_checkpoint_is_damaged_and_keeps_them(trained, tmp_path, capsys, damage):
    run = fresh_copy(trained, tmp_path)
    for step in ckpt.step_dirs(run):
        if damage == "flipped":
            flip_one_byte(step / data_files(step)[0])
        else:  # a finished save (its marker lists the size) cut short later: damage, not a write interrupted
            os.truncate(step / data_files(step)[0], 1000)
    before = snapshot(run)
    line = error_line(capsys, ["train", "--resume", str(run)])
    assert line.startswith(f"--resume: every checkpoint of {run} is damaged")
    assert snapshot(run) == before


def test_the_skip_limit_counts_both_splits(tmp_path, capsys):
    root = tmp_path / "both.zip"
    zip_with_bad_images(root, bad=2)
    with zipfile.ZipFile(root, "a") as archive:
        archive.writestr("test/a/broken-val.png", b"not a png either")
    line = error_line(capsys, folder_run(tmp_path, root, "data.skip_bad=2"))
    assert line.endswith("data.skip_bad=2 allows 2, this is number 3") and "test/a/broken-val.png" in line


# ---------------------------------------------------------------------------------------------- bad flags and paths
# (export's files, bench/estimate/prepare/lr-find counts, output paths that are files: refused before any work)


@pytest.mark.parametrize(
    "argv, flag, value",
    [
        (["bench", "digits", "--synthetic", "--steps", "-1"], "--steps", "-1"),
        (["bench", "digits", "--steps", "0"], "--steps", "0"),
        (["bench", "digits", "--synthetic", "--warmup", "-1"], "--warmup", "-1"),
        (["bench", "--ladder", "--repeats", "0"], "--repeats", "0"),
        (["bench", "--ladder", "--nproc", "0"], "--nproc", "0"),
        (["bench", "--scaling", "--nproc", "0"], "--nproc", "0"),
        (["bench", "--scaling", "--repeats", "0"], "--repeats", "0"),
        (["bench", "--peers", "--steps", "0"], "--steps", "0"),
        (["bench", "optim", "--model", "ViT-Ti/16", "--steps", "0"], "--steps", "0"),
        (["bench", "loader", "--prepared", "p", "--folder", "f", "--batches", "0"], "--batches", "0"),
        (["bench", "loader", "--prepared", "p", "--folder", "f", "--rounds", "0"], "--rounds", "0"),
        (["bench", "loader", "--prepared", "p", "--folder", "f", "--warmup", "-1"], "--warmup", "-1"),
        (
            ["bench", "loader", "--prepared", "p", "--folder", "f", "--shards", "s", "--workers", "0,-1"],
            "--workers",
            "-1",
        ),
        (["estimate", "--image-size", "0"], "--image-size", "0"),
        (["estimate", "--patch-size", "0"], "--patch-size", "0"),
        (["estimate", "--baseline-gib", "-5"], "--baseline-gib", "-5"),
        (["estimate", "--largest", "--memory", "nan"], "--memory", "nan"),
        (["estimate", "--largest", "--memory", "-1"], "--memory", "-1"),
        (["estimate", "--devices", "8", "0"], "--devices", "0"),
        (["estimate", "--batch", "0"], "--batch", "0"),
        (["estimate", "--pipeline-stages", "0"], "--pipeline-stages", "0"),
        (["data", "prepare", "src", "dst", "--size", "0"], "--size", "0"),
        (["data", "prepare", "src", "dst", "--size", "-1"], "--size", "-1"),
        (["data", "prepare", "src", "dst", "--workers", "0"], "--workers", "0"),
        (["data", "prepare", "src", "dst", "--shard-size", "0"], "--shard-size", "0"),
        (["data", "pack", "src", "out", "--format", "shards", "--shard-samples", "0"], "--shard-samples", "0"),
        (["lr-find", "--end", "inf"], "--end", "inf"),
        (["lr-find", "--start", "nan"], "--start", "nan"),
        (["eval", "run", "--show", "-1"], "--show", "-1"),
        (["eval", "run", "--min-score", "nan"], "--min-score", "nan"),
    ],
)
def test_a_count_or_size_flag_out_of_range_is_refused_when_parsed(tmp_path, capsys, monkeypatch, argv, flag, value):
    monkeypatch.chdir(tmp_path)  # whatever ran would write here: nothing may
    line = error_line(capsys, argv)
    assert line.startswith(f"vitrain {argv[0]}") and f": argument {flag}: {value} must be " in line, line
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_flag_is_one_line_too(capsys):
    assert "unrecognized arguments: --stpes 3 (see vitrain" in error_line(capsys, ["bench", "optim", "--stpes", "3"])


def test_export_refuses_to_replace_a_users_config_yaml_without_overwrite(trained, tmp_path, capsys):
    out = tmp_path / "userdir"
    out.mkdir()
    (out / "config.yaml").write_text("# my edited recipe\n")
    line = error_line(capsys, ["export", str(trained), str(out)])
    assert line == f"export: {out} already holds config.yaml; pass --overwrite to replace it or choose another folder"
    assert (out / "config.yaml").read_text() == "# my edited recipe\n"
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml"]


def test_export_onnx_refuses_to_replace_a_users_config_yaml_without_overwrite(trained, tmp_path, capsys):
    out = tmp_path / "userdir"
    out.mkdir()
    (out / "config.yaml").write_text("# my edited recipe\n")
    line = error_line(capsys, ["export", str(trained), str(out), "--format", "onnx"])
    assert line.startswith(f"export: {out} already holds config.yaml; pass --overwrite")
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml"]


def test_export_refuses_an_empty_output_path(trained, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = error_line(capsys, ["export", str(trained), ""])
    assert line.startswith("vitrain export: argument out: an empty path; give a folder")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("tolerance", ["nan", "inf", "-1"])
def test_export_refuses_a_tolerance_that_is_not_a_finite_number_from_zero_up(trained, tmp_path, capsys, tolerance):
    line = error_line(capsys, ["export", str(trained), str(tmp_path / "out"), "--format", "onnx", "--tolerance",
                               tolerance])  # fmt: skip
    assert line.startswith(f"vitrain export: argument --tolerance: {tolerance} must be a finite number >= 0")
    assert not (tmp_path / "out").exists()


def test_prepared_data_root_that_is_a_file_names_data_root(tmp_path, capsys):
    a_file = tmp_path / "random.zip"
    a_file.write_bytes(b"not a folder")
    argv = ["train", *tiny_overrides(tmp_path, "data.source=prepared", f"data.root={a_file}", "name=p")]
    line = error_line(capsys, argv)
    assert line.startswith(f"data.root={a_file} is a file; prepared data is a folder made by `vitrain data prepare")
    assert not (tmp_path / "runs" / "p").exists()


def test_data_prepare_into_a_file_is_one_line_and_leaves_the_file(tmp_path, capsys):
    src = tmp_path / "tree"
    make_tree(src, {"train": 2}, size=8)
    a_file = tmp_path / "notzip.txt"
    a_file.write_text("mine")
    line = error_line(capsys, ["data", "prepare", str(src), str(a_file)])
    assert line.startswith(f"prepare output {a_file} is a file, not a folder; give a new or empty folder")
    assert a_file.read_text() == "mine"


def test_ladder_rows_naming_no_row_is_refused_before_anything_runs_or_is_written(tmp_path, capsys):
    out = tmp_path / "bo"
    out.mkdir()
    (out / "ladder.md").write_text("an earlier ladder\n")
    line = error_line(capsys, ["bench", "--ladder", "--rows", "native zero2,nosuchrow", "--out", str(out)])
    assert line.startswith("--rows nosuchrow matches no ladder row; the rows: fp32 reference; ")
    assert "; native zero2; " in line
    assert sorted(p.name for p in out.iterdir()) == ["ladder.md"] and (out / "ladder.md").read_text() == (
        "an earlier ladder\n"
    )


def test_lr_find_into_a_file_is_refused_before_it_trains(tmp_path, capsys):
    a_file = tmp_path / "notzip.txt"
    a_file.write_text("mine")
    line = error_line(capsys, ["lr-find", *tiny_overrides(tmp_path), "--steps", "3", "--out", str(a_file)])
    assert line == f"lr-find --out: {a_file} is a file, not a folder; choose another folder"
    assert a_file.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["notzip.txt"]


def test_lr_find_never_replaces_an_earlier_result_without_overwrite(tmp_path, capsys):
    out = tmp_path / "lf2"
    out.mkdir()
    (out / "lr_find.csv").write_text("lr,loss,smoothed_loss\n")
    line = error_line(capsys, ["lr-find", *tiny_overrides(tmp_path), "--steps", "3", "--out", str(out)])
    assert (
        line
        == f"lr-find --out: {out} already holds lr_find.csv; pass --overwrite to replace it or choose another folder"
    )
    assert (out / "lr_find.csv").read_text() == "lr,loss,smoothed_loss\n" and len(list(out.iterdir())) == 1


@pytest.mark.parametrize("preset", [["ViT-Ti/16"], []])
def test_estimate_refuses_more_pipeline_stages_than_blocks_as_train_does(capsys, preset):
    assert main(["estimate", *preset, "--pipeline-stages", "100", "--devices", "100"]) == 2
    printed = capsys.readouterr()
    assert printed.err == "vitrain: error: pipeline_stages=100 must be <= model.depth=12: each stage holds a block\n"
    assert printed.out == ""  # not even the table's title


@pytest.mark.parametrize("name", [".", ".."])
def test_a_run_name_that_leaves_log_out_dir_is_refused(tmp_path, capsys, name):
    (tmp_path / "runs").mkdir()
    line = error_line(capsys, ["train", *tiny_overrides(tmp_path, f"name={name}")])
    assert line.startswith(f"name={name} would put the run outside log.out_dir={tmp_path / 'runs'}; give it a name")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"] and not any((tmp_path / "runs").iterdir())


def test_a_log_out_dir_that_is_a_file_is_named(tmp_path, capsys):
    a_file = tmp_path / "notzip.txt"
    a_file.write_text("mine")
    line = error_line(capsys, ["train", *TINY_RUN, *tiny_overrides(tmp_path)[:-1], f"log.out_dir={a_file}"])
    assert line == f"log.out_dir={a_file}: {a_file} is a file, not a folder; point log.out_dir at a folder for the runs"
    assert a_file.read_text() == "mine"


def test_a_normalization_of_the_wrong_length_names_the_values_and_how_to_set_them(capsys):
    line = error_line(capsys, ["config", "show", "model.in_chans=1", "data.mean=[0.1,0.2,0.3]"])
    assert line == (
        "data.mean=[0.1, 0.2, 0.3] and data.std=[0.5] need 1 or model.in_chans=1 values each; set them to match, e.g. "
        "data.mean=[0.5] data.std=[0.5]"
    )


# ---------------------------------------------------------------------------------------------- refused resumes
# A resume that cannot continue says why in one line and leaves the run folder as it was.


def test_a_resume_whose_optimizer_state_cannot_load_names_the_value_and_changes_nothing(tmp_path, capsys):
    overrides = tiny_overrides(tmp_path, "name=sgd", "train.max_steps=2", "optim.name=sgd", "optim.momentum=0")
    assert main(["train", *overrides]) == 0
    run = tmp_path / "runs" / "sgd"
    before = snapshot(run)
    # SGD without momentum keeps no momentum buffers: the checkpoint has none to load into optim.momentum=0.9.
    line = error_line(capsys, ["train", "--resume", str(run), "train.max_steps=3", "optim.momentum=0.9"])
    step = run / "checkpoints" / "step_00000002"
    assert line.startswith(f"checkpoint {step} holds no optimizer state for optim.momentum=0.9 (saved with 0.0)")
    assert "damaged" not in line
    assert snapshot(run) == before


def test_a_refused_resume_from_an_earlier_step_leaves_the_newer_steps_where_they_were(tmp_path, capsys):
    overrides = tiny_overrides(tmp_path, "name=sgd", "train.max_steps=2", "optim.name=sgd", "optim.momentum=0")
    assert main(["train", *overrides, "train.checkpoint_every_steps=1"]) == 0
    run = tmp_path / "runs" / "sgd"
    before = snapshot(run)
    earlier = run / "checkpoints" / "step_00000001"
    line = error_line(capsys, ["train", "--resume", str(earlier), "train.max_steps=3", "optim.momentum=0.9"])
    assert line.startswith(f"checkpoint {earlier} holds no optimizer state for optim.momentum=0.9")
    assert snapshot(run) == before  # step_00000002 not moved aside: a plain --resume still continues it


def test_resume_with_another_optimizer_names_optim_name_and_changes_nothing(trained, tmp_path, capsys):
    run = fresh_copy(trained, tmp_path)
    before = snapshot(run)
    line = error_line(capsys, ["train", "--resume", str(run), "optim.name=sgd"])
    assert line.startswith(f'--resume: optim.name="sgd" differs from the run\'s "adamw" ({run / "config.yaml"})')
    assert f"`vitrain export {run} OUT`, then model.init_from=OUT/model.safetensors optim.name=sgd" in line
    assert snapshot(run) == before


def test_a_trainer_resumed_with_another_optimizer_is_refused_before_the_run_folder_changes(tmp_path):
    from vitrain.config import load_config
    from vitrain.engine import Trainer
    from vitrain.errors import CheckpointError

    cfg = load_config(None, tiny_overrides(tmp_path, "name=lib", "train.max_steps=2"))
    Trainer(cfg).fit()
    before = snapshot(cfg.run_dir)
    with pytest.raises(CheckpointError, match='optim.name="lamb" differs from the run\'s "adamw"'):
        Trainer(load_config(None, tiny_overrides(tmp_path, "name=lib", "optim.name=lamb")), resume=True)
    assert snapshot(cfg.run_dir) == before


@pytest.mark.parametrize(
    "text, problem",
    [
        ("- 1\n- 2\n", "config file {} must hold a mapping of sections, got list"),
        ("", "{} holds nothing, not the run's config"),
        ("model: [1, 2\ntrain: {{}}\n", "config file {} line 2 is not valid YAML: expected ',' or ']', but got ':'"),
    ],
)
def test_resume_of_a_run_whose_config_yaml_is_not_a_config_names_the_file(trained, tmp_path, capsys, text, problem):
    run = fresh_copy(trained, tmp_path)
    (run / "config.yaml").write_text(text.format())
    before = snapshot(run)
    line = error_line(capsys, ["train", "--resume", str(run), "train.epochs=2"])
    assert line.startswith(f"--resume: {problem.format(run / 'config.yaml')}; restore it from a copy")
    assert snapshot(run) == before


def test_resume_of_a_run_without_its_config_yaml_says_it_is_missing(trained, tmp_path, capsys):
    run = fresh_copy(trained, tmp_path)
    (run / "config.yaml").unlink()
    line = error_line(capsys, ["train", "--resume", str(run)])
    assert line.startswith(f"--resume: {run / 'config.yaml'} is missing from the run folder; restore it from a copy")


def test_resume_of_a_finished_run_says_there_is_nothing_left_and_keeps_its_summary(trained, tmp_path, capsys):
    run = fresh_copy(trained, tmp_path)
    summary = (run / "summary.json").read_bytes()
    steps = json.loads(summary)["steps"]
    assert main(["train", "--resume", str(run)]) == 0
    said = f"{run} already finished its 1 epochs (step {steps}): nothing left to train; to train longer, resume with "
    assert said + "train.epochs=<more than 1>" in capsys.readouterr().err
    assert (run / "summary.json").read_bytes() == summary


def test_a_recipe_named_beside_resume_path_is_refused_not_ignored(trained, tmp_path, capsys):
    run = fresh_copy(trained, tmp_path)
    before = snapshot(run)
    line = error_line(capsys, ["train", "face-orl", "--resume", str(run)])
    assert line.startswith(f"--resume {run} continues that run with its own config.yaml, not face-orl's: drop face-orl")
    assert snapshot(run) == before
