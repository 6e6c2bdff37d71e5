"""Reshardable, crash-safe checkpoints that load without running code: DCP step folders, JSON metadata, a marker.

Layout of a run: `RUN/checkpoints/step_00000500/` holds the DCP shards of the model and optimizer (each rank
writes its own, each rank's RNG state among them) plus `meta.json` (config, step, data position, best metric)
and, written last, `COMPLETE` (every file of the folder with its size and XXH3-64 checksum). Tensors are saved
under their single-device names (`model.blocks.0.attn.qkv.weight`), so a checkpoint written by one strategy and
world size loads under any other: 2 ranks zero3 -> 1 process, 1 -> 2 ranks, zero3 -> ddp.

Crash safety: a save fills `.tmp-step_N`, fsyncs every file and the folder, writes `COMPLETE`, then renames the
folder into place and fsyncs its parent. A folder without a valid `COMPLETE` is never taken for a checkpoint;
`clean_leftovers` removes what an interrupted save or prune left behind.

Damage: `COMPLETE` holds each file's XXH3-64 (xxhash, ~30 GB/s on one core of the 2-core EPYC; read through mmap
while the files are still in the page cache: results/checkpoint-checksum). `verify` recomputes them: resume falls
back to the previous complete step when the newest is damaged, eval and export refuse it, `vitrain checkpoint
verify` reports it; each names the file.

Safety: nothing is unpickled in a way that can run code. `meta.json` is JSON; tensors are read with
`weights_only=True`; DCP's pickled `.metadata` index is read by an unpickler that knows only DCP's metadata
classes. Checkpoints of the earlier format (`meta.pt`) are read with `weights_only=True` as well.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import mmap
import os
import pickle
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch import nn
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict
from torch.distributed.optim import ZeroRedundancyOptimizer

from vitrain.errors import CheckpointError, VitrainError
from vitrain.files import atomic_write, fsync_dir
from vitrain.optim.flat import ensure_state, is_flat, per_parameter_state
from vitrain.parallel.distributed import all_or_none, is_distributed, rank
from vitrain.parallel.strategies import unwrap
from vitrain.weights import without_protocol_note

FORMAT_VERSION = 3
CHECKPOINT_DIR = "checkpoints"
META_FILE = "meta.json"
LEGACY_META_FILE = "meta.pt"  # format 2: a pickle, read only with weights_only=True
COMPLETE_FILE = "COMPLETE"
CHECKSUM = "xxh3_64"  # the COMPLETE marker's key for the files' checksums
DCP_INDEX = ".metadata"
DEEPSPEED_DIR = "deepspeed"  # train.engine=deepspeed: DeepSpeed's own files, in place of the DCP shards
BEST_POINTER = "best"
RNG_KEY = "rng"
_STEP_DIR = re.compile(r"^step_(\d+)$")
# Prefixes of what interrupted saves and prunes leave in checkpoints/: never checkpoints, removed on start.
_TMP, _OLD, _TRASH = ".tmp-", ".old-", ".trash-"
# One process without a process group is a normal case here, not worth DCP's warning on every save and load; a
# filter of the whole process as well, for the async writer's thread (catch_warnings holds only for its caller).
_ONE_PROCESS = "torch.distributed is .*unavailable or uninitialized"
warnings.filterwarnings("ignore", message=_ONE_PROCESS)


# ---------------------------------------------------------------------------------------------- files


def write_json(path: Path, value: Any) -> None:
    # NaN stays NaN (an evaluation can overflow in bf16); Python's json reads it back.
    atomic_write(path, (json.dumps(value, indent=1) + "\n").encode())


# ---------------------------------------------------------------------------------------------- which folders


def _listed_files(folder: Path) -> dict[str, int]:
    """Every file under `folder` (paths relative to it, subfolders' too) with its size, but the marker; a symbolic link
    is no file of the folder (is_file follows it) and is not listed."""
    files = (p for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink() and p.name != COMPLETE_FILE)
    return {p.relative_to(folder).as_posix(): p.stat().st_size for p in files}


def file_checksums(folder: Path, names: list[str]) -> dict[str, str]:
    """XXH3-64 of each named file under `folder` (hex), read through mmap (no copy out of the page cache), two files
    at a time (xxhash releases the GIL)."""

    def digest(name: str) -> str:
        with open(folder / name, "rb") as handle:
            if os.fstat(handle.fileno()).st_size == 0:
                return xxhash.xxh3_64(b"").hexdigest()
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                return xxhash.xxh3_64(mapped).hexdigest()

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(names, pool.map(digest, names), strict=True))


class CheckpointDamaged(CheckpointError):
    """A file of a complete step folder does not match the checksum written with it."""

    def __init__(self, path: Path, name: str, actual: str, expected: str, why: str = ""):
        self.path, self.file = path, name
        why = why or f"{name} does not match the checksum written with it (XXH3-64 {actual} != {expected})"
        super().__init__(
            f"checkpoint {path} is damaged: {why}; use an earlier step (`vitrain checkpoint verify "
            f"{run_dir_of(path)}` lists them)"
        )


class StateMismatch(CheckpointError):
    """A checkpoint's intact files do not hold the state this run loads into them: a setting that shapes it (the
    optimizer's, the model's) differs from the one it was saved with. `shaped_by`: the config keys that can make this
    difference, where fewer than all optim.* ones do (runs.restore names those changed)."""

    def __init__(self, message: str, shaped_by: tuple[str, ...] | None = None):
        super().__init__(message)
        self.shaped_by = shaped_by


class CheckpointRefused(CheckpointError):
    """A step folder vitrain never writes: a file its marker or DCP index names lies outside it (a path leading out, a
    symbolic link) or its index contradicts itself. `reason` says what, without the folder."""

    def __init__(self, path: Path, reason: str):
        self.path, self.reason = path, reason
        super().__init__(
            f"checkpoint {path}: {reason}; refusing to load it (vitrain writes no such checkpoint: it was altered or "
            "crafted): use checkpoints you wrote or got from a source you trust"
        )


def _not_inside(folder: Path, name: Any, flat: bool = False) -> str | None:
    """Why `name` (relative to step folder `folder`) is not a plain file inside it, or None: a path leading out of
    it, a symbolic link on the way, or (`flat`: DCP's data files lie directly in the folder) a subfolder's file."""
    if not isinstance(name, str) or not name or "\x00" in name:
        return "which is not a file name"
    parts = name.split("/")
    if os.path.isabs(name) or "\\" in name or any(part in ("", ".", "..") for part in parts):
        return "a path leading out of the step folder"
    if flat and len(parts) > 1:
        return "a file in a subfolder, where DCP's data files lie directly in the step folder"
    here = Path(folder)
    for part in parts:
        here = here / part
        if here.is_symlink():
            return f"a symbolic link (to {os.readlink(here)}), not a file of the step folder"
    return None


def _listed_names(path: Path) -> set[str] | None:
    """Every name a step folder's COMPLETE marker lists (for its size or its checksum); None without a marker."""
    marker = Path(path) / COMPLETE_FILE
    if not marker.is_file():
        return None
    try:
        listed = json.loads(marker.read_text())
        return {*listed["files"], *(listed.get(CHECKSUM) or {})}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointError(
            f"checkpoint {path} is incomplete (its {COMPLETE_FILE} marker cannot be read); use an earlier complete step"
        ) from None


def check_listed(path: Path) -> None:
    """Every file a step folder's COMPLETE marker lists is a plain file inside the folder: a listed path leading out
    of it or a symbolic link would have its size and checksum vouch for another folder's file."""
    for name in sorted(_listed_names(path) or (), key=str):
        reason = _not_inside(path, name)
        if reason:
            raise CheckpointRefused(Path(path), f"its {COMPLETE_FILE} marker lists {name!r}, {reason}")


_verified: dict[Path, float] = {}  # step folder -> its marker's mtime when it was last verified in this process


def verify(path: Path) -> None:
    """Recompute every file's checksum of a complete step folder against its COMPLETE marker; a mismatch is a
    CheckpointError naming the file. Folders written before checksums were kept pass (they have none). A file the
    marker or the DCP index names outside the folder (check_listed, SafeFileSystemReader) is CheckpointRefused."""
    path = Path(path)
    marker = path / COMPLETE_FILE
    if not marker.is_file():
        return
    stamp = marker.stat().st_mtime
    if _verified.get(path.resolve()) == stamp:
        return
    check_listed(path)  # before a byte is read: a listed symbolic link would be checksummed as the folder's own
    listed = json.loads(marker.read_text())
    expected = (listed.get(CHECKSUM) or {}) if isinstance(listed, dict) else None
    files = listed.get("files") if isinstance(listed, dict) else None
    if not isinstance(expected, dict) or not isinstance(files, dict) or not set(expected) <= set(files):
        odd = sorted(set(expected) - set(files)) if isinstance(expected, dict) and isinstance(files, dict) else []
        what = f"checksums for {odd[0]!r}, a file it does not list" if odd else "no files and checksums it can read"
        raise CheckpointDamaged(path, COMPLETE_FILE, "", "", why=f"its {COMPLETE_FILE} marker holds {what}")
    if not all(isinstance(v, str) for v in expected.values()):
        raise CheckpointDamaged(path, COMPLETE_FILE, "", "", why=f"its {COMPLETE_FILE} marker's checksums are not text")
    actual = file_checksums(path, sorted(expected))
    for name in sorted(expected):
        if actual[name] != expected[name]:
            raise CheckpointDamaged(path, name, actual[name], expected[name])
    if (path / DCP_INDEX).is_file():
        read_index(path)  # intact files whose index points elsewhere are not the checkpoint they claim to be
    _verified[path.resolve()] = stamp


def verify_report(path: Path) -> list[tuple[Path, bool, str]]:
    """(step folder, intact, what it is) for a step folder or every step folder of a run, without loading any:
    complete and matching its checksums, incomplete (no marker), or damaged (which file)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint verify: {path} does not exist; give a run folder or a step folder")
    if path.is_file():
        raise CheckpointError(f"checkpoint verify: {path} is a file, not a run or step folder; give {_folder_of(path)}")
    if _STEP_DIR.match(path.name):
        steps = [path]
    else:
        root = path if path.name == CHECKPOINT_DIR else path / CHECKPOINT_DIR
        if not root.is_dir():
            raise CheckpointError(f"checkpoint verify: {path} holds no {CHECKPOINT_DIR}/ folder; give a run folder")
        steps = step_folders(root.parent)
    report = []
    for step in steps:
        kind = " (DeepSpeed's files)" if (step / DEEPSPEED_DIR).is_dir() else ""
        if not (step / COMPLETE_FILE).is_file():
            report.append((step, False, f"incomplete: no {COMPLETE_FILE} marker (its write was interrupted)"))
        elif not marker_reads(step):
            report.append((step, False, f"damaged: its {COMPLETE_FILE} marker cannot be read (not the JSON it was)"))
        elif not is_complete(step):
            report.append((step, False, f"damaged: {size_problem(step) or 'its files differ from ' + COMPLETE_FILE}"))
        else:
            listed = json.loads((step / COMPLETE_FILE).read_text())
            try:
                verify(step)
            except CheckpointDamaged as damaged:
                report.append((step, False, f"damaged: {damaged.file} does not match its checksum (XXH3-64)"))
                continue
            except CheckpointError as refused:  # CheckpointRefused, or an index that does not unpickle safely
                report.append((step, False, f"refused: {getattr(refused, 'reason', refused)}"))
                continue
            size = sum(listed["files"].values()) / 2**20
            checked = "each file matches its XXH3-64" if listed.get(CHECKSUM) else "sizes match (no checksums: older)"
            report.append((step, True, f"intact: {len(listed['files'])} files, {size:.1f} MiB, {checked}{kind}"))
    return report


def _folder_of(file: Path) -> str:
    """What to verify instead of a file: the step or run folder it belongs to, where it belongs to one."""
    parent = file.parent
    if _STEP_DIR.match(parent.name):
        return f"its step folder {parent} (or the run folder {run_dir_of(parent)}, for every step)"
    if parent.name == CHECKPOINT_DIR:
        return f"the run folder {parent.parent}"
    if (parent / CHECKPOINT_DIR).is_dir():
        return f"the run folder {parent}"
    return f"a run folder (the one holding {CHECKPOINT_DIR}/) or a step folder ({CHECKPOINT_DIR}/step_00000100 in it)"


def marker_reads(path: Path) -> bool:
    """Whether a step folder's COMPLETE marker is what a save writes, a JSON object with a "files" object: a garbled
    one is named as such, not taken for a missing or short file."""
    try:
        listed = json.loads((Path(path) / COMPLETE_FILE).read_text())
        return isinstance(listed, dict) and isinstance(listed.get("files"), dict)
    except (OSError, ValueError):
        return False


def size_problem(path: Path) -> str:
    """Where a COMPLETE marker and the files disagree: the first file missing or of another size ("": none). A marker
    that is not a save's raises (is_complete, marker_reads)."""
    listed = json.loads((Path(path) / COMPLETE_FILE).read_text())["files"]
    for name, size in sorted(listed.items()):
        file = Path(path) / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes where its {COMPLETE_FILE} marker lists {size}"
    return ""


def is_complete(path: Path) -> bool:
    """A step folder whose save finished: its COMPLETE marker lists every file with the size it still has.

    A folder of the earlier format (meta.pt, no marker) counts as complete: that format renamed a folder into
    place only after all of it was written.
    """
    path = Path(path)
    marker = path / COMPLETE_FILE
    if not marker.is_file():
        return (path / LEGACY_META_FILE).is_file() and (path / DCP_INDEX).is_file() and not (path / META_FILE).exists()
    try:
        return size_problem(path) == ""
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def step_folders(run_dir: Path) -> list[Path]:
    """Every step folder of a run, complete or not, oldest first (step_dirs keeps the complete ones)."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir())
    return [path for _, path in found]


def step_dirs(run_dir: Path, warn: bool = True) -> list[Path]:
    """Complete checkpoints of a run, oldest first; incomplete step folders are skipped, with a warning where `warn`.

    A command lists a run's steps many times (to choose one, to find the newer ones, at each prune, for the summary):
    only the call that chooses the checkpoint warns, so that a skipped folder is said once, not at each listing."""
    complete = []
    for path in step_folders(run_dir):
        if is_complete(path):
            complete.append(path)
        elif warn:
            warnings.warn(
                f"checkpoint {path} is incomplete (its write was interrupted or it was damaged); skipped", stacklevel=2
            )
    return complete


def latest(run_dir: Path, warn: bool = True) -> Path | None:
    dirs = step_dirs(run_dir, warn)
    return dirs[-1] if dirs else None


def best(run_dir: Path) -> Path | None:
    pointer = Path(run_dir) / CHECKPOINT_DIR / BEST_POINTER
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    return path if _STEP_DIR.match(path.name) and path.is_dir() and is_complete(path) else None


def clean_leftovers(run_dir: Path) -> list[str]:
    """Remove what interrupted saves and prunes left in a run's checkpoints/ folder; returns what it did.

    `.old-step_N` is the previous copy of a step being re-saved: when the crash came between the two renames
    (no `step_N` any more) and that copy is complete, it is put back instead of removed.
    """
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    done = []
    # A finished `.tmp-step_N` is newer than an `.old-step_N` of the same step: it goes first.
    for path in sorted(root.iterdir(), key=lambda p: (not p.name.startswith(_TMP), p.name)):
        name = path.name
        if name.startswith((_OLD, _TMP)) and path.is_dir():
            # A finished write whose rename never happened, or the old copy of a step being re-saved.
            final = root / name[len(_OLD if name.startswith(_OLD) else _TMP) :]
            if _STEP_DIR.match(final.name) and not final.exists() and is_complete(path):
                path.rename(final)
                done.append(f"restored {final.name}")
                continue
        if name.startswith((_TMP, _OLD, _TRASH)) or (name.startswith(".") and name.endswith(".tmp")):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            done.append(f"removed {name}")
    if done:
        fsync_dir(root)
    return done


# ---------------------------------------------------------------------------------------------- save


def rng_state() -> dict[str, torch.Tensor]:
    """This process's RNG state as tensors (dropout and drop-path draw from it)."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    """Restore what `rng_state` gave (its CUDA part only where CUDA is available)."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _dcp_save(state: dict[str, Any], path: Path) -> None:
    with _one_process_is_normal():
        dcp.save(state, storage_writer=FileSystemWriter(path, sync_files=True), no_dist=not is_distributed())


@contextlib.contextmanager
def _one_process_is_normal() -> Iterator[None]:
    """DCP's warning for one process without a process group silenced where the caller (pytest) put its own
    filters before the module's (the module's covers the async writer's thread)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_ONE_PROCESS)
        yield


def save(
    run_dir: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    meta: dict[str, Any],
    keep: int,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Collective: every rank writes its DCP shards into a temporary folder that rank 0 completes and renames.

    `extra` holds more tensors to save beside the model and optimizer (top-level keys); `load_extra` reads them.
    A failure on any rank (a full disk, an unwritable folder) raises the same error on every rank and leaves
    the previous checkpoints as they were.
    """
    return save_folder(
        run_dir, step, meta, keep, lambda folder: _dcp_save(state_to_save(model, optimizer, extra), folder)
    )


def state_to_save(model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any] | None) -> dict[str, Any]:
    """What a DCP checkpoint holds: model, optimizer, this rank's RNG state, and the engine's extra tensors."""
    model_state, optim_state = training_state(model, optimizer)
    own_rng = {f"rank{rank()}": rng_state()}
    return {"model": model_state, "optim": optim_state, RNG_KEY: own_rng, **(extra or {})}


