"""Named plug-in points: the models, tasks, engines and data sources a config can name, vitrain's own or a user's.

    registry.lookup("task", "face")                  # a built-in: imported when first named
    registry.lookup("model", "mypkg.models:my_vit")   # any importable object, by `module:attribute`
    registry.lookup("model", "timm:vit_small_patch16_224")   # a family that takes the rest as an argument

    @registry.register("task", "mytask")             # or a Python entry point (ENTRY_POINT_GROUPS: vitrain.tasks)
    class MyTask: ...

Built-ins are kept as import paths, so naming one imports only its module, and this module imports none of them:
the registry is the floor every layer may stand on. A name with a colon whose part before it is a registered
*family* (`timm`) calls that family's factory with the rest; any other `module:attribute` is imported as it is.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from vitrain.errors import ConfigError

KINDS = ("model", "task", "engine", "data")
_BUILTIN: dict[str, dict[str, str]] = {
    "model": {
        "vit": "vitrain.models:build_vit",
        "video_vit": "vitrain.models.video:build_video_vit",
        "mvit": "vitrain.models.mvit:build_mvit",
    },
    "task": {
        "classification": "vitrain.tasks.classification:ClassificationTask",
        "detection": "vitrain.tasks.detection:DetectionTask",
        "face": "vitrain.tasks.face:FaceTask",
        "video": "vitrain.tasks.video:VideoTask",
    },
    "engine": {"native": "vitrain.engine.native:NativeEngine", "deepspeed": "vitrain.engine.deepspeed:DeepSpeedEngine"},
    "data": {
        "detection": "vitrain.data.detection:detection_source",
        "digits": "vitrain.data.sources:digits_source",
        "folder": "vitrain.data.sources:folder_source",
        "prepared": "vitrain.data.sources:prepared_source",
        "recordio": "vitrain.data.records:recordio_source",
        "shards": "vitrain.data.stream:shards_source",
        "synthetic": "vitrain.data.synthetic:synthetic_source",
        "video": "vitrain.data.video:video_source",
    },
}
# Families: `NAME:ARGUMENT` calls the factory with ARGUMENT (it returns the component itself).
_FAMILIES: dict[str, dict[str, str]] = {"model": {"timm": "vitrain.models.external:timm_model"}}
# The order config.validate checks a config in (the first error is the one a user sees): each section by its
# owner, and "engine"/"task"/"model"/"data" by the component the config names (its static `check(cfg)`, if any).
CHECK_ORDER = (
    "vitrain.models:check",
    "vitrain.data:check",
    "vitrain.engine.protocol:check_train",
    "vitrain.engine.token_drop:check",
    "vitrain.tasks.distill:check",
    "vitrain.engine.cluster:check",
    "vitrain.engine.trackers:check",
    "vitrain.parallel:check",
    "engine",
    "task",
    "vitrain.optim:check",
    "vitrain.precision:check",
    "model",
    "data",
)
_REGISTERED: dict[str, dict[str, Any]] = {kind: {} for kind in KINDS}
# What a resolved name must be: engines and tasks are classes with their protocol's methods (the protocol by import
# path, so that this module imports none), models and data sources are callables (a data source may be a
# (train, val) pair). Optional protocol methods are not asked for.
_PROTOCOLS = {"engine": "vitrain.engine.protocol:Engine", "task": "vitrain.tasks:Task"}
# frozen: train.distill's, an engine without it trains without a teacher; close: what the engine set up outside itself
_OPTIONAL = {"engine": ("frozen", "close")}
_CALLABLE = {
    "model": "a model factory: a function or class called with the model config, returning a torch.nn.Module",
    "data": "a data source: a function of the config returning (train, val) datasets",
}
CONFIG_KEYS = {"model": "model.name", "task": "task.name", "engine": "train.engine", "data": "data.source"}
# Python entry-point groups a package publishes its components in (pyproject's [project.entry-points."..."]).
ENTRY_POINT_GROUPS = {
    "model": "vitrain.models",
    "task": "vitrain.tasks",
    "engine": "vitrain.engines",
    "data": "vitrain.data_sources",
}


def register(kind: str, name: str, component: Any = None) -> Any:
    """Register `component` under `name` (a decorator without `component`); a later registration replaces it."""
    _check_kind(kind, "register: kind", "; call register(kind, name, obj), e.g. register('model', 'mine', factory)")
    if callable(name):  # register("model", my_factory): the name left out
        raise ConfigError(
            f"register({kind!r}, {getattr(name, '__name__', type(name).__name__)}) gives no name; call "
            f"register(kind, name, obj) or decorate with @register(kind, name), e.g. register({kind!r}, 'mine', obj)"
        )
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"register({kind!r}, {name!r}, ...): the name must be a non-empty string, e.g. 'mine'")

    def add(obj: Any) -> Any:
        _REGISTERED[kind][name] = obj
        return obj

    return add if component is None else add(component)


def checks(names: dict[str, str]) -> list[Callable[[Any], None]]:
    """The checks of a config in CHECK_ORDER: section owners' functions and the named components' own `check`
    (`names`: kind -> the config's name for it). A component's `check` counts only as a static or class method
    (or a module-level function): an instance method of a user's class is not a config check."""
    found = []
    for entry in CHECK_ORDER:
        if entry not in KINDS:
            found.append(_import(entry, "config checks"))
            continue
        component = lookup(entry, names[entry])
        own = inspect.getattr_static(component, "check", None) if inspect.isclass(component) else None
        if isinstance(own, staticmethod | classmethod):
            found.append(component.check)
    return found


def names(kind: str) -> list[str]:
    """The names a config may give for `kind` without an import path (built-in, registered, entry points)."""
    _check_kind(kind)
    points = [ep.name for ep in entry_points(group=ENTRY_POINT_GROUPS[kind])]
    return sorted({*_BUILTIN[kind], *_REGISTERED[kind], *points})


def imports_code(kind: str, name: str) -> bool:
    """Whether `lookup(kind, name)` would import the module `name` gives (an import path that is not a registered,
    built-in, entry-point or family name): what a config from a checkpoint may not do (vitrain/trust.py)."""
    _check_kind(kind)
    family, colon, _ = name.partition(":")
    if not colon or name in _REGISTERED[kind] or name in _BUILTIN[kind] or family in _FAMILIES.get(kind, {}):
        return False
    return all(point.name != name for point in entry_points(group=ENTRY_POINT_GROUPS[kind]))


def lookup(kind: str, name: str) -> Any:
    """The component `name` stands for, or a ConfigError naming the config key, the value and the fix."""
    _check_kind(kind)
    key = CONFIG_KEYS[kind]
    if name in _REGISTERED[kind]:
        return _checked_kind(kind, name, _REGISTERED[kind][name])
    if name in _BUILTIN[kind]:
        return _import(_BUILTIN[kind][name], f"{key}={name}")
    for point in entry_points(group=ENTRY_POINT_GROUPS[kind]):
        if point.name == name:
            return _checked_kind(kind, name, point.load())
    family, colon, argument = name.partition(":")
    if colon and family in _FAMILIES.get(kind, {}):
        factory = _import(_FAMILIES[kind][family], f"{key}={name}")
        return _checked_kind(kind, name, factory(argument))
    if colon:
        return _checked_kind(kind, name, _import(name, f"{key}={name}"))
    known = ", ".join(names(kind) + [f"{family}:NAME" for family in _FAMILIES.get(kind, {})])
    raise ConfigError(f"{key}={name} is not known; use one of: {known}, or an import path such as mypkg.module:attr")


def _checked_kind(kind: str, name: str, component: Any) -> Any:
    """`component` if it is the kind of thing `kind` names, else a ConfigError saying what was expected."""
    where = f"{CONFIG_KEYS[kind]}={name}"
    if kind in _CALLABLE:
        pair = kind == "data" and isinstance(component, tuple | list) and len(component) == 2
        if not (callable(component) or pair):
            raise ConfigError(f"{where} is {_what(component)}, not {_CALLABLE[kind]}")
        return component
    protocol = _import(_PROTOCOLS[kind], "registry")
    article = "an" if kind[0] in "aeiou" else "a"
    expected = f"{article} {kind} class with the methods of the {protocol.__name__} protocol ({protocol.__module__})"
    if not inspect.isclass(component):
        raise ConfigError(f"{where} is {_what(component)}, not {expected}")
    missing = missing_members(protocol, component, optional=_OPTIONAL.get(kind, ()))
    if missing:
        raise ConfigError(f"{where} is a class without {', '.join(missing)}; give {expected}")
    return component


def takes(function: Any, *arguments: Any) -> bool:
    """Whether `function` (a class: its constructor) can be called with `arguments`, by its signature; True where
    none can be read (a builtin: calling it tells)."""
    try:
        inspect.signature(function).bind(*arguments)
    except TypeError:
        return False
    except ValueError:
        return True
    return True


def missing_members(protocol: type, component: Any, optional: tuple = (), attributes: bool = False) -> list[str]:
    """The public methods and properties of `protocol` (with `attributes`, its annotated attributes too: an
    instance's) that `component` lacks, other than the `optional` ones."""
    members = [
        n for n, v in vars(protocol).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))
    ]
    members += list(getattr(protocol, "__annotations__", {})) if attributes else []
    return [n for n in members if n not in optional and not hasattr(component, n)]


def _what(component: Any) -> str:
    """What a resolved name turned out to be, for an error: a function, a module, a str, ..."""
    if inspect.isroutine(component):
        return "a function"
    return "a module" if inspect.ismodule(component) else f"a {type(component).__name__}"


def _import(path: str, where: str) -> Any:
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"{where}: cannot import {module_name} ({error}); check the name or install it") from None
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise ConfigError(f"{where}: {module_name} has no attribute {attribute}") from None


def _check_kind(kind: str, what: str = "registry kind", fix: str = "") -> None:
    if not isinstance(kind, str) or kind not in KINDS:
        raise ConfigError(f"{what} {kind!r} is not one of {', '.join(KINDS)}{fix}")
