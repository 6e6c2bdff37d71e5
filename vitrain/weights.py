"""Weight files in and out: consolidated fp32 exports (vitrain or timm names, or an ONNX graph) and `model.init_from`
imports."""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vitrain import registry
from vitrain.config import Config, ModelConfig, to_yaml
from vitrain.errors import CheckpointError, ConfigError
from vitrain.files import atomic_write, check_output_folder
from vitrain.onnx_export import ONNX_FILES

FORMATS = ("vitrain", "timm", "onnx")  # onnx: vitrain/onnx_export.py


@contextlib.contextmanager
def without_protocol_note() -> Iterator[None]:
    """Around a torch.load(weights_only=True) of a file a user handed in: torch's warning of a pickle protocol other
    than 2 (an older file's, or damaged bytes that read as one) is no news to a user, who gets vitrain's own line
    where the read fails. Held only for the read (catch_warnings puts the filters back after it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected pickle protocol")
        yield


WEIGHTS_FILE = "model.safetensors"
CLASSES_FILE = "classes.json"  # the class names, by output index, where the run's data named them
# Every file an export of each format writes into its folder: an existing one is replaced only with --overwrite.
EXPORT_FILES = {
    "vitrain": (WEIGHTS_FILE, "config.yaml", CLASSES_FILE),
    "timm": (WEIGHTS_FILE, "config.yaml", "timm.json", CLASSES_FILE),
    "onnx": (*ONNX_FILES, CLASSES_FILE),
}


def write_classes(out_dir: Path, classes: list[str] | None) -> None:
    """OUT/classes.json: the names of the outputs' classes in index order; with none, an earlier export's file is
    removed (an --overwrite must not leave another model's names beside these weights)."""
    path = Path(out_dir) / CLASSES_FILE
    if classes:  # ASCII with escapes: any name a file system or annotation file gave encodes
        atomic_write(path, (json.dumps(list(classes), indent=1) + "\n").encode())
    else:
        path.unlink(missing_ok=True)


# Sub-keys under which training scripts (timm's included) nest a state dict in .pt/.pth files.
_NESTED_KEYS = ("state_dict_ema", "model_ema", "state_dict", "model")


def timm_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Our state dict under timm's VisionTransformer names.

    Parameter names already follow timm (patch_embed.proj, cls_token, pos_embed, blocks.i.{norm1,attn.qkv,
    attn.proj,norm2,mlp.fc1,mlp.fc2}, norm, fc_norm, head). The one difference: a fixed sin-cos position table
    is a non-persistent buffer here but a parameter in timm, so it is written out as `pos_embed`.
    """
    state = {k: v for k, v in model.state_dict().items()}
    if "pos_embed" not in state:
        state["pos_embed"] = model.pos_embed.detach()
    return state


def timm_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """Arguments for timm.models.vision_transformer.VisionTransformer with exactly this architecture."""
    return {
        "img_size": cfg.image_size,
        "patch_size": cfg.patch_size,
        "in_chans": cfg.in_chans,
        "num_classes": cfg.num_classes,
        "global_pool": "token" if cfg.pool == "cls" else "avg",
        "class_token": cfg.pool == "cls",
        "embed_dim": cfg.width,
        "depth": cfg.depth,
        "num_heads": cfg.heads,
        "mlp_ratio": timm_mlp_ratio(cfg.width, cfg.hidden_dim),
        "qkv_bias": cfg.qkv_bias,
    }


def timm_mlp_ratio(width: int, mlp_dim: int) -> float:
    """The mlp_ratio from which timm builds exactly `mlp_dim` hidden features: timm takes int(width * mlp_ratio), and
    mlp_dim / width can land just below mlp_dim (width 56, mlp_dim 244: 243); then the ratio aims half a feature up."""
    for ratio in (mlp_dim / width, (mlp_dim + 0.5) / width):
        if int(width * ratio) == mlp_dim:
            return ratio
    raise CheckpointError(  # not reached for any width and mlp_dim a model has; refused rather than written wrong
        f"export --format timm: no mlp_ratio gives timm int(width * mlp_ratio) = model.mlp_dim={mlp_dim} at "
        f"model.width={width}; use --format vitrain"
    )


def export(
    model: nn.Module,
    cfg: Config,
    out_dir: Path,
    fmt: str = "vitrain",
    overwrite: bool = False,
    tolerance: float = 1e-4,
    classes: list[str] | None = None,
    say: Callable[[str], None] | None = None,
) -> Path:
    """Write OUT/model.safetensors (fp32, one file) plus OUT/config.yaml (and OUT/timm.json for timm); for onnx,
    OUT/model.onnx checked by onnxruntime to `tolerance` (vitrain/onnx_export.py) plus OUT/config.yaml. `classes`:
    the outputs' class names in index order, written to OUT/classes.json (a run's checkpoint keeps them). `say`: given
    onnx's parity line (or why it was not checked). Where `overwrite` replaces an earlier export in OUT, that export's
    files of another format go (timm.json, model.onnx beside new model.safetensors, ...): nothing contradicts these.

    An OUT that is a file, or that already holds an export (without `overwrite`), or that cannot be written is
    refused in one line before anything is written; each file appears whole or not at all."""

    from safetensors import SafetensorError
    from safetensors.torch import save_file

    _check_arguments(model, cfg, out_dir)
    _check_options(overwrite, tolerance)
    _check_classes(classes, cfg)
    if fmt not in FORMATS:
        raise CheckpointError(f"export --format {fmt} is unknown; choose one of: {', '.join(FORMATS)}")
    if fmt == "onnx":
        from vitrain.onnx_export import export_checked

        check_output_folder(Path(out_dir), overwrite, EXPORT_FILES[fmt], "export", CheckpointError)  # classes.json too
        replaced = _replaces_an_export(Path(out_dir), overwrite)
        path, parity = export_checked(model, cfg, Path(out_dir), overwrite, tolerance)
        try:
            write_classes(Path(out_dir), classes)
            _remove_other_formats(Path(out_dir), fmt, replaced)
        except OSError as error:
            raise _cannot_write(out_dir, error) from None
        if say is not None:
            say(parity.line() if parity else "onnxruntime is not installed: the graph was not checked against "
                "PyTorch (pip install 'vitrain[onnx]')")  # fmt: skip
        return path
    if fmt == "timm" and cfg.model.name.startswith("timm:"):
        raise CheckpointError(
            f"export --format timm renames vitrain's ViT; model.name={cfg.model.name} is timm's own model, whose "
            "weights --format vitrain writes under timm's names already (timm.create_model(...).load_state_dict)"
        )
    if fmt == "timm" and cfg.model.name != "vit":
        raise CheckpointError(
            f"export --format timm renames vitrain's ViT; model.name={cfg.model.name} keeps its own names: use "
            "--format vitrain"
        )
    if fmt == "timm" and cfg.task.name == "detection":
        raise CheckpointError(
            "export --format timm writes timm's VisionTransformer; task.name=detection is a ViTDet (windowed blocks, "
            "a pyramid and an FCOS head) with no timm equivalent: use --format vitrain or onnx"
        )
    if fmt == "timm" and (cfg.task.name != "classification" or cfg.model.pool == "flatten"):
        raise CheckpointError(
            f"task.name={cfg.task.name} model.pool={cfg.model.pool} has no timm VisionTransformer equivalent "
            "(embedding neck or flattened tokens); use --format vitrain"
        )
    if fmt == "timm" and "dist_token" in model.state_dict():
        raise CheckpointError(
            "export --format timm writes timm's VisionTransformer, which has no distillation token; this student was "
            "trained with train.distill: use --format vitrain"
        )
    if fmt == "timm":
        _check_timm_model(model, cfg.model)
        timm_json = json.dumps(timm_kwargs(cfg.model), indent=2) + "\n"  # any refusal comes before a file is written
    out_dir = Path(out_dir)
    path = out_dir / WEIGHTS_FILE
    check_output_folder(out_dir, overwrite, EXPORT_FILES[fmt], "export", CheckpointError)
    state = timm_state_dict(model) if fmt == "timm" else model.state_dict()
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}
    tmp = out_dir / f".{WEIGHTS_FILE}.tmp"
    replaced = _replaces_an_export(out_dir, overwrite)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file(state, str(tmp), metadata={"format": fmt, "producer": "vitrain"})
        tmp.replace(path)
        atomic_write(out_dir / "config.yaml", to_yaml(cfg).encode())
        if fmt == "timm":
            atomic_write(out_dir / "timm.json", timm_json.encode())
        write_classes(out_dir, classes)
        _remove_other_formats(out_dir, fmt, replaced)
    except (OSError, SafetensorError) as error:  # safetensors' own for a full disk or a refused write
        tmp.unlink(missing_ok=True)
        raise _cannot_write(out_dir, error) from None
    return path


def _cannot_write(out_dir: Path, error: Exception) -> CheckpointError:
    """export's one line for a write that failed (an OSError, or safetensors' error holding the I/O one's text)."""
    why = error.strerror if isinstance(error, OSError) else str(error).rpartition("I/O error: ")[2] or str(error)
    return CheckpointError(f"export: cannot write to {out_dir} ({why}); choose a writable folder")


