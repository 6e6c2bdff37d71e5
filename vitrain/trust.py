"""A config read from a checkpoint or run folder is untrusted: vitrain imports no module, runs no command it names."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vitrain import registry
from vitrain.errors import ConfigError

# The keys the registry resolves (vitrain/registry.py): an import path there is a module vitrain would import.
COMPONENT_KEYS = {"model.name": "model", "task.name": "task", "data.source": "data", "train.engine": "engine"}
# The keys that may be a `pipe:COMMAND` shard URL, or a shard list file holding one (vitrain/data/shards.py): a
# shell command vitrain would run.
SHARD_KEYS = ("data.root", "data.val_root")
PIPE = "pipe:"  # vitrain.data.shards.PIPE (not imported: the data package is heavy, this module is ground floor)
LIST_SUFFIXES = (".txt", ".list", ".lst")  # what shard_urls reads as a list file
COMMAND_LINE = "give {key}={value} on the command line if you trust it"
REGISTER = "register it in your own code (vitrain.register) if you trust it"


def check_config(
    raw: Mapping[str, Any],
    where: str | Path,
    trusted: Mapping[str, Any] | None = None,
    data: bool = True,
    fix: str = COMMAND_LINE,
) -> None:
    """Refuse, in one line naming the key, the value, `where` and `fix`, a config read from `where` (a checkpoint's
    meta.json, a run's config.yaml, an export's config.yaml) that names a module to import or (`data`: its data will
    be read) a pipe: command, unless `trusted` (dotted keys: what the user typed, or a config that passed this check)
    gives the same value."""
    flat = _flatten(raw)
    for key, kind in COMPONENT_KEYS.items():
        if key in flat:
            check_component(kind, key, flat[key], where, trusted, fix)
    for key in SHARD_KEYS if data else ():
        value = str(flat.get(key) or "").strip()
        if value and not _given(trusted, key, value):
            what = _command_in(value)
            if what:
                raise ConfigError(_line(where, key, value, what, "runs no command", fix))


def check_component(
    kind: str,
    key: str,
    value: Any,
    where: str | Path,
    trusted: Mapping[str, Any] | None,
    fix: str = COMMAND_LINE,
    named: str = "",
) -> None:
    """Refuse a component name from `where` that the registry would resolve by importing it (check_config's rule);
    `key` is the config key a user gives it under, `named` the field `where` holds it in (default: `key`)."""
    name = str(value)
    if registry.imports_code(kind, name) and not _given(trusted, key, name):
        raise ConfigError(_line(where, key, name, "an import path", "imports no code", fix, named))


def _line(where: str | Path, key: str, value: str, what: str, does: str, fix: str, named: str = "") -> str:
    return (
        f"{where} names {named or key}={value}, {what}; vitrain {does} a checkpoint or run folder names: "
        + fix.format(key=key, value=value)
    )


def _command_in(value: str) -> str:
    """What makes a shard location a shell command: a pipe: URL, or a list file with one; empty when none does."""
    if value.startswith(PIPE):
        return "a shell command"
    path = Path(value).expanduser()
    if path.suffix.lower() not in LIST_SUFFIXES or not path.is_file():
        return ""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for number, line in enumerate(lines, 1):
        if PIPE in line:  # anywhere in the line: its braces may expand to a pipe: URL
            return f"a shard list whose line {number} is a shell command ({PIPE})"
    return ""


def _given(trusted: Mapping[str, Any] | None, key: str, value: str) -> bool:
    return trusted is not None and key in trusted and str(trusted[key]).strip() == value.strip()


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items() if isinstance(tree, Mapping) else ():
        if isinstance(value, Mapping):
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat
