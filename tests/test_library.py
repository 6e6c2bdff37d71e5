"""vitrain as a library: the names `import vitrain` offers, and the example that trains from Python."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import vitrain
import vitrain.errors
from tests.conftest import REPO, tiny_overrides


def test_the_library_names_load_on_first_use():
    for name in vitrain.__all__:
        assert getattr(vitrain, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'Trainr'"):
        vitrain.Trainr  # noqa: B018


def test_train_returns_the_summary_and_trainer_fit_the_same(tmp_path):
    summary = vitrain.train(None, tiny_overrides(tmp_path, "train.max_steps=2", "name=lib"))
    assert summary["steps"] == 2 and summary["name"] == "lib"
    cfg = vitrain.load_config({"name": "again"}, tiny_overrides(tmp_path, "train.max_steps=2"))
    trainer = vitrain.Trainer(cfg)
    try:
        again = trainer.fit()
    finally:
        trainer.close()
    assert again["steps"] == 2 and cfg.model.width == 32


def test_the_example_trains_digits_from_python_and_prints_the_summary(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "examples" / "train_from_python.py"),
            "train.epochs=1",
            "train.max_steps=4",
            f"log.out_dir={tmp_path}",
            "precision.mode=fp32",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    first, last = done.stdout.strip().splitlines()[0], done.stdout.strip().splitlines()[-1]
    assert first == "training digits: 4 blocks of width 128, 1 epochs"
    summary = json.loads(last)
    assert summary["steps"] == 4 and 0.0 <= summary["val_top1"] <= 1.0
    assert (tmp_path / "digits" / "summary.json").is_file()


@pytest.mark.parametrize("overrides", ["train.max_steps=1", {"train.epochs": 2}, [3]])
def test_overrides_that_are_not_a_list_of_strings_are_refused_in_one_line(overrides, tmp_path):
    line = r"^overrides must be a list of 'section\.key=value' strings, e\.g\. \['train\.epochs=2'\]; got "
    with pytest.raises(vitrain.errors.ConfigError, match=line):
        vitrain.load_config("digits", overrides)
    with pytest.raises(vitrain.errors.ConfigError, match=line):
        vitrain.train(None, overrides)
    assert not (tmp_path / "runs").exists()


def test_a_trainer_runs_fit_once_and_not_after_close(tmp_path):
    cfg = vitrain.load_config(None, tiny_overrides(tmp_path, "train.max_steps=1", "train.threads=1"))
    once = r"^this Trainer already ran fit\(\) \(or was closed\); make a new Trainer$"
    trainer = vitrain.Trainer(cfg)
    try:
        assert trainer.fit()["steps"] == 1
        with pytest.raises(vitrain.errors.ConfigError, match=once):
            trainer.fit()
    finally:
        trainer.close()
    closed = vitrain.Trainer(cfg)
    closed.close()
    with pytest.raises(vitrain.errors.ConfigError, match=once):
        closed.fit()
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [cfg.name]  # the first run's folder only, whole
    assert json.loads((cfg.run_dir / "summary.json").read_text())["steps"] == 1


def test_a_resume_refuses_a_handed_in_config_whose_values_it_would_ignore(tmp_path):
    """The run continues with its own config.yaml and the overrides: a Config handed in with another train.max_steps
    was silently trained to the run's; the same Config (its auto values resolved by the run) resumes."""
    cfg = vitrain.load_config(None, tiny_overrides(tmp_path, "train.max_steps=2", "train.threads=1"))
    assert vitrain.train(cfg)["steps"] == 2
    more = vitrain.load_config(cfg, ["train.max_steps=3"])
    with pytest.raises(vitrain.errors.ConfigError, match=r"^resume: a run continues with its own config.yaml and the "
                       r"overrides, but the config handed in differs in train.max_steps=3 \(the run's 2\); pass "
                       r"changes as overrides, e.g. vitrain.train\(source, \['train.max_steps=3'\]"):  # fmt: skip
        vitrain.train(more, resume=True)
    assert vitrain.train(cfg, ["train.max_steps=3"], resume=True)["steps"] == 3  # as an override
    assert vitrain.train(vitrain.load_config(cfg, ["train.max_steps=3"]), resume=True)["steps"] == 3  # the same