def _replaces_an_export(out_dir: Path, overwrite: bool) -> bool:
    """Whether this export overwrites an earlier one in OUT (every format writes config.yaml): only then are another
    format's files there an export's, to be removed (a folder of other files keeps them)."""
    return overwrite and (Path(out_dir) / "config.yaml").is_file()


def _remove_other_formats(out_dir: Path, fmt: str, replaced: bool) -> None:
    """After an export of `fmt` over an earlier one (`replaced`): the files only another format writes."""
    if not replaced:
        return
    ours = set(EXPORT_FILES[fmt])
    for name in sorted({n for files in EXPORT_FILES.values() for n in files} - ours):
        (out_dir / name).unlink(missing_ok=True)


def _check_classes(classes: Any, cfg: Config) -> None:
    """export's `classes`: None, or one name (str) per class of the model's head, before anything is written."""
    if classes is None:
        return
    if not isinstance(classes, list | tuple) or not all(isinstance(c, str) for c in classes):
        raise ConfigError(f"export(..., classes=): give a list of class names (str), not {_what(classes)}")
    if cfg.task.name != "face" and len(classes) != cfg.model.num_classes:
        raise ConfigError(
            f"export(..., classes=): {len(classes)} names for model.num_classes={cfg.model.num_classes} outputs; give "
            "one name per class, in the head's order"
        )


