"""Knowledge distillation (train.distill): the teacher's sources, what it asks of a run, and DeiT's two losses.

    module = load_teacher(cfg)                     # a frozen classifier over the task's classes, on the CPU
    teacher = Teacher(engine.frozen(module))       # the step calls it: (images, labels) -> Taught(labels, logits)
    loss = distillation_loss(output, taught, cfg)  # output: the student's (class head, distillation head) logits

DeiT (Touvron et al. 2021) gives the student a distillation token beside the class token, with its own classifier
(vitrain/models/vit.py, `distilled=True`): the class head learns the labels, the distillation head the teacher.
hard: cross-entropy with the teacher's top class; soft: the KL divergence between the two temperature-softened
distributions (Hinton et al. 2015), times tau^2 so its gradients keep their scale across temperatures. The loss is
(1 - alpha) x the label loss + alpha x the teacher's. At inference the student averages its two heads.

Teachers load without running code: safetensors exports, vitrain's DCP checkpoints through the safe reader, timm's
weights through timm (weights_only) or a local file read by vitrain.weights.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vitrain import checkpoint as ckpt
from vitrain import registry
from vitrain.config import Config, DistillConfig, config_from_dict, read_config_file, trusted_values
from vitrain.errors import CheckpointError, ConfigError
from vitrain.trust import REGISTER, check_component
from vitrain.weights import WEIGHTS_FILE, read_weights

KEY = "train.distill.teacher"
# Within read_teachers_once(): the teachers read so far, by what decides them.
_READ: contextvars.ContextVar[dict[tuple, nn.Module] | None] = contextvars.ContextVar("vitrain_teachers", default=None)


@dataclass
class Taught:
    """A micro-batch's targets with the teacher's logits for the same images: what the distillation loss reads."""

    labels: torch.Tensor  # class indices, or (B, classes) probabilities under mixup/cutmix
    teacher_logits: torch.Tensor  # (B, classes), fp32, no gradient


class Teacher:
    """The step's teacher: `frozen` (the engine's frozen teacher) run on the images, its logits joined to the labels."""

    def __init__(self, frozen: Any):
        self.frozen = frozen

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> Taught:
        return Taught(labels, self.frozen(images))


def distillation_loss(output: Any, taught: Taught, cfg: Config) -> torch.Tensor:
    """(1 - alpha) x the class head's label loss + alpha x the distillation head's loss against the teacher, fp32."""
    d = cfg.train.distill
    logits, distilled = (o.float() for o in output)
    label_loss = F.cross_entropy(logits, taught.labels, label_smoothing=cfg.train.label_smoothing)
    if d.type == "hard":
        teacher_loss = F.cross_entropy(distilled, taught.teacher_logits.argmax(dim=-1))
    else:
        student = F.log_softmax(distilled / d.tau, dim=-1)
        target = F.log_softmax(taught.teacher_logits / d.tau, dim=-1)
        teacher_loss = F.kl_div(student, target, reduction="batchmean", log_target=True) * d.tau**2
    return (1.0 - d.alpha) * label_loss + d.alpha * teacher_loss


def describe_distillation(cfg: Config) -> str:
    """The log's line: the teacher, the loss and its weights."""
    d = cfg.train.distill
    soft = f", tau={d.tau:g}" if d.type == "soft" else ""
    return (
        f"distillation: {d.type} from {d.teacher} (alpha={d.alpha:g}{soft}); the student's class and distillation "
        "heads are averaged at evaluation"
    )


