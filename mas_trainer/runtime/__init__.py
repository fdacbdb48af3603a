"""Runtime: the controller that runs apps on tasks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mas_trainer._lazy import lazy_exports

if TYPE_CHECKING:  # pragma: no cover
    from mas_trainer.apps import AppRunner, RunResult
    from mas_trainer.runtime.controller import Controller

__all__ = ["AppRunner", "Controller", "RunResult"]

__getattr__ = lazy_exports(__name__, {
    "mas_trainer.apps": ["AppRunner", "RunResult"],
    "mas_trainer.runtime.controller": ["Controller"],
})
