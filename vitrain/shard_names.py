"""How a shard location is written (brace patterns, list files, pipe: commands): one reading for data and trust."""

from __future__ import annotations

import re
from pathlib import Path

PIPE = "pipe:"  # a shard URL that is a shell command whose stdout is the shard
LIST_SUFFIXES = (".txt", ".list", ".lst")  # a file of these names lists one shard (or pattern) per line


def expand_braces(pattern: str) -> list[str]:
    """Bash-style braces: `a-{000..002}.tar` -> a-000.tar a-001.tar a-002.tar (zero padding kept), `{x,y}`."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    head, tail, body = pattern[: match.start()], pattern[match.end() :], match.group(1)
    span = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if span:
        low, high = span.groups()
        width = len(low) if low.startswith("0") else 0
        items = [str(i).zfill(width) for i in range(int(low), int(high) + 1)]
    else:
        items = body.split(",")
    return [out for item in items for out in expand_braces(head + item + tail)]


def is_list_file(path: Path) -> bool:
    return path.suffix.lower() in LIST_SUFFIXES and path.is_file()


def named_urls(root: str) -> list[str]:
    """The shard URLs `root` names, braces expanded, before any is opened: a pipe: command (one per expansion), a
    list file's lines (each expanded; relative ones under the list's folder), or a pattern. A folder names its .tar
    files, which the reader lists itself: none here. Any URL starting with PIPE is a command that reading runs."""
    root = root.strip()
    if root.startswith(PIPE):
        return [PIPE + command for command in expand_braces(root[len(PIPE) :])]
    path = Path(root).expanduser()
    if path.is_dir():
        return []
    if is_list_file(path):
        lines = [line.strip() for line in path.read_text().splitlines()]
        urls = [u for line in lines if line and not line.startswith("#") for u in expand_braces(line)]
        return [u if u.startswith(PIPE) or Path(u).is_absolute() else str(path.parent / u) for u in urls]
    return [u if u.startswith(PIPE) else str(Path(u).expanduser()) for u in expand_braces(root)]