def check(cfg: Config) -> None:
    """train.distill's values and what a teacher asks of the run: one line naming the value and the fix."""
    d: DistillConfig = cfg.train.distill
    if not 0.0 <= d.alpha <= 1.0:
        raise ConfigError(f"train.distill.alpha={d.alpha} weighs the teacher's loss and must be in [0, 1], e.g. 0.5")
    if d.tau <= 0:
        raise ConfigError(f"train.distill.tau={d.tau} is a temperature and must be positive, e.g. 1.0")
    if d.teacher_weights and not d.teacher.startswith("timm:"):
        raise ConfigError(
            f"train.distill.teacher_weights={d.teacher_weights} gives a timm teacher its weights; set "
            f"{KEY}=timm:NAME, or drop teacher_weights (a vitrain teacher brings its own)"
        )
    if not d.teacher:
        return
    where = f"{KEY}={d.teacher}"
    if cfg.task.name != "classification":
        raise ConfigError(f"{where} distils a classifier; task.name={cfg.task.name} is not classification")
    if cfg.model.name != "vit" or cfg.model.pool != "cls":
        raise ConfigError(
            f"{where} gives vitrain's ViT DeiT's distillation token beside its class token: it needs model.name=vit "
            f"and model.pool=cls (got model.name={cfg.model.name}, model.pool={cfg.model.pool})"
        )
    if cfg.parallel.pipeline_stages > 1:
        raise ConfigError(
            f"{where} with parallel.pipeline_stages={cfg.parallel.pipeline_stages}: the last stage computes the loss "
            "but only the first sees the images the teacher needs; set parallel.pipeline_stages=1"
        )
    if cfg.train.engine != "native":
        raise ConfigError(
            f"{where} needs train.engine=native (it sets the teacher up in the step's precision and sharding); got "
            f"train.engine={cfg.train.engine}"
        )


@contextlib.contextmanager
def read_teachers_once() -> Iterator[None]:
    """Within: load_teacher reads each teacher once and hands out copies of it. A run's set-up loads its teacher for
    each autotune candidate and once more for its own step (each engine's frozen() moves the module it gets, and may
    shard it, so each gets its own); read once, its files are read and the lines its load prints (a skipped
    incomplete checkpoint) shown once, not once per candidate. The module read is let go on exit."""
    token = _READ.set({})
    try:
        yield
    finally:
        _READ.reset(token)


def load_teacher(cfg: Config) -> nn.Module:
    """The teacher train.distill.teacher names, frozen, on the CPU; refused in one line where it cannot take the
    task's images or predicts other classes than the task's."""
    read = _READ.get()
    if read is None:
        return _read_teacher(cfg)
    d, m = cfg.train.distill, cfg.model
    key = (d.teacher, d.teacher_weights, m.in_chans, m.image_size, m.num_classes)
    if key not in read:
        read[key] = _read_teacher(cfg)
    return copy.deepcopy(read[key])


def _read_teacher(cfg: Config) -> nn.Module:
    spec = cfg.train.distill.teacher
    module = (
        _timm_teacher(spec.removeprefix("timm:"), cfg)
        if spec.startswith("timm:")
        else _vitrain_teacher(spec, trusted_values(cfg))
    )
    module.eval().requires_grad_(False)
    m = cfg.model
    try:
        with torch.inference_mode():
            classes = module(torch.zeros(1, m.in_chans, m.image_size, m.image_size)).shape[-1]
    except Exception as error:
        raise ConfigError(
            f"{KEY}={spec} cannot take the task's {m.in_chans}x{m.image_size}x{m.image_size} images "
            f"({type(error).__name__}: {' '.join(str(error).split())[:200]}); distil from a teacher of the task's input"
        ) from None
    if classes != m.num_classes:
        raise ConfigError(
            f"{KEY}={spec} predicts {classes} classes, the task has model.num_classes={m.num_classes}; distil from a "
            "teacher trained on the task's classes"
        )
    return module