def save_folder(run_dir: Path, step: int, meta: dict[str, Any], keep: int, write: Callable[[Path], None]) -> Path:
    """Collective: a step folder with the crash-safe protocol of this module; `write(folder)` (on every rank)
    fills it with an engine's files (DCP shards, DeepSpeed's files), then rank 0 adds meta.json and COMPLETE."""
    final, tmp, what = _prepare(run_dir, step)
    try:
        with all_or_none(what):
            write(tmp)
        with all_or_none(what):
            if rank() == 0:
                _complete(tmp, final, step, meta, keep)
    except Exception:
        if rank() == 0:  # what a failed save wrote goes; the checkpoints before it stay as they were
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


class PendingSave:
    """A checkpoint whose files a background thread is writing. `wait()` (collective) returns its folder once it is
    complete, or raises the same error on every rank when any rank's write failed (its temporary folder removed)."""

    def __init__(self, final: Path, tmp: Path, done: Future, what: str):
        self.final, self.tmp, self.done, self.what = final, tmp, done, what

    def wait(self) -> Path:
        try:
            with all_or_none(self.what):
                self.done.result()
        except Exception:
            if rank() == 0:
                shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        return self.final


class ReusedStaging(AsyncStager):
    """DCP staging into host buffers kept from one async save to the next. Filling fresh buffers costs their page
    faults (a 1 GB state: 2.7 s in a 2-core KVM guest, against 0.05 s for a copy into touched ones), so `prepare`
    allocates and touches them in a background thread while training goes on, and a save only copies. The caller
    waits for one save before the next, so no buffer is refilled while it is written."""

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self.buffers: dict[str, Any] | None = None
        self.layout: list | None = None
        self.preparing: tuple[list, Future] | None = None

    def prepare(self, state_dict: dict[str, Any]) -> None:
        """Start making the buffers for `state_dict`'s layout in a background thread (once per layout): the thread
        reads the tensors' shapes (a sharded tensor's local part is copied once); a save waits for it to end."""
        layout = _layout(state_dict)
        if layout == self.layout or (self.preparing is not None and self.preparing[0] == layout):
            return

        def make() -> dict[str, Any]:
            buffers = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
            with torch.no_grad():
                for tensor in _local_tensors(buffers):
                    tensor.zero_()  # every page faulted in here, not in the save
            return buffers

        executor = ThreadPoolExecutor(1, thread_name_prefix="vitrain-staging")
        self.preparing = (layout, executor.submit(make))
        executor.shutdown(wait=False)

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        layout = _layout(state_dict)
        if self.preparing is not None:
            (prepared, future), self.preparing = self.preparing, None
            buffers = future.result()
            if prepared == layout:
                self.buffers, self.layout = buffers, layout
        if layout != self.layout:
            self.buffers = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
            self.layout = layout
        return _copy_state_dict(state_dict, self.buffers)

    def synchronize_staging(self) -> None:
        return None

    def close(self) -> None:
        return None


