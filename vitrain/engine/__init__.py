"""The engine room: the one training step, the engines it drives, the training loop, autotune and lr-find.

`from vitrain.engine import Trainer` still works; the names load on first use, so importing one engine module does
not import the whole loop.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {"Trainer": "vitrain.engine.trainer", "TrainStep": "vitrain.engine.step"}
__all__ = list(_NAMES)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'vitrain.engine' has no attribute {name!r}")
