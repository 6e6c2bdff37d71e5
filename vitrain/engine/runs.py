"""Which run folder a training process writes into and which checkpoint it continues: new, --resume, or restart."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from vitrain import checkpoint as ckpt
from vitrain.errors import CheckpointError

RUN_FILE = "run.json"  # marks a folder as a vitrain run; a new run creates it exclusively
SUPERSEDED = "superseded-"  # newer checkpoints moved aside when a run goes back to an earlier step


@dataclass
class RunChoice:
    """The folder to write into, the checkpoint to load first (None: start at step 0), and what to tell the user."""

    run_dir: Path
    checkpoint: Path | None
    is_new: bool = False
    notes: list[str] = field(default_factory=list)


# Checks a checkpoint's metadata against this run (the model config), raising a one-line error if it does not fit.
CheckpointCheck = Callable[[Path, dict], None]


def _no_check(path: Path, meta: dict) -> None:
    return None


def choose_run(
    base: Path, resume: bool | str, restarted_in: Path | None = None, check: CheckpointCheck = _no_check
) -> RunChoice:
    """Decide on one process (rank 0) where a run goes; the caller shares the answer with the other ranks.

    - A torchrun restart continues `restarted_in` (the folder this launch chose on its first try, kept in
      torchrun's store) from its newest complete checkpoint, with no flag from the user.
    - `--resume` continues the latest complete checkpoint of `base`; `--resume PATH` takes a step folder, a run
      folder or its checkpoints/ folder, and continues in that checkpoint's own run folder.
    - Otherwise a new run takes `base`, or `base-1`, `base-2`, ... when `base` holds anything: a new run never
      writes into a folder that holds another run.
    A checkpoint to continue is read (safely) and passed to `check` before anything in its folder changes.
    """
    if restarted_in is not None:
        choice = _continue(restarted_in, None, check)
        what = f"from {choice.checkpoint}" if choice.checkpoint else "from step 0 (no checkpoint was complete)"
        choice.notes.insert(0, f"torchrun restart: continuing {restarted_in} {what}")
        return choice
    if resume:
        path = base if resume is True else Path(resume)
        if not path.exists():
            where = path / ckpt.CHECKPOINT_DIR if resume is True else path
            raise CheckpointError(f"--resume: no checkpoint at {where}; start without --resume")
        if ckpt.is_step_dir(path) or path.is_file() or (path / ckpt.DCP_INDEX).exists():
            meta = ckpt.read_meta(path)  # refuses a damaged, incomplete or crafted checkpoint before anything else
            if not ckpt.is_step_dir(path):
                raise CheckpointError(
                    f"--resume {path}: a checkpoint continues in its run folder, RUN/checkpoints/step_N; "
                    "copy it to such a place (any RUN) and resume from there"
                )
            check(path, meta)
            return _continue(ckpt.run_dir_of(path), path, check, checked=True)
        return _continue(path.parent if path.name == ckpt.CHECKPOINT_DIR else path, None, check)
    run_dir, suffix = base, 1
    while run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        run_dir = base.with_name(f"{base.name}-{suffix}")
        suffix += 1
    return RunChoice(run_dir, None, is_new=True)


def _continue(run_dir: Path, checkpoint: Path | None, check: CheckpointCheck, checked: bool = False) -> RunChoice:
    """Continue `run_dir` from `checkpoint` or, when None, its newest complete one (after cleaning leftovers).

    Cleaning only removes what vitrain's own interrupted writes left; the newer checkpoints are moved aside only
    once the one to continue has been read and checked (`checked`: the caller already did).
    """
    notes = [f"{what} in {run_dir / ckpt.CHECKPOINT_DIR}" for what in ckpt.clean_leftovers(run_dir)]
    if checkpoint is None:
        checkpoint = ckpt.latest(run_dir)
        if checkpoint is None:
            if not (run_dir / RUN_FILE).exists():
                raise CheckpointError(
                    f"--resume: {run_dir} holds no complete checkpoint and no vitrain run; start without --resume"
                )
            notes.append(f"{run_dir} holds no complete checkpoint yet: starting it over from step 0")
            return RunChoice(run_dir, None, notes=notes)
    if not checked:
        check(checkpoint, ckpt.read_meta(checkpoint))
    notes += _supersede_newer(run_dir, checkpoint)
    return RunChoice(run_dir, checkpoint, notes=notes)


def _supersede_newer(run_dir: Path, checkpoint: Path) -> list[str]:
    """Going back to an earlier step: move the run's newer checkpoints aside, so that they are neither taken for
    the newest (by --resume or a restart) nor pruned in place of the new ones."""
    newer = [p for p in ckpt.step_dirs(run_dir) if p.name > checkpoint.name]
    for path in newer:
        path.rename(path.with_name(f"{SUPERSEDED}{path.name}"))
    if not newer:
        return []
    ckpt.fsync_dir(run_dir / ckpt.CHECKPOINT_DIR)
    names = ", ".join(p.name for p in newer)
    return [f"continuing the earlier {checkpoint.name}: the newer {names} moved aside as {SUPERSEDED}step_*"]


def mark_run(run_dir: Path, is_new: bool, resumed_from: Path | None) -> None:
    """Create the run folder and its run.json; a new run claims the folder exclusively.

    Two new runs started at once with the same name both see an empty folder; only the first to create run.json
    keeps it, the other stops with one line instead of writing into it.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt.fsync_dir(run_dir.parent)
    record = {"resumed_from": str(resumed_from) if resumed_from else None}
    if is_new:
        try:
            fd = os.open(run_dir / RUN_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            raise CheckpointError(
                f"{run_dir} was taken by another run started at the same time; start again (a new run then takes "
                "the next free name)"
            ) from None
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        ckpt.fsync_dir(run_dir)
    else:
        ckpt.write_json(run_dir / RUN_FILE, record)