def _local_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every plain tensor in a nested state dict, a sharded tensor's local part for it."""
    if isinstance(value, dict):
        for sub in value.values():
            yield from _local_tensors(sub)
    elif isinstance(value, list | tuple):
        for sub in value:
            yield from _local_tensors(sub)
    elif isinstance(value, torch.Tensor):
        yield value.to_local() if hasattr(value, "to_local") else value


def _layout(value: Any, path: str = "") -> list:
    """Every tensor's place, shape and dtype in a nested state dict (a change means new staging buffers)."""
    if isinstance(value, dict):
        return [item for key, sub in value.items() for item in _layout(sub, f"{path}.{key}")]
    if isinstance(value, list | tuple):
        return [item for i, sub in enumerate(value) for item in _layout(sub, f"{path}.{i}")]
    if isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value
        return [(path, type(value).__name__, tuple(local.shape), local.dtype)]
    return []


def save_async(
    run_dir: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    meta: dict[str, Any],
    keep: int,
    extra: dict[str, Any] | None = None,
    group: Any = None,
    staging: ReusedStaging | None = None,
) -> PendingSave:
    """Collective: `save` with DCP's async save. Returns once every rank has copied its state to host memory; a
    background thread writes the shards (collectives over `group`, a gloo group apart from the training loop's),
    then on rank 0 completes the folder as `save` does. The caller waits for one save before starting the next."""
    final, tmp, what = _prepare(run_dir, step)
    meta = json.loads(json.dumps(meta))  # as it is now: rank 0 writes it once the shards are written
    try:
        with all_or_none(what), _one_process_is_normal():
            written = dcp.async_save(
                state_to_save(model, optimizer, extra),
                storage_writer=FileSystemWriter(tmp, sync_files=True),
                process_group=group,
                async_stager=staging or ReusedStaging(),
                no_dist=not is_distributed(),
            )
    except Exception:
        if rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    main = rank() == 0

    def finish() -> None:
        written.result()
        if main:
            _complete(tmp, final, step, meta, keep)

    executor = ThreadPoolExecutor(1, thread_name_prefix="vitrain-checkpoint")
    done = executor.submit(finish)
    executor.shutdown(wait=False)
    return PendingSave(final, tmp, done, what)


