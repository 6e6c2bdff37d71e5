"""Models: vitrain's single-device ViT (presets, exact cost), its plan, and any other module a config names.

model = build_model(cfg.model, embed_dim=0)   # model.name: vit, timm:NAME, or mypkg.module:factory
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from vitrain import registry
from vitrain.config import Config, ModelConfig
from vitrain.errors import ConfigError
from vitrain.models.plan import ParallelPlan, plan_of, repeated_blocks
from vitrain.models.vit import Complexity, EmbeddingNeck, VisionTransformer, check_vit, complexity, count_parameters
from vitrain.presets import PRESETS, Preset, find_preset

__all__ = [
    "PRESETS",
    "Complexity",
    "EmbeddingNeck",
    "ParallelPlan",
    "Preset",
    "VisionTransformer",
    "build_model",
    "build_vit",
    "check",
    "complexity",
    "config_complexity",
    "count_parameters",
    "create_model",
    "find_preset",
    "model_complexity",
    "plan_of",
    "repeated_blocks",
]


def build_vit(cfg: ModelConfig, embed_dim: int = 0) -> VisionTransformer:
    """A classifier over cfg.num_classes, or with `embed_dim > 0` an embedding model (the face task's backbone)."""
    return VisionTransformer(cfg, embed_dim)


create_model = build_vit  # the name the tests and scripts know


def build_model(cfg: ModelConfig, embed_dim: int = 0, model: Any = None) -> nn.Module:
    """The single-device model `model.name` names (the registry's), or `model` itself: an nn.Module, or a factory
    called with the model config. A factory from the registry or an import path is called with the model config
    (and `embed_dim` where one is asked for)."""
    if not isinstance(cfg, ModelConfig):
        what = "the whole Config: pass its model section, cfg.model" if isinstance(cfg, Config) else type(cfg).__name__
        raise ConfigError(f"build_model(cfg) takes a ModelConfig (a config's model section), not {what}")
    if model is not None:
        _check_handed_in(model, embed_dim)
    made = model if model is not None else registry.lookup("model", cfg.name)
    if isinstance(made, nn.Module):
        return made
    built = made(cfg, embed_dim) if embed_dim else made(cfg)
    if not isinstance(built, nn.Module):
        where = "model=" if model is not None else f"model.name={cfg.name}"
        raise ConfigError(f"{where} returned a {type(built).__name__}, not a torch.nn.Module; fix the factory")
    return built


_HANDED_IN = "give a module (model=Net(...)) or a function of the model config returning one (model=lambda cfg: ...)"


def _check_handed_in(model: Any, embed_dim: int) -> None:
    """`model=` handed to the library: a module, or a function it can call with the model config (and `embed_dim`
    where one is asked for); anything else refused in one line before it is called."""
    if isinstance(model, nn.Module):
        return
    arguments = ("cfg", embed_dim) if embed_dim else ("cfg",)
    if inspect.isclass(model) and not (issubclass(model, nn.Module) and registry.takes(model, *arguments)):
        name = model.__name__
        raise ConfigError(
            f"model={name} is a class, not a module; pass an instance, model={name}(...), or a function of the model "
            f"config, model=lambda cfg: {name}(...)"
        )
    if not callable(model):
        hint = f" (to name a model, set model.name={model} in the config)" if isinstance(model, str) else ""
        kind = type(model).__name__
        article = "an" if kind[0] in "aeiou" else "a"
        raise ConfigError(f"model={model!r:.40} is {article} {kind}, not a module; {_HANDED_IN}{hint}")
    if not registry.takes(model, *arguments):
        what = "the model config and embed_dim" if embed_dim else "the model config"
        raise ConfigError(f"model= is a function that cannot be called with {what}; {_HANDED_IN}")
    first = _first_parameter(model)
    said = first.annotation if first is not None else inspect.Parameter.empty
    if said is not inspect.Parameter.empty and isinstance(said, type) and not _may_be(ModelConfig, said):
        assert first is not None
        name = getattr(model, "__name__", "")  # a class or function that says it takes something else first
        raise ConfigError(
            f"model={name} is called with the model config, but its first parameter is {first.name}: "
            f"{said.__name__}; {_HANDED_IN}"
        )


def _may_be(cls: type, annotation: type) -> bool:
    """Whether `annotation` may stand for `cls`: Any, a protocol (isinstance checks it cannot make) and `cls`'s own
    classes may; another type (int, dict) may not."""
    if annotation is Any:
        return True
    try:
        return issubclass(cls, annotation)
    except TypeError:  # a Protocol without runtime_checkable, and other annotations issubclass cannot judge
        return True


def _first_parameter(model: Any) -> inspect.Parameter | None:
    """The first parameter of a class's constructor or a function, its annotation resolved where it can be."""
    try:
        parameters = list(inspect.signature(model, eval_str=True).parameters.values())
    except Exception:  # an annotation that does not resolve, or no signature: nothing to tell from it
        return None
    return parameters[0] if parameters else None


def model_complexity(model: nn.Module, kept_patches: int | None = None) -> Complexity | None:
    """The model's exact cost where it counts its own (vitrain's ViT), else None; `kept_patches`: with token
    dropping, the blocks' cost over that many patch tokens."""
    own = getattr(model, "complexity", None)
    if not callable(own):
        return None
    return own(kept_patches=kept_patches) if kept_patches is not None else own()


def config_complexity(cfg: ModelConfig) -> Complexity:
    """The exact cost of the model a model section names, from the config alone: MViTv2's stages, else the ViT's."""
    if cfg.name == "mvit":
        from vitrain.models.mvit import complexity as mvit_complexity

        return mvit_complexity(cfg)
    return complexity(cfg)


def check(cfg: Config) -> None:
    """The model section: the input and output every model shares; vitrain's ViT checks its architecture too."""
    m = cfg.model
    for name in ("image_size", "in_chans", "num_classes"):
        if getattr(m, name) <= 0:
            raise ConfigError(f"model.{name}={getattr(m, name)} must be positive")
    if m.name == "mvit":
        from vitrain.models.mvit import check as check_mvit

        check_mvit(m)
        if cfg.data.min_size:
            raise ConfigError(
                f"data.min_size={cfg.data.min_size} trains on smaller inputs first; model.name=mvit pools grids built "
                f"for model.image_size={m.image_size}: set data.min_size=0"
            )
    elif m.stages:
        raise ConfigError(
            f"model.stages={list(m.stages)} are MViTv2's; model.name={m.name} is not it: set model.name=mvit, or leave "
            "model.stages empty"
        )
    elif m.name != "video_vit" and (m.num_frames != 1 or m.tubelet_size != 1 or m.inflate_from):
        raise ConfigError(
            f"model.num_frames={m.num_frames}, tubelet_size={m.tubelet_size} and inflate_from are the video ViT's; "
            f"model.name={m.name} is not it: set model.name=video_vit, or num_frames=1 and tubelet_size=1"
        )
    if m.name == "vit":
        check_vit(m)
        return
    p = cfg.parallel
    if m.name == "video_vit":
        from vitrain.models.video import check as check_video

        check_video(m)
        if p.pipeline_stages > 1 or p.sharded_init:
            raise ConfigError(
                "parallel.pipeline_stages>1 and parallel.sharded_init are not built for model.name=video_vit yet: set "
                "parallel.pipeline_stages=1 and parallel.sharded_init=false (zero3 shards it after it is built)"
            )
        return
    if p.pipeline_stages > 1 or p.sharded_init:
        raise ConfigError(not_the_vit_line(p, f"model.name={m.name}"))


def not_the_vit_line(p: Any, model: str) -> str:
    """The refusal of pipeline stages or sharded init (parallel section `p`) for `model`, which is not vitrain's ViT:
    both cut or draw the ViT by its anatomy."""
    what = f"parallel.pipeline_stages={p.pipeline_stages}" if p.pipeline_stages > 1 else "parallel.sharded_init"
    return (
        f"{what} splits or draws vitrain's ViT by its anatomy; {model} is not it: set parallel.pipeline_stages=1 and "
        "parallel.sharded_init=false"
    )
