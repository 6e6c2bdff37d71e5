"""Reshardable checkpoints: torch.distributed.checkpoint step directories, written atomically, last K kept.

Layout of a run: `RUN/checkpoints/step_00000500/` holds the DCP shards of the model and optimizer (each rank
writes its own) plus `meta.pt` (config, step, data position, RNG, best metric) written by rank 0. Tensors are
saved under their single-device names (`model.blocks.0.attn.qkv.weight`), so a checkpoint written by one
strategy and world size loads under any other: 2 ranks zero3 -> 1 process, 1 -> 2 ranks, zero3 -> ddp.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict
from torch.distributed.optim import ZeroRedundancyOptimizer

from vitrain.errors import CheckpointError
from vitrain.optim.flat import ensure_state, is_flat, per_parameter_state
from vitrain.parallel.distributed import barrier, is_distributed, rank
from vitrain.parallel.strategies import unwrap

FORMAT_VERSION = 2
CHECKPOINT_DIR = "checkpoints"
META_FILE = "meta.pt"
BEST_POINTER = "best"
_STEP_DIR = re.compile(r"^step_(\d+)$")


# ---------------------------------------------------------------------------------------------- files


def atomic_save(obj: Any, path: Path) -> None:
    """Write to a temporary file in the same folder, fsync, then rename: a crash never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            if isinstance(obj, bytes):
                handle.write(obj)
            else:
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


def step_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary directories start with '.' and are ignored)."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest(run_dir: Path) -> Path | None:
    dirs = step_dirs(run_dir)
    return dirs[-1] if dirs else None


def best(run_dir: Path) -> Path | None:
    pointer = Path(run_dir) / CHECKPOINT_DIR / BEST_POINTER
    if not pointer.exists():
        return None
    path = pointer.parent / pointer.read_text().strip()
    return path if path.is_dir() else None


# ---------------------------------------------------------------------------------------------- save


def _dcp(operation, state: dict[str, Any], path: Path) -> None:
    """dcp.save / dcp.load; one process without a process group is a normal case here, not worth a warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*unavailable or uninitialized")
        operation(state, checkpoint_id=path, no_dist=not is_distributed())


def save(
    run_dir: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    meta: dict[str, Any],
    keep: int,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Collective: every rank writes its shards into a temporary directory that rank 0 renames when complete.

    `extra` holds more tensors to save beside the model and optimizer (top-level keys); `load_extra` reads them.
    """
    root = Path(run_dir) / CHECKPOINT_DIR
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-{final.name}"
    if rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    model_state, optim_state = training_state(model, optimizer)
    _dcp(dcp.save, {"model": model_state, "optim": optim_state, **(extra or {})}, tmp)
    if rank() == 0:
        atomic_save({"format": FORMAT_VERSION, **meta}, tmp / META_FILE)
        _replace_dir(tmp, final)
        if meta.get("is_best"):
            atomic_save(final.name.encode(), root / BEST_POINTER)
        _prune(run_dir, keep)
    barrier()
    return final