def _vitrain_teacher(spec: str, trusted: dict[str, Any]) -> nn.Module:
    """A vitrain export (folder or its model.safetensors, config.yaml beside it), run folder or step folder; its
    config may name no code to import that `trusted` (this run's own config, by dotted key) does not name too."""
    path = Path(spec).expanduser()
    if not path.exists():
        raise ConfigError(
            f"{KEY}={spec} does not exist; give a vitrain run folder, checkpoint step folder, export folder or "
            "model.safetensors, or timm:NAME"
        )
    weights = path if path.is_file() else path / WEIGHTS_FILE
    if weights.is_file():  # an export: its config.yaml says what to build
        config_file = weights.parent / "config.yaml"
        if not config_file.is_file():
            raise ConfigError(f"{KEY}={spec}: {config_file} is missing; export the teacher with `vitrain export`")
        teacher_cfg = config_from_dict(read_config_file(config_file), config_file, trusted, False, REGISTER)
        model = _classifier(teacher_cfg, spec)
        _load_exactly(model, read_weights(weights, KEY), f"{KEY}={spec}")
        return model
    step = ckpt.resolve(path)
    try:
        meta = ckpt.read_meta(step)
    except CheckpointError as error:
        raise ConfigError(f"{KEY}={spec}: {error}") from None
    # A teacher's config and engine may name no code to import (vitrain/trust.py) that the run's own does not.
    where = step / ckpt.META_FILE
    model = _classifier(config_from_dict(meta["config"], where, trusted, False, REGISTER), spec)
    engine = meta.get("engine", "native")
    check_component("engine", "train.engine", engine, where, trusted, REGISTER, named="engine")
    # The engine that wrote it reads it: DCP through vitrain's safe reader, or DeepSpeed's partitions.
    registry.lookup("engine", engine).load_weights(step, meta, model)
    return model


def _classifier(teacher_cfg: Config, spec: str) -> nn.Module:
    from vitrain.tasks import build_task

    if teacher_cfg.task.name != "classification":
        raise ConfigError(f"{KEY}={spec} was trained with task.name={teacher_cfg.task.name}; a teacher is a classifier")
    return build_task(teacher_cfg).build_model()


def _load_exactly(model: nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """`state` into `model`, every tensor and nothing else; `where` names the config in the error line."""
    own = model.state_dict()
    if "pos_embed" in state and "pos_embed" not in own:  # a timm-format export of a sin-cos model: a fixed table
        state.pop("pos_embed")
    missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    wrong = [k for k in own if k in state and state[k].shape != own[k].shape]
    if missing or extra or wrong:
        what = (
            f"lacks tensor {missing[0]}"
            if missing
            else f"has an extra tensor {extra[0]}"
            if extra
            else f"has {wrong[0]} of shape {tuple(state[wrong[0]].shape)}, not {tuple(own[wrong[0]].shape)}"
        )
        raise ConfigError(f"{where} does not fit the teacher's architecture: it {what}")
    model.load_state_dict(state)


def _timm_teacher(name: str, cfg: Config) -> nn.Module:
    """timm's NAME with timm's pretrained weights (downloaded, or from its cache offline), or with the weights in
    train.distill.teacher_weights, whose classifier decides the number of classes."""
    from vitrain.models.external import import_timm

    timm = import_timm()
    if not timm.is_model(name):
        raise ConfigError(f"{KEY}=timm:{name} is not a timm model; `timm.list_models()` lists them")
    path = cfg.train.distill.teacher_weights
    if not path:
        try:
            return timm.create_model(name, pretrained=True, in_chans=cfg.model.in_chans)
        except Exception as error:
            raise ConfigError(
                f"{KEY}=timm:{name}: timm cannot get its pretrained weights ({type(error).__name__}); connect to the "
                "Hugging Face hub once, or give a local file as train.distill.teacher_weights=PATH"
            ) from None
    state = read_weights(Path(path).expanduser(), "train.distill.teacher_weights")
    classifier = timm.models.get_pretrained_cfg_value(name, "classifier") or "head"
    classes = state[f"{classifier}.weight"].shape[0] if f"{classifier}.weight" in state else 0
    model = timm.create_model(name, pretrained=False, num_classes=classes, in_chans=cfg.model.in_chans)
    _load_exactly(model, state, f"train.distill.teacher_weights={path}")
    return model
