"""Files that are whole or absent: atomic writes (temp file, fsync, rename, fsync the folder); export folder checks."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from vitrain.errors import CheckpointError


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


def check_export_folder(out_dir: Path, overwrite: bool, file: str) -> None:
    """Refuse, before anything is written, an output that is a file, already holds `file`, or is not writable."""
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"export: {out_dir} is a file, not a folder; give a folder to write {file} into")
    if (out_dir / file).exists() and not overwrite:
        raise CheckpointError(
            f"export: {out_dir} already holds {file}; pass --overwrite to replace it or choose another folder"
        )
    existing = out_dir
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise CheckpointError(f"export: cannot write to {out_dir} ({existing} is a file); choose another folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CheckpointError(f"export: cannot write to {out_dir} ({existing} is not writable); choose another folder")