def _prepare(run_dir: Path, step: int) -> tuple[Path, Path, str]:
    """Collective: an empty temporary folder for step `step` (made by rank 0): (final path, temporary path, what)."""
    root = Path(run_dir) / CHECKPOINT_DIR
    final = root / f"step_{step:08d}"
    tmp = root / f"{_TMP}{final.name}"
    what = f"saving checkpoint {final}"
    with all_or_none(what):
        if rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            fsync_dir(root.parent)  # checkpoints/ itself may be new
            fsync_dir(root)
    return final, tmp, what


def _complete(tmp: Path, final: Path, step: int, meta: dict[str, Any], keep: int) -> None:
    """Rank 0, once every rank's files are written: meta.json and COMPLETE (checksums), the rename into place, the
    best pointer, and pruning."""
    _fsync_tree(tmp)
    write_json(tmp / META_FILE, {"format": FORMAT_VERSION, **meta})
    fsync_dir(tmp)
    listed = _listed_files(tmp)
    sums = file_checksums(tmp, list(listed))
    write_json(tmp / COMPLETE_FILE, {"step": step, "files": listed, CHECKSUM: sums})
    _replace_dir(tmp, final)
    root = final.parent
    if meta.get("is_best"):
        atomic_write(root / BEST_POINTER, final.name.encode())
    _prune(root.parent, keep)


def _fsync_tree(folder: Path) -> None:
    """Make every file under `folder` durable (DCP fsyncs its own files; other writers, DeepSpeed's, do not)."""
    for sub in [folder, *(p for p in folder.rglob("*") if p.is_dir())]:
        for path in sub.iterdir():
            if path.is_file():
                with open(path, "rb") as handle:
                    os.fsync(handle.fileno())
        fsync_dir(sub)


