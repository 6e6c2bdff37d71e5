"""Checkpoints that never betray: atomic writes, model/optimizer/schedule/RNG/data position, clear load errors."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vitrain.errors import CheckpointError

FORMAT_VERSION = 1


def atomic_save(obj: Any, path: Path) -> None:
    """Write to a temporary file in the same folder, fsync, then rename: a crash never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load(path: Path) -> dict[str, Any]:
    """Read a vitrain checkpoint, or raise one line naming the file and what is wrong with it."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {path} cannot be read ({type(exc).__name__}); is it a vitrain .pt file?"
        ) from None
    if not isinstance(state, dict) or "model" not in state or "config" not in state:
        raise CheckpointError(f"checkpoint {path} is not a vitrain checkpoint (no model/config entries)")
    return state


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor], path: Path) -> None:
    """Load weights strictly; a checkpoint of another architecture gets a one-line error, not a traceback."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        first = (missing or unexpected)[0]
        what = "lacks" if missing else "has an extra"
        raise CheckpointError(
            f"checkpoint {path} holds a different model: it {what} tensor {first}; "
            "use the config it was trained with (vitrain eval reads it from the checkpoint)"
        )
    for key, tensor in state.items():
        if tuple(tensor.shape) != tuple(own[key].shape):
            raise CheckpointError(
                f"checkpoint {path} holds a different model: {key} is {tuple(tensor.shape)} there, "
                f"{tuple(own[key].shape)} in this config; use the config it was trained with"
            )
    model.load_state_dict(state)
