"""Experiment trackers the run log feeds beside metrics.jsonl: TensorBoard, Weights & Biases, MLflow (rank 0 only).

Each is a sink with three calls: `record(step, scalars)` for every metrics record, `summary(fields)` once with
summary.json's fields, `close(status)` as the run ends (finished, failed, or stopped by a signal). The run log
(vitrain/engine/runlog.py) calls every open sink; the trainer only says which sinks to open (`open_sinks`). A
tracker's package is imported when its sink opens, never by `import vitrain`.

Nothing leaves the machine unless the config says so: W&B writes an offline run under RUN/wandb (`wandb sync`
uploads it later), MLflow a SQLite store under RUN/mlflow. The tracker's run id is kept in the run folder, so a
stopped or resumed vitrain run continues the same tracker run.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Protocol

from vitrain.config import Config, flatten, to_dict, to_yaml
from vitrain.errors import ConfigError

STATUSES = ("finished", "failed", "stopped")
EXIT_CODES = {"finished": 0, "failed": 1, "stopped": 75}  # W&B's exit code of a run; 75: the CLI's stop exit
MLFLOW_STATUS = {"finished": "FINISHED", "failed": "FAILED", "stopped": "KILLED"}


class Sink(Protocol):
    def record(self, step: int, scalars: dict[str, float]) -> None: ...

    def summary(self, fields: dict[str, Any]) -> None: ...

    def close(self, status: str) -> None: ...


def check(cfg: Config) -> None:
    """The log section's tracker settings: one line naming the value and the fix."""
    g = cfg.log
    if g.every_steps <= 0:
        raise ConfigError(f"log.every_steps={g.every_steps} must be positive")
    if g.wandb and not g.wandb_project.strip():
        raise ConfigError("log.wandb_project is empty; name the W&B project for the run, e.g. log.wandb_project=vit")
    if g.mlflow and not g.mlflow_experiment.strip():
        raise ConfigError(
            "log.mlflow_experiment is empty; name the MLflow experiment the run goes to, e.g. log.mlflow_experiment=vit"
        )


def open_sinks(cfg: Config, run_dir: Path) -> list[Sink]:
    """The trackers the log section turns on, opened in the run folder (rank 0 only); one that fails to open closes
    those opened before it."""
    wanted = [(cfg.log.tensorboard, TensorBoardSink), (cfg.log.wandb, WandbSink), (cfg.log.mlflow, MlflowSink)]
    sinks: list[Sink] = []
    try:
        for on, sink in wanted:
            if on:
                sinks.append(sink(cfg, run_dir))
    except BaseException:
        for opened in sinks:
            opened.close("failed")
        raise
    return sinks


def scalars(fields: dict[str, Any]) -> dict[str, float]:
    """A metrics record's numbers by tracker name: evaluation fields under val/, the rest under train/ (step and
    epoch are the axes, not scalars; flags such as skipped=true are not numbers)."""
    return {
        f"{'val' if name.startswith(('val_', 'ema_val_')) else 'train'}/{name}": value
        for name, value in _numbers(fields).items()
        if name not in ("step", "epoch")
    }


def _numbers(fields: dict[str, Any]) -> dict[str, float]:
    """The fields that are numbers (a bool is not)."""
    return {k: v for k, v in fields.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def _missing(package: str, key: str, extra: str) -> ConfigError:
    return ConfigError(
        f"log.{key}=true needs the {package} package: pip install 'vitrain[{extra}]' (or set log.{key}=false)"
    )


class TensorBoardSink:
    """Scalars as TensorBoard events under RUN/tensorboard; the summary as a text entry."""

    def __init__(self, cfg: Config, run_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                "log.tensorboard=true needs the tensorboard package: pip install 'vitrain[tensorboard]' "
                "(or set log.tensorboard=false; `vitrain plot RUN` draws the curves without it)"
            ) from None
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def record(self, step: int, scalars: dict[str, float]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def summary(self, fields: dict[str, Any]) -> None:
        self.writer.add_text("summary", f"```\n{json.dumps(fields, indent=2)}\n```", fields.get("steps", 0))

    def close(self, status: str) -> None:
        self.writer.close()


class WandbSink:
    """A Weights & Biases run: the resolved config, every record at its step, the summary. log.wandb_mode=offline
    (the default) writes it under RUN/wandb only; online streams it to the server `wandb login` set up."""

    def __init__(self, cfg: Config, run_dir: Path):
        try:
            import wandb
        except ImportError:
            raise _missing("wandb", "wandb", "wandb") from None
        g = cfg.log
        id_file = run_dir / "wandb" / "vitrain-run-id"
        self.run = wandb.init(
            project=g.wandb_project,
            name=cfg.name,
            id=id_file.read_text().strip() if id_file.is_file() else None,
            resume="allow",  # a resumed vitrain run goes on in the same W&B run
            dir=str(run_dir),  # W&B adds its own wandb/ below
            mode=g.wandb_mode,
            config=to_dict(cfg),
            reinit="create_new",  # one process may train several runs (the library, lr-find)
            # console="off": W&B does not wrap stdout/stderr (the run log owns them); no system-metrics thread.
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
        )
        self.run.config.update(to_dict(cfg), allow_val_change=True)  # a resume may change keys (config_history)
        id_file.write_text(self.run.id + "\n")

    def record(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def summary(self, fields: dict[str, Any]) -> None:
        self.run.summary.update(fields)

    def close(self, status: str) -> None:
        self.run.finish(exit_code=EXIT_CODES[status])


class MlflowSink:
    """An MLflow run: the resolved config as params (and config.yaml), every record's numbers as metrics at their
    step, summary.json as an artifact and its numbers as summary/ metrics; the run ends FINISHED, FAILED or KILLED
    (a stop signal).

    Where: log.mlflow_tracking_uri, by default a SQLite store under RUN/mlflow (MLflow 3's local backend; its
    file store is refused unless MLFLOW_ALLOW_FILE_STORE=true). A server URI (http://...) sends the run there.
    """

    def __init__(self, cfg: Config, run_dir: Path):
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise _missing("mlflow", "mlflow", "mlflow") from None
        g, folder = cfg.log, (run_dir / "mlflow").resolve()
        uri = g.mlflow_tracking_uri or f"sqlite:///{folder / 'mlflow.db'}"
        _check_store(uri)
        folder.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(g.mlflow_experiment)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:  # a new local store keeps artifacts beside it; a server decides for itself
            local = not g.mlflow_tracking_uri
            artifacts = (folder / "artifacts").as_uri() if local else None
            experiment_id = self.client.create_experiment(g.mlflow_experiment, artifact_location=artifacts)
        id_file = folder / "run-id"
        run_id = id_file.read_text().strip() if id_file.is_file() else ""
        if run_id and self._exists(run_id):
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=cfg.name).info.run_id
            id_file.write_text(self.run_id + "\n")
            self._log_params(cfg)
        self.client.log_text(self.run_id, to_yaml(cfg), "config.yaml")  # a resume's changed config replaces it

    def _exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
        except MlflowException:  # another store than the one the id came from
            return False
        return True

    def _log_params(self, cfg: Config) -> None:
        from mlflow.entities import Param

        flat = flatten(to_dict(cfg)).items()
        params = [Param(key, value if isinstance(value, str) else json.dumps(value)) for key, value in flat]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[start : start + 100])

    def record(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(name, float(value), now, step) for name, value in scalars.items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def summary(self, fields: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(fields.get("steps", 0))
        metrics = [Metric(f"summary/{k}", float(v), now, step) for k, v in _numbers(fields).items()]
        self.client.log_batch(self.run_id, metrics=metrics)
        self.client.log_dict(self.run_id, fields, "summary.json")

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=MLFLOW_STATUS[status])


def _check_store(uri: str) -> None:
    """Refuse in one line what MLflow 3 would refuse in a paragraph: its file store without the opt-in, and a
    SQLite store without SQLAlchemy and Alembic (mlflow-skinny lacks them)."""
    import importlib.util
    from urllib.parse import urlparse

    if urlparse(uri).scheme in ("", "file") and uri not in ("databricks", "databricks-uc"):
        allowed = os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() in ("true", "1")
        if not allowed:
            raise ConfigError(
                f"log.mlflow_tracking_uri={uri} is MLflow's file store, which MLflow 3 refuses unless "
                "MLFLOW_ALLOW_FILE_STORE=true is set; set it, or use sqlite:///PATH.db (empty: RUN/mlflow/mlflow.db)"
            )
    elif uri.startswith("sqlite:") and not all(importlib.util.find_spec(p) for p in ("sqlalchemy", "alembic")):
        raise ConfigError(
            f"log.mlflow_tracking_uri={uri} is a SQLite store, which needs sqlalchemy and alembic: "
            "pip install 'vitrain[mlflow]' (or point log.mlflow_tracking_uri at an MLflow server)"
        )
