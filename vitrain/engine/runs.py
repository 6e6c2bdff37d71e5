"""Which run folder a training process writes into and which checkpoint it continues: new, --resume, or restart."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import fcntl
import json
import os
import socket
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vitrain import checkpoint as ckpt
from vitrain.config import (
    Config,
    config_from_dict,
    flatten,
    load_config,
    override_keys,
    read_config_file,
    to_dict,
    to_yaml,
    trusted_values,
)
from vitrain.data.loader import Position
from vitrain.data.names import IndexNames
from vitrain.engine.cluster import requeued, slurm_job
from vitrain.errors import CheckpointError, ConfigError
from vitrain.files import atomic_write, folder_problem
from vitrain.parallel import broadcast_object
from vitrain.parallel.distributed import RUN_DIR_KEY, all_or_none, launch_store, restart_count
from vitrain.parallel.pipeline import pipeline_ranks
from vitrain.trust import check_config
from vitrain.weights import WEIGHTS_FILE

if TYPE_CHECKING:
    from vitrain.engine.trainer import Trainer

RUN_FILE = "run.json"  # marks a folder as a vitrain run; a new run creates it exclusively
SUPERSEDED = "superseded-"  # newer checkpoints moved aside when a run goes back to an earlier step
RUN_LOCK = ".lock"  # flock'ed by the process that trains the run (rank 0), for as long as it does
# run folder -> (the lock file's descriptor this process holds, the owners holding it: Trainers, by their token)
_held_runs: dict[Path, tuple[int, set[object]]] = {}
_owner: contextvars.ContextVar[object] = contextvars.ContextVar("vitrain_run_owner", default=None)


@contextlib.contextmanager
def owned_by(owner: object) -> Iterator[None]:
    """Run folders locked inside (hold_run) are held for `owner` (a Trainer's token), let go by its release_run."""
    token = _owner.set(owner)
    try:
        yield
    finally:
        _owner.reset(token)


@dataclass
class RunChoice:
    """The folder to write into, the checkpoint to load first (None: start at step 0), and what to tell the user."""

    run_dir: Path
    checkpoint: Path | None
    is_new: bool = False
    notes: list[str] = field(default_factory=list)
    # The run's checkpoints after `checkpoint`, moved aside (move_aside) once it has loaded: a resume refused
    # before then leaves them where they were.
    newer: list[Path] = field(default_factory=list)


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


def hold_run(run_dir: Path) -> None:
    """Rank 0: lock the run folder for as long as this process trains it (release_run, or the process's end). Another
    process still training it (a second --resume while the first runs) is refused in one line before anything in the
    folder changes: cleaning its leftovers would remove the checkpoint it is writing. Where the file system has no
    flock, nothing is locked."""
    key = Path(run_dir).resolve()
    if key in _held_runs:  # this process holds it already (a library's other Trainer of the run): one more owner
        _held_runs[key][1].add(_owner.get())
        return
    try:
        fd = os.open(key / RUN_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise CheckpointError(
            f"{run_dir} is being trained by {holder}; wait for it to end (or stop it), then resume"
        ) from None
    except OSError:
        os.close(fd)
        return
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    _held_runs[key] = (fd, {_owner.get()})


def release_run(run_dir: Path, owner: object = None) -> None:
    """`owner` lets go of the run folder (hold_run); the lock goes with its last owner in this process."""
    key = Path(run_dir).resolve()
    held = _held_runs.get(key)
    if held is None:
        return
    held[1].discard(owner)
    if not held[1]:
        del _held_runs[key]
        os.close(held[0])


def _continue(run_dir: Path, checkpoint: Path | None, check: CheckpointCheck, checked: bool = False) -> RunChoice:
    """Continue `run_dir` from `checkpoint` or, when None, its newest complete one (after cleaning leftovers).

    Cleaning only removes what vitrain's own interrupted writes left; the newer checkpoints are listed to move aside
    (RunChoice.newer) once the one to continue has been read and checked (`checked`: the caller already did).
    """
    owner = _owner.get()
    held = owner in _held_runs.get(Path(run_dir).resolve(), (0, set()))[1]
    hold_run(run_dir)  # first: a process still training the run stops this one before its leftovers are touched
    try:
        return _continue_held(run_dir, checkpoint, check, checked)
    except BaseException:
        if not held:  # a refused resume lets go of the folder it took
            release_run(run_dir, owner)
        raise


def _continue_held(run_dir: Path, checkpoint: Path | None, check: CheckpointCheck, checked: bool) -> RunChoice:
    saves = run_dir / ckpt.CHECKPOINT_DIR
    if saves.exists() and not saves.is_dir():  # it would train, rewrite the run's files, then fail at its first save
        raise CheckpointError(
            f"--resume: {saves} is a file, not the run's checkpoints folder; move it away, then resume"
        )
    notes = [f"{what} in {run_dir / ckpt.CHECKPOINT_DIR}" for what in ckpt.clean_leftovers(run_dir)]
    stopped = read_run_file(run_dir).get("stopped")
    if isinstance(stopped, dict):
        signal_name, step = stopped.get("signal"), stopped.get("step")
        notes.append(f"{run_dir} was stopped by {signal_name} after step {step}: continuing it")
    if checkpoint is None:
        checkpoint = _newest_intact(run_dir, notes)
        # Every finished step damaged (checksums, or files missing or cut short under the marker its save wrote
        # last): refuse, keep them all. Steps without a readable marker may never have finished: a run that has
        # only those starts over (they are moved aside).
        finished = lambda: any(ckpt.marker_reads(p) for p in ckpt.step_folders(run_dir))  # noqa: E731
        if checkpoint is None and (ckpt.step_dirs(run_dir, warn=False) or finished()):
            raise CheckpointError(
                f"--resume: every checkpoint of {run_dir} is damaged (`vitrain checkpoint verify {run_dir}` names "
                "the files); restore them from a copy, or start a new run without --resume"
            )
        if checkpoint is None:
            if not (run_dir / RUN_FILE).exists():
                raise CheckpointError(
                    f"--resume: {run_dir} holds no complete checkpoint and no vitrain run; start without --resume"
                )
            notes.append(f"{run_dir} holds no complete checkpoint yet: starting it over from step 0")
            return RunChoice(run_dir, None, notes=notes, newer=_step_folders_after(run_dir, None))
    if not checked:  # read_meta (here or the caller's) verifies the checksums: a damaged step is refused by name
        check(checkpoint, ckpt.read_meta(checkpoint))
    return RunChoice(run_dir, checkpoint, notes=notes, newer=_step_folders_after(run_dir, checkpoint))


def _step_folders_after(run_dir: Path, checkpoint: Path | None) -> list[Path]:
    """The run's step folders after `checkpoint` (all of them for None), incomplete ones too: the continued run saves
    those steps again, and a save replaces a folder of its step, while an incomplete one may be whole files under a
    damaged marker."""
    after = "" if checkpoint is None else checkpoint.name
    return [p for p in ckpt.step_folders(run_dir) if p.name > after]


def _newest_intact(run_dir: Path, notes: list[str]) -> Path | None:
    """The newest complete step whose files match their checksums; each damaged newer one is noted (and later moved
    aside with the other newer ones)."""
    for step in reversed(ckpt.step_dirs(run_dir)):
        try:
            ckpt.verify(step)
        except ckpt.CheckpointDamaged as damaged:
            notes.append(f"checkpoint {step} is damaged ({damaged.file} does not match its checksum): resuming from "
                         "the step before it")  # fmt: skip
            continue
        return step
    return None


def move_aside(newer: list[Path], checkpoint: Path | None) -> list[str]:
    """Going back to an earlier step (None: starting over), once it has loaded (rank 0): move the run's newer step
    folders aside, so that they are neither taken for the newest (by --resume or a restart) nor pruned or replaced
    by the new saves of their steps."""
    for path in newer:
        # A step moved aside before (a run gone back twice) keeps its name: the later copy takes the next number.
        target, copy = path.with_name(f"{SUPERSEDED}{path.name}"), 1
        while target.exists():
            copy += 1
            target = path.with_name(f"{SUPERSEDED}{path.name}-{copy}")
        path.rename(target)
    if not newer:
        return []
    ckpt.fsync_dir(newer[0].parent)
    names = ", ".join(p.name for p in newer)
    if checkpoint is None:
        invalid = f"no valid {ckpt.COMPLETE_FILE} marker"
        return [f"starting over from step 0: {names} ({invalid}) moved aside as {SUPERSEDED}step_*"]
    return [f"continuing the earlier {checkpoint.name}: the newer {names} moved aside as {SUPERSEDED}step_*"]


def mark_stopped(run_dir: Path, step: int, signal_name: str) -> None:
    """Rank 0, after a stop's checkpoint: run.json says the run was stopped, so the same command continues it."""
    record = read_run_file(run_dir)
    record["stopped"] = {"step": step, "signal": signal_name}
    ckpt.write_json(run_dir / RUN_FILE, record)


def read_run_file(run_dir: Path) -> dict[str, Any]:
    """run.json's record ({} when missing or unreadable: it only marks the folder)."""
    try:
        record = json.loads((run_dir / RUN_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def check_arguments(cfg: Any, resume: Any) -> None:
    """A Trainer's `cfg` and `resume` as the library takes them, before anything is made: one line where not."""
    if not isinstance(cfg, Config):
        what = f"{cfg!r:.40}" if isinstance(cfg, str) else f"a {type(cfg).__name__}"
        raise ConfigError(
            f"Trainer(cfg): cfg is {what}, not a vitrain Config; make one with vitrain.load_config(source, overrides), "
            "e.g. vitrain.Trainer(vitrain.load_config('digits', ['train.epochs=2']))"
        )
    check_resume(resume)


def check_resume(resume: Any) -> None:
    """`resume`: True/False, "auto", or a run or checkpoint folder (a str or Path); anything else refused in one
    line (a list of overrides handed in its place included)."""
    if resume is None or isinstance(resume, bool | str | os.PathLike):  # None: a new run, as False
        return
    hint = "; overrides go to vitrain.load_config(source, overrides)" if isinstance(resume, list | tuple) else ""
    raise ConfigError(
        f"resume={resume!r:.40} must be True, False, 'auto', or a run or checkpoint folder (str or Path){hint}"
    )


def resume_choice(run_dir: Path, resume: bool | str, env: Mapping[str, str] = os.environ) -> bool | str:
    """What `resume` means for this launch, before any folder is chosen: `auto` continues `run_dir` when it holds
    a run (a checkpoint or run.json), else starts it; without a flag, the newest of `run_dir`, `run_dir-1`, ...
    that this requeued SLURM job wrote, or else that a signal stopped, is continued (the same command continues
    its run); a requeued job that wrote none means `auto`."""
    if resume is False:
        job = slurm_job(env) if requeued(env) else None
        mine = [d for d in _same_name_runs(run_dir) if job is not None and read_run_file(d).get("slurm_job") == job]
        stopped = [d for d in _same_name_runs(run_dir) if "stopped" in read_run_file(d)]
        if mine or stopped:
            return str((mine or stopped)[-1])
        resume = "auto" if job is not None else False
    if resume == "auto":
        return (run_dir / RUN_FILE).exists() or bool(ckpt.step_dirs(run_dir, warn=False))
    return resume


def _same_name_runs(base: Path) -> list[Path]:
    """`base`, `base-1`, `base-2`, ... as far as they exist: the folders runs of one name took (choose_run)."""
    found, suffix, path = [], 1, base
    while path.is_dir():
        found.append(path)
        path, suffix = base.with_name(f"{base.name}-{suffix}"), suffix + 1
    return found


def mark_run(run_dir: Path, is_new: bool, resumed_from: Path | None) -> None:
    """Create the run folder and its run.json; a new run claims the folder exclusively.

    Two new runs started at once with the same name both see an empty folder; only the first to create run.json
    keeps it, the other stops with one line instead of writing into it.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt.fsync_dir(run_dir.parent)
    record = {"resumed_from": str(resumed_from) if resumed_from else None, "slurm_job": slurm_job()}
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
    hold_run(run_dir)  # a resume holds it already (choose_run)


def check_same_model(path: Path, meta: dict, cfg: Config) -> None:
    """A checkpoint continues only a run of the same model: its weights must fit this config's model."""
    # The checkpoint's config names no code or command that this run's (the user's, or one checked) does not.
    saved = config_from_dict(meta["config"], Path(path) / ckpt.META_FILE, trusted_values(cfg))
    # init_from only chose the starting weights; the checkpoint's weights replace them either way. The attention
    # kernel computes the same function of the same weights (auto may pick another one on another machine).
    same = {"init_from": "", "inflate_from": "", "inflate": "average", "attention": "auto"}
    distilled = bool(saved.train.distill.teacher), bool(cfg.train.distill.teacher)  # DeiT's token and head or not
    ours, theirs = dataclasses.replace(cfg.model, **same), dataclasses.replace(saved.model, **same)
    differ = [f.name for f in dataclasses.fields(ours) if getattr(ours, f.name) != getattr(theirs, f.name)]
    if differ:
        key = differ[0]
        raise CheckpointError(
            f"checkpoint {path} was trained with model.{key}={_shown(getattr(theirs, key))}, this run has "
            f"{_shown(getattr(ours, key))} (its config.yaml or the command line); resume with the checkpoint's model.* "
            "keys"
        )
    if len(set(distilled)) > 1:
        raise CheckpointError(
            f"checkpoint {path} was trained {'with' if distilled[0] else 'without'} train.distill.teacher (its "
            "distillation token and head); resume with the checkpoint's train.distill.teacher"
        )


def check_same_optimizer(path: Path, meta: dict, cfg: Config) -> None:
    """A checkpoint continues only its own optimizer: another optim.name keeps other state (or none of it)."""
    saved = (meta["config"].get("optim") or {}).get("name", cfg.optim.name)
    if saved != cfg.optim.name:
        raise CheckpointError(optimizer_change_line(saved, cfg.optim.name, f"checkpoint {path}", ckpt.run_dir_of(path)))


def optimizer_change_line(old: str, new: str, where: str, run_dir: Path) -> str:
    """Why optim.name cannot change on resume, and the two ways on: the run's optimizer, or a new run from its
    weights."""
    return (
        f"--resume: optim.name={_shown(new)} differs from the run's {_shown(old)} ({where}); its saved optimizer "
        f"state cannot be loaded into {new}: resume without changing optim.name, or start a new run from its weights "
        f"(`vitrain export {run_dir} OUT`, then model.init_from=OUT/{WEIGHTS_FILE} optim.name={new})"
    )


def check_same_run(path: Path, meta: dict, cfg: Config) -> None:
    """What a checkpoint's metadata alone shows it cannot continue: another model or optimizer (before anything in
    its run folder changes)."""
    check_same_model(path, meta, cfg)
    check_same_optimizer(path, meta, cfg)


def check_resumable(path: Path, meta: dict, cfg: Config, engine: str) -> None:
    """Refuse, in one line, a checkpoint this run cannot continue: another model, optimizer or engine."""
    check_same_run(path, meta, cfg)
    saved_engine = meta.get("engine", "native")
    if saved_engine != engine:
        raise CheckpointError(
            f"checkpoint {path} was written by train.engine={saved_engine}; resume it with "
            f"train.engine={saved_engine} (`vitrain export` turns either into fp32 weights)"
        )


def _optimizer_changes(saved_config: dict, cfg: Config, keys: tuple[str, ...] | None = None) -> list[str]:
    """The optim.* values of `cfg` (those in `keys`, where given) that differ from a checkpoint's config, as
    `key=new (saved with old)`."""
    saved, now = flatten({"optim": saved_config.get("optim") or {}}), flatten({"optim": to_dict(cfg.optim)})
    return [f"{key}={_shown(value)} (saved with {_shown(saved[key])})" for key, value in now.items()
            if key in saved and saved[key] != value and (keys is None or key in keys)]  # fmt: skip


def rng_note(path: Path, saved_ranks: int, ranks: int, restored: bool) -> str | None:
    """What a resume on another number of ranks (or without saved RNG states) does with each rank's RNG."""
    if saved_ranks != ranks:
        kept = min(saved_ranks, ranks)
        what = f"ranks 0-{kept - 1} continue their own RNG states"
        if ranks > saved_ranks:
            what += f", ranks {saved_ranks}-{ranks - 1} start from seed + rank"
        else:
            what += f", the states of ranks {ranks}-{saved_ranks - 1} are not used"
        return f"checkpoint from {saved_ranks} processes, {ranks} now: {what}"
    if not restored:
        return f"checkpoint {path} holds no RNG state for this run's ranks: they start from seed + rank"
    return None


def agree_on_run(base: Path, resume: bool | str, is_main: bool, check: CheckpointCheck = _no_check) -> RunChoice:
    """Collective: rank 0 picks the run folder and the checkpoint to continue (`choose_run`); every rank gets it.

    Under torchrun the folder is also kept in the launch's store, where a restarted worker group finds it. `notes`
    say what choosing did (logged once the log is open).
    """
    with all_or_none("choosing the run folder"):
        choice = None
        if is_main:
            store = launch_store()
            restarted_in = None
            if restart_count() > 0 and store is not None and store.check([RUN_DIR_KEY]):
                restarted_in = Path(store.get(RUN_DIR_KEY).decode())
            choice = choose_run(base, resume, restarted_in, check=check)
            if store is not None:
                store.set(RUN_DIR_KEY, str(choice.run_dir))
    return broadcast_object(choice)


def checkpoint_meta(trainer: Trainer, is_best: bool = False) -> dict[str, Any]:
    """Everything but the tensors; the loader's Position is the layout-free data position (vitrain/data/loader.py),
    so the same world size resumes with the same samples and another one with none of the epoch's seen ones."""
    return {
        "config": to_dict(trainer.cfg),
        "engine": trainer.engine.name,
        "precision": trainer.engine.state_dict(),
        "step": trainer.step,
        "epoch": trainer.epoch,
        # Where the lr schedule stands, in steps of this layout: a resume with another number of steps per epoch
        # (train.accum_steps, the world size) continues it at the same point of training (restore).
        "schedule_step": trainer.step + trainer.schedule_offset,
        "steps_per_epoch": trainer.steps_per_epoch,
        "loader": trainer.train_loader.position(trainer.epoch, trainer.resume_at, trainer.batch_in_epoch).to_dict(),
        "best_metric": trainer.best_metric,
        "best_metric_name": trainer.task.best_metric,
        "last_eval": trainer.last_eval,
        "world_size": trainer.dist.world_size,
        "strategy": trainer.cfg.parallel.strategy,
        "is_best": is_best,
        "wall_s": trainer.wall_s(),  # the run's wall clock continues from here on resume (train.time_limit_s)
        "setup_s": trainer.setup_s,
        **_working_folder(),  # where relative data paths were read from (`vitrain eval` reads them there too)
        # A task whose data names its classes: export writes them beside the weights (classes.json), and builds a
        # model whose head the data sized (detection: the annotations' categories) without reading the data.
        **({"classes": list(names)} if (names := class_names(trainer.task)) else {}),
    }


def _working_folder() -> dict[str, str]:
    """{"cwd": the process's working folder}, or nothing where it cannot be read (removed while the run trains)."""
    try:
        return {"cwd": os.getcwd()}
    except OSError:
        return {}


# The config's paths a relative value may be given for (section, key): the data, a video run's baseline run folder
# and a face run's pairs files (a tuple, beside the named protocols).
MOVABLE_PATHS = (("data", "root"), ("data", "val_root"), ("data", "shard_index"), ("task", "baseline_run"),
                 ("task", "pairs"))  # fmt: skip
PAIR_PROTOCOLS = ("generated", "cfp-ff", "cfp-fp")  # task.pairs values that name no file


def from_training_folder(
    cfg: Config, meta: Mapping[str, Any], given: set[str], where: Path
) -> tuple[Config, list[str]]:
    """The checkpoint's config with each relative path that does not exist here, but does under the folder the run
    trained from (meta.json's `cwd`), read from there (`MOVABLE_PATHS`); and a line for each. Keys in `given` (set on
    the command line: relative to here; vitrain.config.override_keys) stay as they are, as does anything that names no
    file here or there (a shard pattern, a `pipe:` command, a pair protocol). The moved paths name files the trust
    check of the config at `where` could not read from here: they are checked again where they now point
    (vitrain/trust.py)."""
    folder = meta.get("cwd")
    if not isinstance(folder, str) or not os.path.isabs(folder):  # meta.json is anyone's to edit: absolute only
        return cfg, []
    moved: dict[str, dict[str, Any]] = {}
    lines = []
    for section, key in MOVABLE_PATHS:
        if f"{section}.{key}" in given:
            continue
        value = getattr(getattr(cfg, section), key)
        values = value if isinstance(value, tuple) else (value,)
        there = tuple(_there(folder, v) for v in values)
        if any(there):
            new = tuple(t or v for t, v in zip(there, values, strict=True))
            moved.setdefault(section, {})[key] = new if isinstance(value, tuple) else new[0]
            for v, t in zip(values, there, strict=True):
                if t:
                    lines.append(f"{section}.{key}={v} read from the folder the run trained in: {t}")
    if not moved:
        return cfg, []
    check_config({s: {k: v for k, v in keys.items() if isinstance(v, str)} for s, keys in moved.items()}, where)
    sections = {s: dataclasses.replace(getattr(cfg, s), **keys) for s, keys in moved.items()}
    return dataclasses.replace(cfg, **sections), lines


def _there(folder: str, value: str) -> str | None:
    """`value` under `folder`, where it is a relative path that names nothing here and something there; else None."""
    if not value or value in PAIR_PROTOCOLS or value.startswith(("pipe:", "~")) or os.path.isabs(value):
        return None
    there = Path(folder) / value
    try:
        return str(there) if not Path(value).exists() and there.exists() else None
    except OSError:  # a folder this user may not enter, a name too long: left to the reader's own line
        return None


def class_names(holder: Any) -> list[str] | None:
    """`holder.classes` where it is a non-empty list of names (a task's, or a checkpoint's meta.json read back);
    None for anything else (a user's task may keep a count or a tensor under that name) and for names made up from
    the label indices (vitrain/data/names.py)."""
    classes = holder.get("classes") if isinstance(holder, dict) else getattr(holder, "classes", None)
    if isinstance(classes, IndexNames):
        return None
    if isinstance(classes, list | tuple) and classes and all(isinstance(c, str) for c in classes):
        return list(classes)
    return None


def _saved_steps_per_epoch(meta: dict[str, Any], trainer: Trainer) -> int | None:
    """The checkpoint's steps per epoch. A checkpoint written before meta.json kept them: this run's loader counts
    them from the checkpoint's replicas (world size over pipeline ranks) and train.accum_steps, as the batch and the
    data are frozen on resume; None where the replicas differ and the loader cannot count another split."""
    if meta.get("steps_per_epoch"):
        return meta["steps_per_epoch"]
    saved = load_config(base=meta["config"], check=False)
    replicas = meta.get("world_size", 1) // pipeline_ranks(saved.parallel)
    if replicas == trainer.dist.data_size:
        return len(trainer.train_loader) // saved.train.accum_steps
    batches_with = getattr(trainer.train_loader, "batches_with", None)
    return batches_with(replicas) // saved.train.accum_steps if batches_with else None


def _schedule_step(meta: dict[str, Any], trainer: Trainer) -> int:
    """The step the lr schedule (and token dropping, progressive resizing) continues from. A checkpoint written with
    another number of steps per epoch (train.accum_steps, the world size or the batch changed on resume) stood at
    the same share of training in its own steps: counted in this run's, its step would skip or repeat part of the
    schedule (half of warmup skipped, and the run's last steps at the minimum rate, after 1 -> 2 accumulation)."""
    at, now = meta.get("schedule_step", meta["step"]), trainer.steps_per_epoch
    saved = _saved_steps_per_epoch(meta, trainer)
    if saved is None:
        trainer.notes.append(
            f"checkpoint written before checkpoints kept their steps per epoch, under another layout (world size, "
            f"pipeline or train.accum_steps), from a loader that cannot count them for it: the lr schedule continues "
            f"at its step {at} counted in this run's {now} steps per epoch, which may skip or repeat part of it"
        )
    if not saved or saved == now:
        return at
    moved = round(at * now / saved)
    trainer.notes.append(
        f"{now} steps per epoch, {saved} when the checkpoint was written: the lr schedule continues at "
        f"its step {moved} of {now} per epoch (the checkpoint's {at} of {saved}), the same point of "
        f"training; step numbers go on from {meta['step']}"
    )
    return moved


def restore(trainer: Trainer, path: Path) -> None:
    """Collective: continue `trainer` from the checkpoint at `path` (checked first on every rank)."""
    # Every rank reads and checks before the collective load: one rank's failure stops all of them.
    with all_or_none(f"reading checkpoint {path}"):
        meta = ckpt.read_meta(path)
        check_resumable(path, meta, trainer.cfg, trainer.engine.name)
    try:
        restored = trainer.engine.load(path, meta)
    except ckpt.StateMismatch as mismatch:  # intact files, other optimizer state: name the optim.* values changed
        changed = _optimizer_changes(meta["config"], trainer.cfg, mismatch.shaped_by)
        if not changed:
            raise
        raise CheckpointError(
            f"checkpoint {path} holds no optimizer state for {', '.join(changed)}: resume with the values it was "
            "saved with, or start a new run from its weights (`vitrain export`, then model.init_from=)"
        ) from mismatch
    trainer.step, trainer.epoch = meta["step"], meta["epoch"]
    trainer.schedule_offset = _schedule_step(meta, trainer) - meta["step"]
    # Checkpoints before the loader kept its Position held the epoch's consumed samples as samples_in_epoch.
    saved = meta.get("loader") or {"epoch": meta["epoch"], "samples": meta.get("samples_in_epoch", 0)}
    trainer.resume_at, trainer.batch_in_epoch = Position.from_dict(saved), 0
    # Checkpoints before the task seam kept the classifier's best top-1 as best_top1 (-1.0: no evaluation yet).
    old_best = meta["best_top1"] if meta.get("best_top1", -1.0) >= 0 else None
    trainer.best_metric = meta["best_metric"] if "best_metric" in meta else old_best
    trainer.last_eval = meta["last_eval"]
    trainer.started -= meta.get("wall_s", 0.0)
    trainer.setup_s = meta.get("setup_s")
    note = rng_note(path, meta.get("world_size", 1), trainer.dist.world_size, restored)
    if note:
        trainer.notes.append(note)


# What a checkpoint cannot continue under another value: the model's shape (a distilled student's token and head
# included), the task, and the data order.
FROZEN_ON_RESUME = ("model.", "task.", "data.source", "data.root", "data.train_split", "data.val_split",
                    "data.val_fraction", "data.repeated_aug", "train.seed", "train.batch_size",
                    "train.distill.teacher")  # fmt: skip
# same weights, or where the run lives
FREE_ON_RESUME = ("model.attention", "model.init_from", "model.inflate_from", "model.inflate", "name", "log.out_dir")
CONFIG_HISTORY = "config_history.jsonl"
TRAINED_IN = "read from the folder the run trained in"  # why a resume changed a relative path (resumed_config)


def resumed_config(cfg: Config, resume: bool | str, overrides: list[str]) -> tuple[Config, dict[str, tuple]]:
    """The config a resume continues: the run's own config.yaml with `overrides` on top, and what they changed
    ({key: (run's value, new value)}; a third item says why where the command line did not: a relative path read
    where the run trained). A change a checkpoint cannot honour is refused naming the key; a run with no
    config.yaml yet (it never started) is resumed with `cfg`."""
    path = cfg.run_dir if resume is True else Path(resume)
    run_dir = ckpt.run_dir_of(path) if ckpt.is_step_dir(path) else path
    if run_dir.name == ckpt.CHECKPOINT_DIR:
        run_dir = run_dir.parent
    saved_file = run_dir / "config.yaml"
    restore_it = (
        'restore it from a copy (each checkpoint\'s meta.json holds the config it was saved with, under "config")'
    )
    if not saved_file.is_file():
        if ckpt.step_dirs(run_dir, warn=False):  # config.yaml is written as a run starts, before its first checkpoint
            raise CheckpointError(f"--resume: {saved_file} is missing from the run folder; {restore_it}")
        return load_config(base=to_dict(cfg)), {}  # a run that never started (or no run: choose_run says so)
    try:
        saved_raw = read_config_file(saved_file, fix=restore_it)
    except ConfigError as error:
        raise CheckpointError(f"--resume: {error}") from None
    if not saved_raw:  # an empty recipe means the defaults; an empty run config means it was lost
        raise CheckpointError(f"--resume: {saved_file} holds nothing, not the run's config; {restore_it}")
    saved = load_config(base=saved_raw, check=False)  # what the run had; the config that runs is checked below
    # The run folder's config names no code or command that the user's config and command line do not (trust.py).
    resumed = load_config(base=saved_raw, overrides=overrides, untrusted=saved_file, trusted=trusted_values(cfg))
    changes = config_changes(saved, resumed)
    for key, (old, new) in changes.items():
        if key == "optim.name":
            raise CheckpointError(optimizer_change_line(old, new, str(saved_file), run_dir))
        if key.startswith(FROZEN_ON_RESUME) and key not in FREE_ON_RESUME:
            raise CheckpointError(
                f"--resume: {key}={_shown(new)} differs from the run's {_shown(old)} ({saved_file}); a checkpoint "
                f"continues only its own model, task and data order: drop {key} from the command line or start a "
                "new run without --resume"
            )
    # Resumed from another folder: relative paths that name nothing here are read where the run trained, as by eval.
    moved, _ = from_training_folder(resumed, _trained_in(path, run_dir), override_keys(overrides), saved_file)
    kept = {key: change for key, change in changes.items() if key not in FREE_ON_RESUME}
    return moved, {**kept, **{key: (*change, TRAINED_IN) for key, change in config_changes(resumed, moved).items()}}


def _trained_in(path: Path, run_dir: Path) -> dict[str, Any]:
    """The resumed checkpoint's meta.json (the step folder given, else the run's newest), for where it trained; {}
    where there is none or it cannot be read (the resume's own checks say why, where it matters)."""
    step = path if ckpt.is_step_dir(path) else ckpt.latest(run_dir, warn=False)
    try:
        meta = json.loads((step / ckpt.META_FILE).read_text()) if step is not None else {}
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def check_handed_config(given: Config, resumed: Config, changes: Mapping[str, tuple] | None = None) -> None:
    """The library's resume with a Config (or dict) handed in: the run continues with its own config.yaml and the
    overrides, so a value of the handed-in config that differs from the run's (and is not `auto`, which the run
    resolved) would be ignored; refused in one line naming the keys, to be passed as overrides instead. Paths the
    resume read where the run trained (`changes` with a reason) are the run's own values, moved: not differences."""
    located = ("name", "log.out_dir")  # where the run lives, found by them or by the resume path
    moved = {k: change[0] for k, change in (changes or {}).items() if len(change) > 2}  # the run's value before
    differ = {k: (moved.get(k, run), mine) for k, (run, mine) in config_changes(resumed, given).items()
              if mine != "auto" and k not in located and (k not in moved or mine != moved[k])}  # fmt: skip
    if differ:
        shown = ", ".join(
            f"{k}={_shown(mine)} (the run's {_shown(run)})" for k, (run, mine) in list(differ.items())[:4]
        )
        more = f" and {len(differ) - 4} more" if len(differ) > 4 else ""
        key = next(iter(differ))
        first = f"{key}={_shown(differ[key][1])}"
        raise ConfigError(
            f"resume: a run continues with its own config.yaml and the overrides, but the config handed in differs in "
            f"{shown}{more}; pass changes as overrides, e.g. vitrain.train(source, ['{first}'], resume=...)"
        )


def config_changes(before: Config, after: Config) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (before's value, after's)} for every key whose value `after` changes."""
    old, new = flatten(to_dict(before)), flatten(to_dict(after))
    return {key: (old.get(key), value) for key, value in new.items() if value != old.get(key)}


def change_lines(changes: dict[str, tuple]) -> list[str]:
    """A line per change of a resume's config: (old, new) from the command line, or (old, new, why)."""
    return [f"{key}: {_shown(c[0])} -> {_shown(c[1])} ({c[2] if len(c) > 2 else 'command line'})"
            for key, c in changes.items()]  # fmt: skip


def write_run_files(trainer: Trainer) -> None:
    """Rank 0, as a run starts or resumes: the run's marker, config.yaml (the old one kept where a resume changed
    it), and autotune's decision."""
    run_dir = trainer.run_dir
    mark_run(run_dir, trainer.is_new_run, trainer.resume_path)
    if trainer.changes:
        keep_config_history(run_dir, trainer.resume_path, trainer.changes)
    cfg = trainer.cfg
    # What autotune chose stays auto in config.yaml: a resume keeps the decision (autotune.json) for the same step,
    # whose cache key holds the auto values as auto.
    for key in trainer.tuned.values if trainer.tuned is not None else ():
        section, name = key.split(".")
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{name: "auto"})})
    atomic_write(run_dir / "config.yaml", to_yaml(cfg).encode())
    if trainer.tuned is not None:
        atomic_write(run_dir / "autotune.json", (json.dumps(trainer.tuned.to_json(), indent=2) + "\n").encode())