def test_a_resume_from_another_folder_with_the_runs_own_config_handed_in_reads_its_data_where_it_trained(
    tmp_path, monkeypatch
):
    from tests.data_helpers import TREE_MODEL, make_tree

    make_tree(tmp_path / "trained" / "tree")
    common = [*TREE_MODEL, "data.source=folder", "data.root=tree", "data.mean=[0.5]", "data.std=[0.5]",
              "train.batch_size=4", "train.threads=1", "log.progress=false",
              f"log.out_dir={tmp_path / 'runs'}"]  # fmt: skip
    monkeypatch.chdir(tmp_path / "trained")
    cfg = vitrain.load_config(None, [*common, "train.max_steps=1"])
    assert vitrain.train(cfg)["steps"] == 1
    monkeypatch.chdir(tmp_path)  # the run's relative data.root names nothing here
    other = vitrain.load_config(cfg, ["data.root=elsewhere"])  # another value than the run's is still refused
    with pytest.raises(vitrain.errors.ConfigError, match=r'differs in data.root="elsewhere" \(the run\'s "tree"\)'):
        vitrain.train(other, ["train.max_steps=2"], resume=True)
    summary = vitrain.train(cfg, ["train.max_steps=2"], resume=True)  # not a difference of the config handed in
    assert summary["steps"] == 2


@pytest.mark.parametrize(
    "cfg, resume, line",
    [
        (
            "digits",
            False,
            r"^Trainer\(cfg\): cfg is 'digits', not a vitrain Config; make one with vitrain\.load_config",
        ),
        ({"train": {}}, False, r"^Trainer\(cfg\): cfg is a dict, not a vitrain Config; make one with vitrain\.load"),
        (None, ["train.max_steps=2"], r"^resume=\['train\.max_steps=2'\] must be True, False, 'auto', or a run or "),
        (None, 3, r"^resume=3 must be True, False, 'auto', or a run or checkpoint folder \(str or Path\)$"),
    ],
)
def test_a_trainer_refuses_a_cfg_that_is_not_a_config_and_a_resume_that_is_not_one(cfg, resume, line, tiny_cfg):
    with pytest.raises(vitrain.errors.ConfigError, match=line):
        vitrain.Trainer(tiny_cfg if cfg is None else cfg, resume)


def test_resume_none_is_a_new_run_as_before():
    from vitrain.engine.runs import check_resume

    for value in (None, False, True, "auto", "runs/x", Path("runs/x")):
        check_resume(value)  # no refusal


# Under torchrun every process calls vitrain.train, here three times in one launch (a sweep from one script).
SWEEP = """
import json, os, sys
import vitrain
for i, strategy in enumerate(("ddp", "zero2", "ddp")):
    summary = vitrain.train("digits", [f"name=sweep{i}", f"log.out_dir={sys.argv[1]}", f"parallel.strategy={strategy}",
                                       "train.max_steps=1", "train.threads=1", "model.depth=1", "log.progress=false"])
    if os.environ["RANK"] == "0":
        print(json.dumps({"run": summary["name"], "world_size": summary["world_size"]}), flush=True)
"""


def test_vitrain_train_called_again_in_one_torchrun_launch_opens_a_group_of_its_own(tmp_path):
    # Each group took its gloo addresses from the same keys of torchrun's store: the second or third call read a
    # closed group's and failed in gloo's set-up ("Connection reset by peer"), or waited on the store.
    from tests.distributed_helpers import gpu_free_env

    script = tmp_path / "sweep.py"
    script.write_text(SWEEP)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
         str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, **gpu_free_env(2)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert printed == [{"run": f"sweep{i}", "world_size": 2} for i in range(3)]
