"""Class names made up from the label indices where the data names none: counted, never shown as names."""

from __future__ import annotations


class IndexNames(list):
    """Names "0", "1", ... for a source whose data names no classes (synthetic data, a RecordIO set without classes.txt,
    shards indexed from labels alone). A list like any other for counting and messages; checkpoints and exports
    leave them out (vitrain/engine/runs.py `class_names`), so that no file presents them as the classes' names."""


def index_names(count: int) -> IndexNames:
    return IndexNames(str(i) for i in range(count))
