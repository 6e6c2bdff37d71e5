"""A config read from a checkpoint or run folder is untrusted: vitrain imports no module, runs no command it names."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vitrain import registry
from vitrain.errors import ConfigError
from vitrain.shard_names import PIPE, is_list_file, named_urls

# The keys that may name a `pipe:COMMAND` shard URL, directly, through braces or in a list file (shard_names): a
# shell command vitrain would run.
SHARD_KEYS = ("data.root", "data.val_root")
COMMAND_LINE = "give {given} on the command line if you trust it"
REGISTER = (
    "register it (vitrain.register in your own code, or a package's entry point) or give the same value in this run's "
    "own config if you trust it"
)


def check_config(
    raw: Mapping[str, Any],
    where: str | Path,
    trusted: Mapping[str, Any] | None = None,
    data: bool = True,
    fix: str = COMMAND_LINE,
) -> None:
    """Refuse, in one line naming every such key with its value, `where` and `fix`, a config read from `where` (a
    checkpoint's meta.json, a run's config.yaml, an export's config.yaml) that names a module to import or (`data`:
    its data will be read) a pipe: command, unless `trusted` (dotted keys: what the user typed, or a config that
    passed this check) gives the same value."""
    flat = flatten(raw)
    found = []
    for kind, key in registry.CONFIG_KEYS.items():
        name = str(flat.get(key, ""))
        if key in flat and registry.imports_code(kind, name) and not _given(trusted, key, name):
            found.append((key, name, "an import path"))
    for key in SHARD_KEYS if data else ():
        value = str(flat.get(key) or "").strip()
        if value and not _given(trusted, key, value) and (what := _command_in(value)):
            found.append((key, value, what))
    if found:
        raise ConfigError(_line(where, found, fix))


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
        raise ConfigError(_line(where, [(key, name, "an import path")], fix, named))


def _line(where: str | Path, found: list[tuple[str, str, str]], fix: str, named: str = "") -> str:
    """One line for every (key, value, what it is) found: what vitrain will not do, and how a user vouches."""
    names = "; ".join(f"{named or key}={value}, {what}" for key, value, what in found)
    imports = any(what == "an import path" for _, _, what in found)
    commands = any(what != "an import path" for _, _, what in found)
    does = " and ".join(["imports no code"] * imports + ["runs no command"] * commands)
    given = " ".join(f"{key}={value}" for key, value, _ in found)
    return f"{where} names {names}; vitrain {does} a checkpoint or run folder names: " + fix.format(given=given)


def _command_in(value: str) -> str:
    """What makes a shard location a shell command, read as the shard reader reads it (braces expanded, a list
    file's lines too): empty when nothing does."""
    try:
        urls = named_urls(value)
    except (OSError, UnicodeDecodeError):  # an unreadable list file: the reader names it, and runs nothing
        return ""
    commands = [url for url in urls if url.startswith(PIPE)]
    if not commands:
        return ""
    listed = is_list_file(Path(value.strip()).expanduser()) and not value.strip().startswith(PIPE)
    return f"{'a shard list naming ' if listed else ''}a shell command ({commands[0]})"


def _given(trusted: Mapping[str, Any] | None, key: str, value: str) -> bool:
    return trusted is not None and key in trusted and str(trusted[key]).strip() == value.strip()


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested dict (to_dict's) with dotted keys: {"model": {"width": 192}} -> {"model.width": 192}. Anything but a
    mapping (a meta.json or config.yaml that holds a list) has no keys. vitrain.config re-exports it: config imports
    this module, so it lives here, below both."""
    flat: dict[str, Any] = {}
    for key, value in tree.items() if isinstance(tree, Mapping) else ():
        if isinstance(value, Mapping):
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat
