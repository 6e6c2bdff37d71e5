"""Tasks: what the model is trained to do. Each bundles its data, model, head, loss, evaluation and best metric.

The trainer talks to a task only through `Task` (in the spirit of torchtitan's TrainSpec and timm's `loss_fn`);
`task.name` names one from the registry (classification, face) or by import path (`mypkg.tasks:MyTask`), a class
built as `MyTask(cfg, model, data)`, where `model` and `data` are what the library's caller handed in (None: the
ones `model.name` and `data.source` name):

    train_loader = task.build_data(device, rank, world_size)
    model = task.build_model()                 # single-device backbone: classifier or embedding model
    head = task.build_head(device)             # parameters outside the backbone (the identity head), or None
    loss = task.loss(model_output, labels)     # fp32 under every precision policy
    teacher = task.teacher(engine)             # optional: (images, labels) -> targets with a teacher's logits
    metrics = task.evaluate(forward, final, out_dir)
    task.best_metric, task.higher_is_better    # which checkpoint is "best"
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from vitrain import registry
from vitrain.config import Config
from vitrain.errors import ConfigError


class Task(Protocol):
    cfg: Config  # the run's config (the trainer sets autotune's decisions here before the model is built)
    name: str
    best_metric: str
    higher_is_better: bool
    summary_defaults: dict[str, Any]

    def build_data(self, device: torch.device, rank: int, world_size: int) -> Any: ...

    def build_model(self) -> nn.Module: ...

    def build_head(self, device: torch.device) -> nn.Module | None: ...

    def loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor: ...

    def evaluate(self, forward: nn.Module, final: bool, out_dir: Path) -> dict[str, Any]: ...

    def eval_line(self, metrics: dict[str, Any]) -> str: ...

    def describe_data(self) -> str: ...


def build_task(cfg: Config, model: Any = None, data: Any = None) -> Task:
    """The task `task.name` names, over `cfg`; `model` (a module or a factory) replaces `model.name`'s model and
    `data` (datasets, or a function of the config making them) data.source's, where the task reads such data."""
    return registry.lookup("task", cfg.task.name)(cfg, model, data)


def checked_task(task: Any) -> Task:
    """A task object handed to the library (`task=`), if it is an instance with the Task protocol's methods and
    attributes; else one ConfigError line naming what is missing, before anything is built or written."""
    expected = "a task object with the methods and attributes of vitrain.tasks.Task (or leave it out: task.name)"
    if inspect.isclass(task):
        raise ConfigError(
            f"task= is the class {task.__name__}, not an instance of it; give {task.__name__}(cfg, model, data)"
        )
    missing = registry.missing_members(Task, task, attributes=True)
    if isinstance(task, str):
        raise ConfigError(f"task= is the str {task!r}, not a task object; to name one, set task.name={task} instead")
    if missing:
        name = type(task).__name__
        article = "an" if name[0].lower() in "aeiou" else "a"
        raise ConfigError(f"task= is {article} {name} without {', '.join(missing)}; give {expected}")
    return task


def teacher_of(task: Task, engine: Any) -> Any:
    """The task's teacher set up by `engine` (train.distill), or None; a task without a `teacher` method has none."""
    own = getattr(task, "teacher", None)
    return own(engine) if own is not None else None


def is_better(task: Task, value: float, best: float | None) -> bool:
    if best is None:
        return True
    return value > best if task.higher_is_better else value < best