def _check_arguments(model: Any, cfg: Any, out_dir: Any) -> None:
    """export(model, cfg, out_dir)'s arguments, before anything is written: one line naming the one that is wrong."""
    call = "export(model, cfg, out_dir, fmt)"
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{call}: model is {_what(model)}, not a torch.nn.Module; pass the model first")
    if isinstance(cfg, ModelConfig):
        raise ConfigError(
            f"{call}: cfg is a ModelConfig (the model section), not the whole Config; pass the Config it came from "
            "(vitrain.load_config(...)), not cfg.model"
        )
    if not isinstance(cfg, Config):
        raise ConfigError(
            f"{call}: cfg is {_what(cfg)}, not a vitrain Config; pass the model's config, e.g. "
            "vitrain.load_config('digits', [...])"
        )
    if not isinstance(out_dir, str | os.PathLike) or not str(out_dir).strip():  # "": the working folder, unasked
        raise ConfigError(f"{call}: out_dir is {_what(out_dir)}; give a folder path (str or Path)")


def _check_options(overwrite: Any, tolerance: Any) -> None:
    """export's overwrite (a bool: "no" would be true) and tolerance (a number), before anything is written."""
    if not isinstance(overwrite, bool):
        raise ConfigError(f"export(..., overwrite=): give True or False, not {_what(overwrite)}")
    if isinstance(tolerance, bool) or not isinstance(tolerance, int | float):
        raise ConfigError(f"export(..., tolerance=): give a number such as 1e-4, not {_what(tolerance)}")


def _what(value: Any) -> str:
    return f"{value!r:.40}" if isinstance(value, str) or value is None else f"a {type(value).__name__}"


def _check_timm_model(model: nn.Module, cfg: ModelConfig) -> None:
    """timm.json describes the model by `cfg`: refuse a model that is not vitrain's ViT, or whose weights have other
    shapes than the ViT `cfg` describes (another depth or width), or that has a convolutional stem (timm's
    VisionTransformer has none), in one line."""
    with torch.device("meta"):  # vitrain's ViT as `cfg` describes it, by the registry (models import this module)
        reference = registry.lookup("model", "vit")(cfg)
    if not isinstance(model, type(reference)):
        raise CheckpointError(
            f"export --format timm is for vitrain's ViT (model.name=vit); the model is a {type(model).__name__}: use "
            "--format vitrain (fmt='vitrain')"
        )
    described = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    held = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for key in [*described, *(k for k in held if k not in described)]:
        if held.get(key) != described.get(key):
            shown = lambda shape: "absent" if shape is None else "x".join(map(str, shape)) or "a scalar"  # noqa: E731
            raise CheckpointError(
                f"export --format timm: the model's weights do not match the config (model.depth={cfg.depth}, "
                f"model.width={cfg.width}): {key} is {shown(held.get(key))} in the model, {shown(described.get(key))} "
                "by the config; pass the config the model was built from"
            )
    if cfg.stem:  # timm's PatchEmbed is one strided conv: the stem's convs and BatchNorms would be unexpected keys
        channels = ",".join(str(c) for c, _ in cfg.stem)
        raise CheckpointError(
            f"export --format timm: model.patch_embed=conv (a convolutional stem, channels [{channels}]) has no timm "
            "VisionTransformer equivalent (timm's patch embedding is one strided conv); use --format vitrain"
        )