def keep_config_history(run_dir: Path, checkpoint: Path | None, changes: dict[str, tuple]) -> None:
    """Before a resume's changed config replaces config.yaml: the old one kept beside it (never over an earlier copy),
    the change appended to config_history.jsonl."""
    old = run_dir / "config.yaml"
    at = checkpoint.name if checkpoint is not None else "step_00000000"
    if old.is_file():  # a second resume at the same step keeps the first copy: the next free number
        kept, n = run_dir / f"config.before-resume-at-{at}.yaml", 1
        while kept.exists():
            n += 1
            kept = run_dir / f"config.before-resume-at-{at}.{n}.yaml"
        atomic_write(kept, old.read_bytes())
    record = {"resumed_from": str(checkpoint), "changes": {k: list(change[:2]) for k, change in changes.items()}}
    with open(run_dir / CONFIG_HISTORY, "a") as history:
        history.write(json.dumps(record) + "\n")


def _shown(value: Any) -> str:
    return json.dumps(value)


def check_run_home(cfg: Config) -> None:
    """Refuse, before anything is made, a run name that is not a folder of its own inside log.out_dir (. and ..), and
    a log.out_dir that is a file, lies under one or cannot be written."""
    if cfg.name in (".", ".."):
        raise ConfigError(
            f"name={cfg.name} would put the run outside log.out_dir={cfg.log.out_dir}; give it a name of its own, e.g. "
            "name=digits"
        )
    problem = folder_problem(Path(cfg.log.out_dir))
    if problem is not None:
        raise ConfigError(f"log.out_dir={cfg.log.out_dir}: {problem}; point log.out_dir at a folder for the runs")
