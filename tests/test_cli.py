"""The command line as a user meets it: listings, config display, and one-line errors with exit code 2."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.conftest import run_cli, tiny_overrides
from tests.data_helpers import make_tree
from tests.test_trainer import snapshot
from vitrain.config import CONFIG_DIR
from vitrain.models import PRESETS


def assert_one_line_error(result, pattern: str) -> None:
    import re

    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("vitrain: error:")]
    assert len(errors) == 1, result.stderr
    assert re.search(pattern, errors[0]), errors[0]


def test_models_lists_every_preset_with_size():
    result = run_cli("models")
    assert result.returncode == 0
    for preset in PRESETS.values():
        assert preset.name in result.stdout and preset.alias in result.stdout
    assert "86,567,656" in result.stdout  # ViT-B/16


def test_config_show_prints_the_resolved_config():
    result = run_cli("config", "show", "digits", "model.depth=6")
    assert result.returncode == 0, result.stderr
    shown = yaml.safe_load(result.stdout)
    assert shown["model"]["depth"] == 6 and shown["data"]["source"] == "digits"


def test_config_list_names_each_shipped_recipe_with_its_path_and_what_it_trains():
    result = run_cli("config", "list")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for name, description in [("digits", "scikit-learn's bundled handwritten digits"), ("cifar10", "CIFAR-10 from")]:
        row = next(i for i, line in enumerate(lines) if line.split()[:1] == [name])
        assert lines[row].split()[1] == str(CONFIG_DIR / f"{name}.yaml")
        assert description in lines[row + 1]


def test_a_recipe_name_resolves_from_a_folder_outside_the_repo(tmp_path):
    result = run_cli("config", "show", "cifar10", "model.depth=3", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    shown = yaml.safe_load(result.stdout)
    assert shown["name"] == "cifar10" and shown["model"]["depth"] == 3


def test_unknown_key_exits_2(tmp_path):
    assert_one_line_error(run_cli("config", "show", "model.widht=64"), r"did you mean model\.width\?")


def test_wrong_type_exits_2():
    assert_one_line_error(run_cli("config", "show", "train.epochs=many"), r"train\.epochs='many' must be an integer")


def test_impossible_shape_exits_2():
    assert_one_line_error(run_cli("train", "model.width=100", "model.heads=3"), r"not divisible by model\.heads=3")


def test_missing_config_file_exits_2():
    assert_one_line_error(run_cli("train", "no_such_recipe.yaml"), r"config file no_such_recipe\.yaml not found")


def test_missing_data_folder_exits_2(tmp_path):
    result = run_cli("train", "cifar10", f"data.root={tmp_path / 'absent'}", f"log.out_dir={tmp_path}")
    assert_one_line_error(result, r"absent does not exist")


def test_empty_data_folder_exits_2(tmp_path):
    (tmp_path / "empty").mkdir()
    result = run_cli("train", "cifar10", f"data.root={tmp_path / 'empty'}", f"log.out_dir={tmp_path}")
    assert_one_line_error(result, r"empty is empty")


def test_undecodable_image_exits_2(tmp_path):
    root = tmp_path / "data"
    make_tree(root, {"train": 3, "test": 3}, size=32)
    (root / "train" / "dog" / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    overrides = ["model.num_classes=2", "data.decode_workers=1", f"data.root={root}", f"log.out_dir={tmp_path}"]
    assert_one_line_error(run_cli("train", "cifar10", *overrides), r"cannot decode image .*train/dog/bad\.png")


@pytest.fixture
def trained_run(tmp_path):
    result = run_cli("train", *tiny_overrides(tmp_path, "train.max_steps=3"))
    assert result.returncode == 0, result.stderr
    return tmp_path / "runs" / "digits"  # no recipe named: the digits recipe


def test_eval_reports_accuracy_of_a_checkpoint(trained_run):
    result = run_cli("eval", str(trained_run))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["step"] == 3 and report["val_samples"] == 360 and 0.0 <= report["val_top1"] <= 1.0


def test_eval_of_checkpoint_from_another_model_exits_2(trained_run):
    before = snapshot(trained_run)
    assert_one_line_error(run_cli("eval", str(trained_run), "model.width=64"), r"different model")
    assert snapshot(trained_run) == before


# slow: 11 s on a Zen 4
@pytest.mark.slow
def test_eval_of_a_classification_run_refuses_the_face_and_detection_flags(trained_run, tmp_path):
    result = run_cli("eval", str(trained_run), "--out", str(tmp_path / "ev"))
    assert_one_line_error(result, r"--out is for face and detection models; .* task\.name=classification")
    assert not (tmp_path / "ev").exists()
    result = run_cli("eval", str(trained_run), "--show", "3")
    assert_one_line_error(result, r"^vitrain: error: --show draws a detection model's boxes; .* task\.name=classifi")


def test_resume_with_another_model_exits_2_and_keeps_checkpoint(trained_run, tmp_path):
    before = snapshot(trained_run / "checkpoints")
    result = run_cli("train", *tiny_overrides(tmp_path, "model.depth=3"), "--resume")
    assert_one_line_error(result, r"--resume: model\.depth=3 differs from the run's 2 \(.*config\.yaml\); a checkpoint")
    assert snapshot(trained_run / "checkpoints") == before


def test_eval_of_a_file_that_is_not_a_checkpoint_exits_2(tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_text("not a checkpoint")
    assert_one_line_error(run_cli("eval", str(junk)), r"junk\.pt is a file; a vitrain checkpoint is a directory")


def test_eval_of_missing_checkpoint_exits_2(tmp_path):
    assert_one_line_error(run_cli("eval", str(tmp_path / "none.pt")), r"none\.pt does not exist")


def test_a_warning_says_whose_it_is_in_one_line(capsys):
    import torch

    from vitrain import cli, models

    torch_file = torch.distributed.distributed_c10d.__file__
    cli._one_line_warning("`x` is deprecated", FutureWarning, torch_file, 1)
    cli._one_line_warning("model.width=100 is not a multiple of 8", UserWarning, models.__file__, 1)
    assert capsys.readouterr().err.splitlines() == [
        "vitrain: warning from torch (FutureWarning): `x` is deprecated",  # it read as vitrain's own
        "vitrain: warning: model.width=100 is not a multiple of 8",
    ]


def test_eval_reads_a_relative_data_path_where_the_run_trained_unless_the_command_line_gives_it(tmp_path):
    from vitrain.config import load_config, override_keys
    from vitrain.engine.runs import from_training_folder

    (tmp_path / "trained" / "frames-of-this-test").mkdir(parents=True)
    cfg = load_config(overrides=["data.source=folder", "data.root=frames-of-this-test", "data.val_root=pipe:cat x.tar"])
    meta = {"cwd": str(tmp_path / "trained")}
    moved, lines = from_training_folder(cfg, meta, set(), tmp_path / "meta.json")
    assert (
        moved.data.root == str(tmp_path / "trained" / "frames-of-this-test") and moved.data.val_root == "pipe:cat x.tar"
    )
    assert lines == [f"data.root=frames-of-this-test read from the folder the run trained in: {moved.data.root}"]
    assert from_training_folder(cfg, meta, {"data.root"}, tmp_path / "meta.json") == (
        cfg,
        [],
    )  # the command line's value is relative to here
    assert from_training_folder(cfg, {}, set(), tmp_path / "meta.json") == (
        cfg,
        [],
    )  # a checkpoint from before meta kept its folder
    given = override_keys(["data={val_root: here.tar}"])  # a mapping merges into its section: only val_root is given
    assert given == {"data.val_root"} and from_training_folder(cfg, meta, given, tmp_path / "meta.json")[0] == moved


def test_eval_reads_a_face_runs_pairs_files_and_a_video_runs_baseline_where_they_trained(tmp_path):
    from vitrain.config import load_config
    from vitrain.engine.runs import from_training_folder

    trained = tmp_path / "trained"
    (trained / "lists").mkdir(parents=True)
    (trained / "lists" / "pairs-of-this-test.txt").write_text("")
    (trained / "baseline-of-this-test").mkdir()
    meta = {"cwd": str(trained)}
    pairs = '["generated", "lists/pairs-of-this-test.txt", "cfp-fp"]'
    faces = ["task.name=face", "data.source=folder", "data.root=/faces", f"task.pairs={pairs}"]
    cfg = load_config(overrides=[*faces, "task.baseline_run=baseline-of-this-test"])  # one config for both keys
    moved, lines = from_training_folder(cfg, meta, set(), tmp_path / "meta.json")
    there = str(trained / "lists" / "pairs-of-this-test.txt")
    assert moved.task.pairs == ("generated", there, "cfp-fp")  # the protocols stay as named
    assert moved.task.baseline_run == str(trained / "baseline-of-this-test")
    assert lines == [
        f"task.baseline_run=baseline-of-this-test read from the folder the run trained in: {moved.task.baseline_run}",
        f"task.pairs=lists/pairs-of-this-test.txt read from the folder the run trained in: {there}",
    ]
    kept, _ = from_training_folder(cfg, meta, {"task.pairs"}, tmp_path / "meta.json")
    assert kept.task.pairs == cfg.task.pairs and kept.task.baseline_run == moved.task.baseline_run