def _replace_dir(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`; a checkpoint of the same step (an end-of-epoch re-save) is swapped out."""
    old = final.with_name(f"{_OLD}{final.name}")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _prune(run_dir: Path, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints of this run and its best one; rename, then delete the rest."""
    keep_best = best(run_dir)
    dirs = step_dirs(run_dir, warn=False)
    victims = [p for p in dirs[: max(0, len(dirs) - keep)] if p != keep_best]
    for path in victims:  # a crash mid-delete leaves a `.trash-` folder, never a half-deleted step_ folder
        path.rename(path.with_name(f"{_TRASH}{path.name}"))
    if victims:
        fsync_dir(Path(run_dir) / CHECKPOINT_DIR)
    for path in victims:
        shutil.rmtree(path.with_name(f"{_TRASH}{path.name}"), ignore_errors=True)


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Model and optimizer state keyed by single-device parameter names (shards stay DTensors under FSDP)."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return get_model_state_dict(model), _zero1_state(model, optimizer)
    if is_flat(optimizer):
        return get_model_state_dict(model), per_parameter_state(optimizer, _names(model))
    return get_state_dict(model, optimizer)


def _names(model: nn.Module) -> dict[nn.Parameter, str]:
    return {p: n for n, p in unwrap(model).named_parameters()}


def _zero1_state(model: nn.Module, optimizer: ZeroRedundancyOptimizer) -> dict[str, Any]:
    """This rank's shard of the optimizer state in get_state_dict's layout, without gathering it on one rank.

    Each rank saves the state of the parameters it owns; the union over ranks is a complete optimizer state
    that any strategy loads.
    """
    names = _names(model)
    local = optimizer.optim
    state = {names[p]: dict(s) for p, s in local.state.items()}
    groups = []
    for global_group, local_group in zip(optimizer.param_groups, local.param_groups, strict=True):
        hyper = {k: v for k, v in local_group.items() if k != "params"}
        groups.append({**hyper, "params": [names[p] for p in global_group["params"]]})
    return {"state": state, "param_groups": groups}


# ---------------------------------------------------------------------------------------------- safe reading

# DCP's `.metadata` index is a pickle; these are the only things it may name.
_DCP_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (module, name) in _DCP_METADATA_CLASSES or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        )
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name}")
        return super().find_class(module, name)


def _refused(path: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint file {path} refers to {what}, which a checkpoint never holds: refusing to load it "
        "(loading it could run code); use checkpoints you wrote or got from a source you trust"
    )


_PICKLED_GLOBAL = re.compile(r"GLOBAL ([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)")


def load_error(exc: BaseException) -> str:
    """What torch's weights_only reader refused, short: the error's type and the global a crafted pickle names, never
    torch's advice to load the file again with weights_only=False."""
    found = _named_global(exc)
    return f"{type(exc).__name__}: it names {found}" if found else type(exc).__name__


def _named_global(exc: BaseException) -> str | None:
    """The global a crafted pickle names in torch's weights_only error (None: the error names none)."""
    found = _PICKLED_GLOBAL.search(str(exc)[:2000])
    return found.group(1)[:100] if found else None


def not_loadable(file: Path, exc: BaseException) -> CheckpointError:
    """One line for a checkpoint file torch.load(weights_only=True) did not load: a pickle naming code is refused
    by what it names, anything else is a damaged or foreign file; torch's advice to load it unsafely is left out."""
    found = _named_global(exc)
    if isinstance(exc, pickle.UnpicklingError) and found:
        return _refused(file, found)
    return CheckpointError(
        f"checkpoint file {file} is not a checkpoint vitrain can load safely ({type(exc).__name__}); it is damaged "
        "or was not written by vitrain"
    )


def read_rng_file(file: Path) -> dict[str, torch.Tensor]:
    """A per-rank RNG file (`rng_state()` saved with torch.save: DeepSpeed's step folders keep one per rank), read
    with weights_only=True; anything but such a state is one line naming the file."""
    try:
        with without_protocol_note():
            state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise not_loadable(file, exc) from None
    own = {"cpu": torch.get_rng_state}
    if torch.cuda.is_available():
        own["cuda"] = torch.cuda.get_rng_state
    fields = [field for field in own if isinstance(state, dict) and field in state]
    expected = {field: own[field]() for field in fields}
    if "cpu" not in fields or not all(
        torch.is_tensor(state[f]) and state[f].shape == expected[f].shape and state[f].dtype == expected[f].dtype
        for f in fields
    ):
        raise CheckpointError(
            f"checkpoint file {file} holds no RNG state of this torch (a dict of uint8 tensors, 'cpu' of "
            f"{tuple(torch.get_rng_state().shape)}); it is damaged or was not written by vitrain"
        )
    return {field: state[field] for field in fields}


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with `.metadata` unpickled through an allowlist of DCP's own metadata classes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        try:
            with self.fs.create_stream(path, "rb") as handle:
                metadata = _MetadataUnpickler(handle).load()
        except pickle.UnpicklingError as exc:
            raise _refused(path, str(exc) or "an unknown object") from None
        except Exception as exc:  # anything else a truncated or crafted pickle can raise
            raise CheckpointError(
                f"checkpoint file {path} cannot be read ({type(exc).__name__}); it is damaged"
            ) from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"checkpoint file {path} holds no DCP metadata; it is damaged")
        try:
            self._check_data_files(metadata)
            _check_chunks(Path(self.path), metadata)
        except (TypeError, ValueError, AttributeError):  # sizes, offsets or chunks of another kind than DCP writes
            raise CheckpointError(f"checkpoint file {path} holds no DCP metadata; it is damaged") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _check_data_files(self, metadata: Metadata) -> None:
        """Every data file the index names is a plain file directly inside the step folder that its COMPLETE marker
        lists: an index pointing elsewhere (another step's shard, an absolute path, a symbolic link) would load
        other weights under this checkpoint's name."""
        storage = getattr(metadata, "storage_data", None)
        if not isinstance(storage, dict):
            raise CheckpointError(f"checkpoint file {Path(self.path) / DCP_INDEX} holds no DCP metadata; it is damaged")
        listed = _listed_names(Path(self.path))  # the marker read once for every file the index names
        for name in sorted({getattr(info, "relative_path", None) for info in storage.values()}, key=str):
            self._check_data_file(name, listed)

    def _check_data_file(self, name: Any, listed: set[str] | None) -> None:
        """`name` is a plain file inside the step folder and in `listed` (its COMPLETE marker's names, where it has
        one)."""
        folder = Path(self.path)
        reason = _not_inside(folder, name, flat=True)
        if reason is None:
            if listed is not None and name not in listed:
                reason = f"which its {COMPLETE_FILE} marker does not list"
        if reason is not None:
            raise CheckpointRefused(folder, f"its index {DCP_INDEX} names {name!r} as a data file, {reason}")

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        """DCP's read, one shard file at a time: a file that does not load (random bytes, a pickle torch's
        weights_only reader refuses) is one line naming it, without torch's advice to load it unsafely."""
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        listed = _listed_names(Path(self.path))
        for name, items in per_file.items():
            self._check_data_file(name, listed)  # again where it is opened, whoever read the index
            try:
                with without_protocol_note():  # DCP reads each item with torch.load
                    super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except VitrainError:
                raise
            except Exception as exc:
                raise not_loadable(Path(self.path) / name, exc) from None
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done


def _check_chunks(folder: Path, metadata: Metadata) -> None:
    """Each tensor's chunks in the index cover its declared size exactly (every chunk within it, their values adding
    up to its own): an index that declares a tensor's full size but chunks of part of it would leave the rest of the
    tensor it is read into as it was (a model's random init) and load without a word."""
    entries = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(entries, dict):
        raise CheckpointError(f"checkpoint file {folder / DCP_INDEX} holds no DCP metadata; it is damaged")
    for key, md in entries.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        size = tuple(md.size)
        reason = _chunks_problem(size, md.chunks)
        if reason is not None:
            raise CheckpointRefused(folder, f"its index {DCP_INDEX} declares {key} of size {size}, but {reason}")


def _chunks_problem(size: tuple, chunks: Any) -> str | None:
    """Why `chunks` (DCP's ChunkStorageMetadata) do not cover a tensor of `size` exactly, or None."""
    if not all(isinstance(n, int) and n >= 0 for n in size):
        return "that is no tensor size"
    covered = 0
    for chunk in chunks if isinstance(chunks, list | tuple) else ():
        offsets, sizes = tuple(getattr(chunk, "offsets", ())), tuple(getattr(chunk, "sizes", ()))
        numbers = all(isinstance(n, int) for n in (*offsets, *sizes))
        if not numbers or len(offsets) != len(size) or len(sizes) != len(size):
            return f"a chunk at offsets {offsets} of size {sizes} does not fit its {len(size)} dimensions"
        if any(at < 0 or n < 0 or at + n > dim for at, n, dim in zip(offsets, sizes, size, strict=True)):
            return f"a chunk at offsets {offsets} of size {sizes} lies outside it"
        covered += math.prod(sizes)
    if covered != math.prod(size):
        return f"its chunks hold {covered} of its {math.prod(size)} values"
    return None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading the non-tensor values (hyperparameters, step counts) with weights_only=True."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def load_bytes(self, read_item: Any, value: Any) -> None:
        try:
            with without_protocol_note():
                loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            raise _refused(self.path, f"an object that is not plain data (at {read_item.dest_index.fqn})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def _dcp_load(state: dict[str, Any], path: Path) -> None:
    """Collective: DCP's load through the safe reader and planner; a failure on any rank is one line on all."""
    try:
        with _one_process_is_normal():
            dcp.load(
                state,
                storage_reader=SafeFileSystemReader(path),
                planner=SafeLoadPlanner(path),
                no_dist=not is_distributed(),
            )
    except CheckpointException as exc:  # DCP gathers every rank's failure into one BaseException
        errors = [error for error, _ in exc.failures.values()]
        ours = next((error for error in errors if isinstance(error, VitrainError)), None)
        if ours is not None:
            raise ours from None
        first = errors[0] if errors else exc
        reason = f"{type(first).__name__}: {' '.join(str(first).split())}"
        verify(path)  # a file that does not match its checksum is named: the checkpoint is damaged
        if _has_checksums(path):  # intact files: what is loaded into them is not what was saved
            raise StateMismatch(
                f"checkpoint {path} does not fit the state this run loads ({reason}); its files match their "
                "checksums, so a setting that shapes the saved state (optim.*, model.*) differs from the one it was "
                "saved with: use the run's own config"
            ) from None
        raise CheckpointError(
            f"checkpoint {path} cannot be read ({reason}); it is damaged, or a setting that shapes the saved state "
            "(optim.*, model.*) differs from the one it was saved with"
        ) from None


def _has_checksums(path: Path) -> bool:
    """Whether a step folder's COMPLETE marker holds its files' checksums (folders written before them do not)."""
    try:
        return bool(json.loads((path / COMPLETE_FILE).read_text()).get(CHECKSUM))
    except (OSError, ValueError, AttributeError):
        return False


def read_index(path: Path) -> dict[str, Any]:
    """The DCP index of a checkpoint: every saved key with its storage metadata (read safely)."""
    return SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata


# ---------------------------------------------------------------------------------------------- load


def resolve(path: Path) -> Path:
    """A step folder as given; for a run folder or its checkpoints/ folder, the newest complete step in it."""
    path = Path(path)
    if path.is_dir() and not _STEP_DIR.match(path.name):
        run_dir = path.parent if path.name == CHECKPOINT_DIR else path
        newest = latest(run_dir)
        steps = run_dir / CHECKPOINT_DIR
        if newest is None and steps.is_dir() and any(_STEP_DIR.match(p.name) for p in steps.iterdir()):
            raise CheckpointError(
                f"run {run_dir} holds no complete checkpoint: no step folder in {steps} has a valid {COMPLETE_FILE} "
                "marker (its write was interrupted, or the marker was damaged); resume the run to train again from "
                "step 0 (they are kept, moved aside)"
            )
        return newest or path
    return path


def is_step_dir(path: Path) -> bool:
    """Whether `path` is named like a step folder inside a run's checkpoints/ folder."""
    path = Path(path)
    return bool(_STEP_DIR.match(path.name)) and path.parent.name == CHECKPOINT_DIR


def run_dir_of(step_dir: Path) -> Path:
    """The run folder a step folder belongs to (RUN/checkpoints/step_N -> RUN)."""
    return Path(step_dir).parent.parent


def read_meta(path: Path) -> dict[str, Any]:
    """A checkpoint's config and progress, or one line saying what is wrong with the path (on rank 0 its files are
    checked against their checksums first: a damaged one is named)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.is_file():
        raise CheckpointError(
            f"checkpoint {path} is a file; a vitrain checkpoint is a directory such as RUN/checkpoints/step_00000100"
        )
    meta_file, legacy = path / META_FILE, path / LEGACY_META_FILE
    tensors = (path / DCP_INDEX).is_file() or (path / DEEPSPEED_DIR).is_dir()
    if not tensors or not (meta_file.is_file() or legacy.is_file()):
        raise CheckpointError(
            f"checkpoint {path} is not a vitrain checkpoint (no {META_FILE}, or neither {DCP_INDEX} nor "
            f"{DEEPSPEED_DIR}/ in it); give a step folder such as RUN/checkpoints/step_00000100 or a run folder"
        )
    if not is_complete(path):
        damage = size_problem(path) if marker_reads(path) else ""  # its save finished; a file changed since
        interrupted = f"incomplete (no valid {COMPLETE_FILE} marker: its write was interrupted)"
        what = f"damaged ({damage})" if damage else interrupted
        raise CheckpointError(
            f"checkpoint {path} is {what}; use an earlier complete step of {run_dir_of(path)} (`vitrain checkpoint "
            f"verify {run_dir_of(path)}` lists them)"
        )
    check_listed(path)  # on every rank: each reads the folder's files
    if rank() == 0:  # one reader of every byte is enough; the other ranks wait for it in the collective load
        verify(path)
    meta = _read_json_meta(meta_file) if meta_file.is_file() else _read_legacy_meta(legacy)
    if not isinstance(meta, dict) or "config" not in meta:
        raise CheckpointError(f"checkpoint {meta_file} holds no config; it was not written by vitrain")
    # What a resume, eval or export reads of the rest: of the kind a save writes, or one line here, not a
    # traceback deep in the engine (a hand-edited meta.json).
    for key, kind in META_KINDS.items():
        value = meta.get(key)
        if (value is not None or key == "config") and (isinstance(value, bool) or not isinstance(value, kind)):
            raise CheckpointError(
                f"checkpoint {meta_file}: {key}={json.dumps(value)[:60]} is not a {_KIND_NAMES[kind]}; it is damaged, "
                f"use an earlier step of {run_dir_of(path)} (`vitrain checkpoint verify {run_dir_of(path)}` lists them)"
            )
    # The run's progress: whole numbers, or a resume fails deep in the schedule (the last two: absent before 2026-11).
    for key in ("step", "epoch", "schedule_step", "steps_per_epoch"):
        value = meta.get(key, 0 if key != "step" else None)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointError(
                f"checkpoint {meta_file}: {key}={json.dumps(value)} is not a whole number >= 0; it is damaged, use an "
                f"earlier step of {run_dir_of(path)} (`vitrain checkpoint verify {run_dir_of(path)}` lists them)"
            )
    if (path / DCP_INDEX).is_file():
        read_index(path)  # refuse a crafted DCP index before anything else reads it
    return meta