def read_weights(path: Path, config_key: str = "model.init_from") -> dict[str, torch.Tensor]:
    """A flat name -> tensor dict from .safetensors, or a .pt/.pth holding one (possibly nested, DDP-prefixed);
    `config_key`: the config key that named the file, for the error lines."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{config_key}={path} is not a file; give a .safetensors, .pt or .pth weights file")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state: Any = load_file(str(path))
        else:
            with without_protocol_note():
                state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        what = type(exc).__name__
        raise CheckpointError(f"{config_key}={path} cannot be read ({what}); is it a weights file?") from None
    for key in _NESTED_KEYS:
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
            break
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{config_key}={path} does not hold a state dict of tensors")
    for key, tensor in state.items():
        if not isinstance(key, str):
            raise CheckpointError(
                f"{config_key}={path} names a tensor by {key!r:.40} ({type(key).__name__}), not a string; save a "
                "state dict keyed by tensor names (model.state_dict())"
            )
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):  # else the run blames its lr
            raise CheckpointError(
                f"{config_key}={path}: tensor {key} holds inf/NaN (weights saved after a run diverged); start from "
                "another file"
            )
    return {k.removeprefix("module."): v for k, v in state.items()}


def load_pretrained(model: nn.Module, path: Path, config_key: str = "model.init_from") -> None:
    """Start from a timm or vitrain weights file. A classifier head of another size is left freshly initialized
    (fine-tuning to new classes); any other difference is an error naming the tensor (and `config_key`, the config key
    that named the file)."""
    state = read_weights(path, config_key)
    # A model that reads another library's names or sizes (MViT: torchvision's file, its tables resampled).
    own_names = getattr(model, "pretrained_state", None)
    if callable(own_names):
        state = own_names(state, f"{config_key}={path}")
    # A model that maps an image classifier's weights onto itself (ViTDet: its backbone, positions resampled).
    own_loader = getattr(model, "load_image_backbone", None)
    if callable(own_loader):
        own_loader(state, f"{config_key}={path}")
        return
    own = model.state_dict()
    if "pos_embed" in state and "pos_embed" not in own:  # a timm export of a sin-cos model: the table is fixed
        state.pop("pos_embed")
    if "head.weight" not in own:  # an embedding model (face): the source's classifier has no counterpart here
        for key in ("head.weight", "head.bias"):
            state.pop(key, None)
        for key in [k for k in own if k.startswith("neck.") and k not in state]:
            state[key] = own[key]  # the neck starts from scratch unless the source has one
    for key in ("dist_token", "head_dist.weight", "head_dist.bias"):  # a student of train.distill: DeiT's token
        if key in own and key not in state:  # and head start from scratch where the source has none
            state[key] = own[key]
    head = [k for k in ("head.weight", "head.bias") if k in own]
    # a head for another number of classes starts afresh; half a head (bias, no weight), or a head of another width
    # (a wider model's file), is a tensor missing or misshapen, named below
    if head and all(k in state for k in head) and state[head[0]].shape[0] != own[head[0]].shape[0]:
        warnings.warn(
            f"{config_key}={path}: its head has {state[head[0]].shape[0]} classes, this model "
            f"{own[head[0]].shape[0]}; the head starts from scratch",
            stacklevel=2,
        )
        for key in head:
            state[key] = own[key]
    missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or extra:
        what = f"lacks tensor {missing[0]}" if missing else f"has an extra tensor {extra[0]}"
        raise CheckpointError(f"{config_key}={path} holds a different architecture: it {what}")
    for key, tensor in state.items():
        if tensor.shape != own[key].shape:
            raise CheckpointError(
                f"{config_key}={path} holds a different architecture: {key} is {tuple(tensor.shape)} there, "
                f"{tuple(own[key].shape)} here; set the model.* keys to match it"
            )
    with torch.no_grad():
        for key, tensor in state.items():
            own[key].copy_(tensor)