def _replace_dir(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`; a checkpoint of the same step (an end-of-epoch re-save) is swapped out."""
    old = final.with_name(f".old-{final.name}")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(run_dir: Path, keep: int) -> None:
    keep_best = best(run_dir)
    dirs = step_dirs(run_dir)
    for path in dirs[: max(0, len(dirs) - keep)]:
        if path != keep_best:
            shutil.rmtree(path, ignore_errors=True)


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

    Each rank saves the moments of the parameters it owns; the union over ranks is a complete optimizer state
    that any strategy loads.
    """
    names = {p: n for n, p in unwrap(model).named_parameters()}
    local = optimizer.optim
    state = {names[p]: dict(s) for p, s in local.state.items()}
    groups = []
    for global_group, local_group in zip(optimizer.param_groups, local.param_groups, strict=True):
        hyper = {k: v for k, v in local_group.items() if k != "params"}
        groups.append({**hyper, "params": [names[p] for p in global_group["params"]]})
    return {"state": state, "param_groups": groups}


# ---------------------------------------------------------------------------------------------- load


def resolve(path: Path) -> Path:
    """A step directory as given; for a run directory or its checkpoints/ folder, the newest step in it."""
    path = Path(path)
    if path.is_dir() and not (path / META_FILE).exists():
        run_dir = path.parent if path.name == CHECKPOINT_DIR else path
        return latest(run_dir) or path
    return path


def read_meta(path: Path) -> dict[str, Any]:
    """A checkpoint's config and progress, or one line saying what is wrong with the path."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.is_file():
        raise CheckpointError(
            f"checkpoint {path} is a file; a vitrain checkpoint is a directory such as RUN/checkpoints/step_00000100"
        )
    meta_file = path / META_FILE
    if not meta_file.exists() or not (path / ".metadata").exists():
        raise CheckpointError(f"checkpoint {path} is not a vitrain checkpoint (no {META_FILE} or .metadata in it)")
    try:
        meta = torch.load(meta_file, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise CheckpointError(f"checkpoint {meta_file} cannot be read ({type(exc).__name__}); it is damaged") from None
    if not isinstance(meta, dict) or "config" not in meta:
        raise CheckpointError(f"checkpoint {meta_file} holds no config; it was not written by vitrain")
    return meta


def check_model_matches(path: Path, model: nn.Module) -> None:
    """Compare tensor names and shapes with the checkpoint's index before any rank reads a byte of it."""
    saved = {
        key[len("model.") :]: tuple(getattr(md, "size", ()))
        for key, md in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata.items()
        if key.startswith("model.")
    }
    own = {k: tuple(v.shape) for k, v in unwrap(model).state_dict().items()}
    missing, extra = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
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


def load_training_state(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Collective: fill the (possibly sharded) model and optimizer from a checkpoint of any world size."""
    check_model_matches(path, model)
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        _load_zero1(path, model, optimizer)
        return
    if is_flat(optimizer):
        # Read straight into views of the flat buffers: the model's parameters and the optimizer's moments.
        ensure_state(optimizer)
        wanted = {"model": get_model_state_dict(model), "optim": per_parameter_state(optimizer, _names(model))}
        wanted["optim"].pop("param_groups")
        _dcp(dcp.load, wanted, path)
        with torch.no_grad():
            for name, param in unwrap(model).named_parameters():
                param.copy_(wanted["model"][name])
        return
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    _dcp(dcp.load, state, path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _load_zero1(path: Path, model: nn.Module, optimizer: ZeroRedundancyOptimizer) -> None:
    names = {p: n for n, p in unwrap(model).named_parameters()}
    local = optimizer.optim
    owned = [p for group in local.param_groups for p in group["params"]]
    # AdamW's per-parameter state, allocated with the right shapes so that DCP reads into it.
    fused = any(g.get("fused") for g in local.param_groups)
    state = {
        names[p]: {
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
            "step": torch.zeros((), dtype=torch.float32, device=p.device if fused else "cpu"),
        }
        for p in owned
    }
    wanted = {"model": get_model_state_dict(model), "optim": {"state": state}}
    _dcp(dcp.load, wanted, path)
    unwrap(model).load_state_dict(wanted["model"])
    for p in owned:
        local.state[p] = wanted["optim"]["state"][names[p]]


def load_extra(path: Path, state: dict[str, Any]) -> None:
    """Collective: fill `state`'s tensors in place from the same keys that `save(extra=...)` wrote."""
    _dcp(dcp.load, state, path)


def load_model_weights(path: Path, model: nn.Module) -> None:
    """Read only the model's weights (one process, no optimizer), e.g. for eval and export."""
    check_model_matches(path, model)
    state = {"model": unwrap(model).state_dict()}
    _dcp(dcp.load, state, path)
    unwrap(model).load_state_dict(state["model"])
