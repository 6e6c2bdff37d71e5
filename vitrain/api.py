"""vitrain as a library: configs from recipes, dicts or files, and one call that trains and returns the summary.

from vitrain import train, load_config, Trainer
summary = train("digits", ["train.epochs=2"])              # a shipped recipe (or a YAML path), overrides
summary = train({"model": {...}, "train": {...}})           # a config as a dict
summary = train("digits", model=my_module, data=(train_set, val_set))   # your own model and data
trainer = Trainer(load_config("digits")); trainer.fit(); trainer.close()
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vitrain.config import DEFAULT_RECIPE, Config, check_overrides, load_config, resolve_config_path, to_dict
from vitrain.engine.runs import check_handed_config, check_resume, resume_choice, resumed_config
from vitrain.engine.trainer import Trainer
from vitrain.parallel import shutdown


def config(
    source: str | Path | dict | Config | None = None, overrides: list[str] | None = None, check: bool = True
) -> Config:
    """A validated config from a recipe name or YAML path, a dict of sections, or a Config (with overrides)."""
    check_overrides(overrides)  # before the source is read: a lone string would be read letter by letter
    if isinstance(source, Config):
        return load_config(overrides=overrides, base=to_dict(source), check=check)
    if isinstance(source, dict):
        return load_config(overrides=overrides, base=source, check=check)
    return load_config(resolve_config_path(str(source or DEFAULT_RECIPE)), overrides, check=check)


def train(
    source: str | Path | dict | Config | None = None,
    overrides: list[str] | None = None,
    *,
    model: Any = None,
    data: Any = None,
    task: Any = None,
    resume: bool | str = False,
) -> dict[str, Any] | None:
    """Train a config and return its summary (summary.json's fields) on rank 0; None on the other ranks.

    `model`: an nn.Module or a factory of one (called with the model config) instead of `model.name`'s; `data`:
    (train, val) datasets (ImageSet-like: `classes`, `channels`, `__len__`, `read(index)`) or a function of the
    config returning them; `task`: a task object (vitrain.tasks.Task) instead of `task.name`'s. Under torchrun,
    every process calls it. The process group it opened is closed before it returns.

    `resume` (True: the run `source` and `overrides` name; "auto": that run when it exists, else a new one; or a run
    or step folder) continues that run with its own
    config (its config.yaml); `overrides` are applied on top, each change printed and logged, and one that a
    checkpoint cannot honour (the model, the task, the data order) is refused naming the key.
    """
    changes: dict[str, tuple[Any, Any]] = {}
    check_resume(resume)
    # auto, a requeued SLURM job, a run stopped by a signal: continue the run folder when it holds a run
    given = config(source, overrides, check=False)
    resume = resume_choice(given.run_dir, resume)
    if resume:  # the run's own config, the command line's overrides on top (each change said and logged)
        cfg, changes = resumed_config(given, resume, overrides or [])
        if isinstance(source, Config | dict):  # a recipe is the run's by name; a config handed in says more
            check_handed_config(given, cfg, changes)
    else:
        cfg = config(source, overrides)
    trainer = None
    try:
        trainer = Trainer(cfg, resume=resume, model=model, data=data, task=task, changes=changes)
        summary = trainer.fit()
        is_main = trainer.is_main
    finally:
        if trainer is not None:
            trainer.close()  # before the process group goes: see Trainer.close
        shutdown()
    return summary if is_main else None