# meta.json's keys besides the progress counts, and their kinds (config required, the others where present)
META_KINDS = {"config": dict, "precision": dict, "loader": dict, "world_size": int, "strategy": str, "engine": str}
_KIND_NAMES = {dict: "mapping", int: "whole number", str: "text"}


def _read_json_meta(meta_file: Path) -> dict[str, Any]:
    try:
        return json.loads(meta_file.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        raise CheckpointError(f"checkpoint {meta_file} is not valid JSON; it is damaged") from None


def _read_legacy_meta(meta_file: Path) -> dict[str, Any]:
    """Format 2's pickled meta.pt, read with weights_only=True: plain data and tensors, never code."""
    try:
        with without_protocol_note():
            meta = torch.load(meta_file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise _refused(meta_file, "objects that are not plain data") from None
    except Exception as exc:
        raise CheckpointError(f"checkpoint {meta_file} cannot be read ({type(exc).__name__}); it is damaged") from None
    if isinstance(meta, dict):
        # Format 2 kept one RNG state here, for every rank; it is not restored (resumes start from seed + rank).
        meta = {k: v for k, v in meta.items() if k != "rng"}
    return meta


def check_model_matches(path: Path, model: nn.Module, part: bool = False) -> None:
    """Compare tensor names and shapes with the checkpoint's index before any rank reads a byte of it.

    `part`: `model` is a pipeline stage's part of the model (vitrain/parallel/pipeline.py), whose tensors are a
    subset of the checkpoint's under the same names; the checkpoint's other tensors belong to other stages.
    """
    saved = {
        key[len("model.") :]: tuple(getattr(md, "size", ()))
        for key, md in read_index(path).items()
        if key.startswith("model.")
    }
    own = {k: tuple(v.shape) for k, v in unwrap(model).state_dict().items()}
    missing, extra = sorted(set(own) - set(saved)), [] if part else sorted(set(saved) - set(own))
    if missing or extra:
        what = f"lacks tensor {missing[0]}" if missing else f"has an extra tensor {extra[0]}"
        raise CheckpointError(
            f"checkpoint {path} holds a different model: it {what}; "
            "use the config it was trained with (vitrain eval reads it from the checkpoint)"
        )
    for key, shape in own.items():
        if saved[key] != shape:
            raise CheckpointError(
                f"checkpoint {path} holds a different model: {key} is {saved[key]} there, {shape} in this config; "
                "use the config it was trained with"
            )


def load_training_state(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, part: bool = False) -> None:
    """Collective: fill the (possibly sharded) model and optimizer from a checkpoint of any world size.

    `part`: `model` is a pipeline stage's part of the model; it reads its own tensors (check_model_matches).
    """
    check_model_matches(path, model, part)
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        _load_zero1(path, model, optimizer)
        return
    if is_flat(optimizer):
        # Read straight into views of the flat buffers: the model's parameters and the optimizer's moments.
        ensure_state(optimizer)
        wanted = {"model": get_model_state_dict(model), "optim": per_parameter_state(optimizer, _names(model))}
        wanted["optim"].pop("param_groups")
        _dcp_load(wanted, path)
        with torch.no_grad():
            for name, param in unwrap(model).named_parameters():
                param.copy_(wanted["model"][name])
        return
    model_state, optim_state = get_state_dict(model, optimizer)
    # Only the per-parameter state is read, as flat and zero1 do: the groups (lr scale, weight decay, betas) are this
    # run's optim.* and grouping rule. The saved ones, laid over these by group index, kept a checkpoint's weight
    # decay over the one given on resume, and after a change of grouping left groups without their betas.
    groups = optim_state.pop("param_groups")
    state = {"model": model_state, "optim": optim_state}
    _dcp_load(state, path)
    optim_state = {**state["optim"], "param_groups": groups}
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=optim_state)


def _load_zero1(path: Path, model: nn.Module, optimizer: ZeroRedundancyOptimizer) -> None:
    """Each rank reads the state of the parameters it owns, whatever the optimizer keeps per parameter.

    The state's keys, shapes and dtypes come from the checkpoint's index (AdamW's moments and step, SGD's and
    LARS's momentum buffer, LAMB's moments and integer step), so the tensors DCP reads into have the right form.
    """
    names = _names(model)
    local = optimizer.optim
    owned = {
        names[p]: (p, bool(g.get("fused") or g.get("capturable"))) for g in local.param_groups for p in g["params"]
    }
    state: dict[str, dict[str, Any]] = {}
    prefix = "optim.state."
    with all_or_none(f"reading checkpoint {path}"):  # a rank that refuses its parameters' state stops them all
        for key, md in read_index(path).items():
            # optim.state.<parameter name>.<field>: fields have no dots, parameter names do.
            name, _, field = key[len(prefix) :].rpartition(".")
            if not key.startswith(prefix) or name not in owned:
                continue
            param, scalars_on_device = owned[name]
            if isinstance(md, TensorStorageMetadata):
                check_state_size(path, key, md, tuple(param.shape))
                on_device = tuple(md.size) == tuple(param.shape) or scalars_on_device
                device = param.device if on_device else torch.device("cpu")
                state.setdefault(name, {})[field] = torch.empty(md.size, dtype=md.properties.dtype, device=device)
            else:
                state.setdefault(name, {})[field] = None  # a plain value (LAMB's integer step): DCP fills it in
    wanted = {"model": get_model_state_dict(model), "optim": {"state": state}}
    _dcp_load(wanted, path)
    unwrap(model).load_state_dict(wanted["model"])
    for name, entries in wanted["optim"]["state"].items():
        local.state[owned[name][0]] = entries


def save_extra(folder: Path, state: dict[str, Any]) -> None:
    """Collective: `state`'s tensors as DCP shards in `folder` (an engine's step folder being written, beside its
    own files); `load_extra` reads them back under any world size."""
    _dcp_save(state, folder)


def load_extra(path: Path, state: dict[str, Any]) -> None:
    """Collective: fill `state`'s tensors in place from the same keys that `save(extra=...)` wrote."""
    _dcp_load(state, path)


def load_rng(path: Path) -> bool:
    """Collective: restore this rank's own RNG state from the checkpoint; False when it holds none for this rank."""
    with all_or_none(f"reading checkpoint {path}"):  # a rank that refuses its RNG state stops them all
        buffers = _rng_buffers(path, read_index(path), f"{RNG_KEY}.rank{rank()}.")
    wanted = {RNG_KEY: {f"rank{rank()}": buffers}}
    _dcp_load(wanted, path)  # every rank joins the collective load, with or without a state of its own
    state = wanted[RNG_KEY][f"rank{rank()}"]
    if "cpu" not in state:
        return False
    set_rng_state(state)
    return True


def _rng_buffers(path: Path, index: dict[str, Any], prefix: str) -> dict[str, torch.Tensor]:
    """Tensors to read this rank's saved RNG states into (`prefix`: rng.rank<N>.), each of the size and dtype this
    process's own generator keeps, never the size the index declares: a crafted one would allocate anything. The
    CUDA state only where CUDA is here (set_rng_state restores it only there)."""
    own = {"cpu": torch.get_rng_state}
    if torch.cuda.is_available():
        own["cuda"] = torch.cuda.get_rng_state
    buffers = {}
    for field, current in own.items():
        md = index.get(prefix + field)
        if md is None:
            continue
        expected = current()
        check_rng_entry(path, prefix + field, md, expected)
        buffers[field] = torch.empty_like(expected)
    return buffers


def check_rng_entry(path: Path, key: str, md: Any, expected: torch.Tensor) -> None:
    """A saved RNG state the index declares has the size and dtype of this process's generator's state."""
    size, dtype = tuple(getattr(md, "size", ())), getattr(getattr(md, "properties", None), "dtype", None)
    if not isinstance(md, TensorStorageMetadata) or size != tuple(expected.shape) or dtype != expected.dtype:
        raise CheckpointRefused(
            Path(path),
            f"its index {DCP_INDEX} declares {key} of size {size} and dtype {dtype}, but an RNG state is "
            f"{tuple(expected.shape)} {expected.dtype}",
        )


def check_state_size(path: Path, key: str, md: TensorStorageMetadata, shape: tuple[int, ...]) -> None:
    """An optimizer state tensor the index declares, before anything is allocated for it: its parameter's shape, or no
    more values than its parameter (a step count, a factored moment); a crafted size would allocate anything."""
    size = tuple(md.size)
    if size != tuple(shape) and math.prod(size) > math.prod(shape):
        raise CheckpointRefused(
            Path(path),
            f"its index {DCP_INDEX} declares {key} of size {size}, more values than its parameter's {tuple(shape)}",
        )


def load_model_weights(path: Path, model: nn.Module) -> None:
    """Read only the model's weights (one process, no optimizer), e.g. for eval and export."""
    check_model_matches(path, model)
    state = {"model": unwrap(model).state_dict()}
    _dcp_load(state, path)
    unwrap(model).load_state_dict(state["model"])
