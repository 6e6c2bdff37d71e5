"""Files that are whole or absent: atomic writes (temp file, fsync, rename, fsync the folder); output folder checks."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from vitrain.errors import ConfigError, VitrainError


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable (a file's own fsync does not cover its directory entry)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write to a temporary file in the same folder, fsync, rename, fsync the folder: never half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def folder_problem(out_dir: Path) -> str | None:
    """Why files cannot be written into the folder `out_dir` (None: they can): it is a file, lies under a file, or
    its nearest existing folder is not writable."""
    if out_dir.exists() and not out_dir.is_dir():
        return f"{out_dir} is a file, not a folder"
    existing = out_dir
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"cannot write to {out_dir} ({existing} is a file)"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"cannot write to {out_dir} ({existing} is not writable)"
    return None


def file_problem(path: Path) -> str | None:
    """Why a file cannot be written at `path` (None: it can): it is a folder, lies under a file, or its nearest
    existing folder is not writable."""
    if path.is_dir():
        return f"{path} is a folder, not a file"
    return folder_problem(path.parent)


def check_output_path(path: Path, who: str, folder: bool, error: type[VitrainError] = ConfigError) -> None:
    """Refuse, before any work, an output (`who`: "--json", "--out") that cannot be written: a file path that is a
    folder or lies under a file, a folder path that is a file, or either where nothing can be written."""
    problem = folder_problem(path) if folder else file_problem(path)
    if problem is not None:
        raise error(f"{who} {path}: {problem}; give {'a folder' if folder else 'a file path'} that can be written")


def check_output_folder(
    out_dir: Path, overwrite: bool, files: Sequence[str], who: str, error: type[VitrainError] = ConfigError
) -> None:
    """Refuse (as `who`: "export", "lr-find --out"), before anything is written, an output folder that is a file,
    lies under one, is not writable, or already holds any of `files` (those the command writes) without
    `overwrite`."""
    problem = folder_problem(out_dir)
    if problem is not None:
        raise error(f"{who}: {problem}; choose another folder")
    held = [file for file in files if (out_dir / file).exists()]
    if held and not overwrite:
        raise error(
            f"{who}: {out_dir} already holds {', '.join(held)}; pass --overwrite to replace "
            f"{'it' if len(held) == 1 else 'them'} or choose another folder"
        )
