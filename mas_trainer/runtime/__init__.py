"""Runtime: the controller that runs apps on tasks."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from mas_trainer.apps import AppRunner, RunResult
    from mas_trainer.runtime.controller import Controller

__all__ = ["AppRunner", "Controller", "RunResult"]

# imported on first use: `import mas_trainer.config` (every CLI command) must not pay for
# FastAPI, OpenTelemetry or Ray through a package's __init__
_LAZY = {
    "AppRunner": "mas_trainer.apps",
    "Controller": "mas_trainer.runtime.controller",
    "RunResult": "mas_trainer.apps",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
