"""Experiment trackers: W&B (offline) and MLflow (local store) runs hold the run's config, every metric and the
summary, and end as the run did: finished, failed, or stopped by a signal and continued in the same tracker run."""

from __future__ import annotations

import builtins
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed_helpers import losses, run_two_ranks, tiny_config
from vitrain.config import load_config
from vitrain.engine import Trainer, cluster
from vitrain.engine.step import TrainStep
from vitrain.engine.trackers import open_sinks
from vitrain.errors import ConfigError

WANDB = "log.wandb needs the extra: pip install 'vitrain[wandb]'"
MLFLOW = "log.mlflow needs the extra: pip install 'vitrain[mlflow]'"


@pytest.fixture
def wandb_home(tmp_path, monkeypatch):
    """W&B importable, its settings and caches in the test's folder, and no mode or key from the environment."""
    pytest.importorskip("wandb", reason=WANDB)
    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb-home"))
    for variable in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT", "WANDB_RUN_ID"):
        monkeypatch.delenv(variable, raising=False)


@pytest.fixture
def file_store(tmp_path, monkeypatch):
    """An MLflow file store in the test's folder (MLflow 3 keeps it only behind MLFLOW_ALLOW_FILE_STORE)."""
    pytest.importorskip("mlflow", reason=MLFLOW)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return (tmp_path / "mlruns").as_uri()


def _mlflow_runs(uri: str, experiment: str = "vitrain") -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    return client, client.search_runs([client.get_experiment_by_name(experiment).experiment_id])


def _history(client, run_id: str, name: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, name)}


def _wandb_records(run_dir: Path) -> list:
    """Every record of the run's offline W&B files, oldest first, once the last run's exit record is on disk: W&B's
    own process writes them, and one CI run under load read the file before its records were there; another read a
    record half written (a protobuf DecodeError), which is read again too."""
    from google.protobuf.message import DecodeError

    deadline = time.monotonic() + 30
    while True:
        try:
            records = _read_wandb_records(run_dir)
        except DecodeError:
            if time.monotonic() > deadline:
                raise
            records = []
        if _of_kind(records, "run") and _of_kind(records, "exit") or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def _read_wandb_records(run_dir: Path) -> list:
    """Every record of the run's offline W&B files, oldest first: leveldb-style log blocks after a 7-byte header."""
    from wandb.proto import wandb_internal_pb2

    block, records = 32768, []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"), key=lambda p: p.stat().st_mtime_ns):
        data, pending = path.read_bytes(), b""
        assert data[:4] == b":W&B"
        at = 7
        while at + 7 <= len(data):
            if block - at % block < 7:  # a block's tail too short for a header is padding
                at += block - at % block
                continue
            length, kind = struct.unpack("<HB", data[at + 4 : at + 7])
            pending += data[at + 7 : at + 7 + length]
            at += 7 + length
            if kind in (1, 4):  # a whole record, or the last fragment of one
                record = wandb_internal_pb2.Record()
                record.ParseFromString(pending)
                records.append(record)
                pending = b""
    return records


def _of_kind(records: list, kind: str) -> list:
    return [getattr(r, kind) for r in records if r.WhichOneof("record_type") == kind]


def _items(items) -> dict:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


def test_a_wandb_offline_run_holds_the_config_every_metric_and_the_summary(tmp_path, wandb_home):
    cfg = tiny_config(tmp_path, "wb", train={"max_steps": 3}, log={"wandb": True, "wandb_project": "tiny"})
    summary = Trainer(cfg).fit()
    records = _wandb_records(cfg.run_dir)
    [run] = _of_kind(records, "run")
    assert (run.project, run.display_name) == ("tiny", "wb")
    assert _items(run.config.update)["model"]["width"] == cfg.model.width
    rows = [_items(h.item) for h in _of_kind(records, "history")]
    assert {row["_step"]: row["train/loss"] for row in rows if "train/loss" in row} == losses(cfg.run_dir)
    assert [row["val/val_top1"] for row in rows if "val/val_top1" in row] == [summary["val_top1"]]
    final = {}
    for update in _of_kind(records, "summary"):
        final |= _items(update.update)
    assert final["val_top1"] == summary["val_top1"] and final["steps"] == 3
    assert [e.exit_code for e in _of_kind(records, "exit")] == [0]


def test_an_mlflow_file_store_run_holds_the_config_every_metric_and_the_summary(tmp_path, file_store):
    cfg = tiny_config(tmp_path, "ml", train={"max_steps": 3}, log={"mlflow": True, "mlflow_tracking_uri": file_store})
    summary = Trainer(cfg).fit()
    client, [run] = _mlflow_runs(file_store)
    assert (run.info.run_name, run.info.status) == ("ml", "FINISHED")
    assert run.data.params["model.width"] == str(cfg.model.width) and run.data.params["optim.name"] == "adamw"
    assert _history(client, run.info.run_id, "train/loss") == losses(cfg.run_dir)
    assert _history(client, run.info.run_id, "val/val_top1") == {3: summary["val_top1"]}
    assert run.data.metrics["summary/val_top1"] == summary["val_top1"]
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"config.yaml", "summary.json"}


