"""Which run folder a training process writes into and which checkpoint it continues: new, --resume, or restart."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from vitrain import checkpoint as ckpt
from vitrain.errors import CheckpointError

RUN_FILE = "run.json"  # names the launch that last wrote into the folder (for torchrun's automatic restarts)


@dataclass
class RunChoice:
    """The folder to write into, the checkpoint to load first (None: start at step 0), and what to tell the user."""

    run_dir: Path
    checkpoint: Path | None
    notes: list[str] = field(default_factory=list)


def choose_run(base: Path, resume: bool | str, launch: str, restart: int) -> RunChoice:
    """Decide on one process (rank 0) where a run goes; the caller creates the folder and shares the answer.

    - A torchrun restart (restart > 0) continues the folder that this launch wrote into, from its newest
      complete checkpoint, with no flag from the user.
    - `--resume` continues the latest complete checkpoint of `base`; `--resume PATH` takes a step folder, a run
      folder or its checkpoints/ folder, and continues in that checkpoint's own run folder.
    - Otherwise a new run takes `base`, or `base-1`, `base-2`, ... when `base` holds anything: a new run never
      writes into a folder that holds another run.
    """
    if restart > 0:
        own = _launched_folder(base, launch)
        if own is not None:
            choice = _continue(own, None)
            what = f"from {choice.checkpoint}" if choice.checkpoint else "from step 0 (no checkpoint was complete)"
            choice.notes.append(f"torchrun restart {restart}: continuing {own} {what}")
            return choice
    if resume:
        path = base if resume is True else Path(resume)
        if not path.exists():
            where = path / ckpt.CHECKPOINT_DIR if resume is True else path
            raise CheckpointError(f"--resume: no checkpoint at {where}; start without --resume")
        if ckpt.is_step_dir(path):
            return _continue(ckpt.run_dir_of(path), path)
        if path.is_file() or ((path / ckpt.META_FILE).exists() or (path / ckpt.LEGACY_META_FILE).exists()):
            ckpt.read_meta(path)  # says what is wrong with it
            return _continue(path.parent, path)  # a checkpoint folder outside a run: continue beside it
        return _continue(path.parent if path.name == ckpt.CHECKPOINT_DIR else path, None)
    run_dir, suffix = base, 1
    while run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        run_dir = base.with_name(f"{base.name}-{suffix}")
        suffix += 1
    return RunChoice(run_dir, None)


def _continue(run_dir: Path, checkpoint: Path | None) -> RunChoice:
    """Continue `run_dir`: clean what interrupted writes left, then the given or the newest complete checkpoint."""
    notes = [f"{what} in {run_dir / ckpt.CHECKPOINT_DIR}" for what in ckpt.clean_leftovers(run_dir)]
    if checkpoint is None:
        checkpoint = ckpt.latest(run_dir)
        if checkpoint is None:
            if not (run_dir / RUN_FILE).exists():
                raise CheckpointError(
                    f"--resume: {run_dir} holds no complete checkpoint and no vitrain run; start without --resume"
                )
            notes.append(f"{run_dir} holds no complete checkpoint yet: starting it over from step 0")
    return RunChoice(run_dir, checkpoint, notes)


def _launched_folder(base: Path, launch: str) -> Path | None:
    """The folder among base, base-1, base-2, ... whose run.json names this launch."""
    candidates = [base, *sorted(base.parent.glob(f"{base.name}-*"))] if base.parent.is_dir() else []
    for folder in candidates:
        try:
            if json.loads((folder / RUN_FILE).read_text()).get("launch") == launch:
                return folder
        except (OSError, ValueError, AttributeError):
            continue
    return None


def mark_run(run_dir: Path, launch: str, resumed_from: Path | None) -> None:
    """Create the folder and record which launch writes into it (a torchrun restart looks for this)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt.write_json(run_dir / RUN_FILE, {"launch": launch, "resumed_from": str(resumed_from) if resumed_from else None})