def test_a_stopped_run_ends_its_tracker_runs_stopped_and_the_same_command_continues_them(
    tmp_path, wandb_home, monkeypatch
):
    pytest.importorskip("mlflow", reason=MLFLOW)
    for package in ("sqlalchemy", "alembic"):  # MLflow's default local store is SQLite
        pytest.importorskip(package, reason=f"{MLFLOW} (its SQLite store needs {package})")
    cfg = tiny_config(tmp_path, "stop", train={"max_steps": 4}, log={"wandb": True, "mlflow": True})
    trainer = Trainer(cfg)
    real_step = TrainStep.__call__

    def signalled_after_step_2(self, *args, **kwargs):
        result = real_step(self, *args, **kwargs)
        if trainer.step == 1:  # counted after this call returns: this is step 2
            os.kill(os.getpid(), signal.SIGUSR1)
        return result

    monkeypatch.setattr(TrainStep, "__call__", signalled_after_step_2)
    with pytest.raises(cluster.Stopped):
        trainer.fit()
    uri = f"sqlite:///{(cfg.run_dir / 'mlflow' / 'mlflow.db').resolve()}"
    client, [run] = _mlflow_runs(uri)
    assert run.info.status == "KILLED" and sorted(_history(client, run.info.run_id, "train/loss")) == [1, 2]
    assert [e.exit_code for e in _of_kind(_wandb_records(cfg.run_dir), "exit")] == [cluster.EXIT_STOPPED]

    monkeypatch.undo()
    Trainer(cfg, resume=True).fit()
    client, [continued] = _mlflow_runs(uri)
    assert continued.info.run_id == run.info.run_id and continued.info.status == "FINISHED"
    assert _history(client, run.info.run_id, "train/loss") == losses(cfg.run_dir)
    records = _wandb_records(cfg.run_dir)
    assert {r.run_id for r in _of_kind(records, "run")} == {_of_kind(records, "run")[0].run_id}
    assert [e.exit_code for e in _of_kind(records, "exit")] == [cluster.EXIT_STOPPED, 0]


def _train(cfg) -> None:
    Trainer(cfg).fit()


# slow: 9 s on a Zen 4
@pytest.mark.slow
def test_only_rank_0_logs_a_two_rank_run(tmp_path, file_store):
    cfg = tiny_config(
        tmp_path,
        "ddp",
        train={"max_steps": 2},
        parallel={"strategy": "ddp"},
        log={"mlflow": True, "mlflow_tracking_uri": file_store},
    )
    run_two_ranks(_train, cfg)
    client, [run] = _mlflow_runs(file_store)
    assert run.info.status == "FINISHED" and _history(client, run.info.run_id, "train/loss") == losses(cfg.run_dir)


def test_a_failing_run_ends_its_tracker_run_failed(tmp_path, file_store, monkeypatch):
    cfg = tiny_config(tmp_path, "fail", train={"max_steps": 3}, log={"mlflow": True, "mlflow_tracking_uri": file_store})
    trainer = Trainer(cfg)

    def broken(self, *args, **kwargs):
        raise RuntimeError("a step that breaks")

    monkeypatch.setattr(TrainStep, "__call__", broken)
    with pytest.raises(RuntimeError, match="a step that breaks"):
        trainer.fit()
    _, [run] = _mlflow_runs(file_store)
    assert run.info.status == "FAILED"


def test_tracker_settings_are_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"log.wandb_project is empty; name the W&B project"):
        load_config(overrides=["log.wandb=true", "log.wandb_project="])
    with pytest.raises(ConfigError, match=r"log.mlflow_experiment is empty; name the MLflow experiment"):
        load_config(overrides=["log.mlflow=true", "log.mlflow_experiment= "])
    with pytest.raises(ConfigError, match=r"log.every_steps=0 must be positive"):
        load_config(overrides=["log.every_steps=0"])


def test_mlflows_file_store_without_its_opt_in_is_refused_naming_the_variable(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason=MLFLOW)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    uri = (tmp_path / "mlruns").as_uri()
    cfg = load_config(overrides=["log.mlflow=true", f"log.mlflow_tracking_uri={uri}"])
    with pytest.raises(ConfigError, match=r"is MLflow's file store, which MLflow 3 refuses unless MLFLOW_ALLOW_FILE"):
        open_sinks(cfg, tmp_path)


@pytest.mark.parametrize("package", ["wandb", "mlflow"])
def test_a_tracker_without_its_package_says_how_to_get_it(package, tmp_path, monkeypatch):
    real_import = builtins.__import__

    def missing(name, *args, **kwargs):
        if name == package or name.startswith(f"{package}."):
            raise ImportError(f"No module named '{package}'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", missing)
    cfg = load_config(overrides=[f"log.{package}=true"])
    with pytest.raises(
        ConfigError, match=rf"log.{package}=true needs the {package} package: pip install 'vitrain\[{package}\]'"
    ):
        open_sinks(cfg, tmp_path)


def test_importing_vitrain_and_its_help_load_no_tracker_or_onnx_package():
    probe = (
        "import sys, contextlib, io\n"
        "import vitrain, vitrain.engine.trainer, vitrain.weights, vitrain.onnx_export\n"
        "from vitrain.cli import main\n"
        "for argv in (['--help'], ['export', '--help'], ['train', '--help']):\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "        main(argv)\n"
        "heavy = ('wandb', 'mlflow', 'onnx', 'onnxruntime', 'onnxscript', 'torch.utils.tensorboard')\n"
        "print(sorted(name for name in heavy if name in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
