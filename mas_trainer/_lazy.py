"""Packages re-export their public names without importing their modules first: `import
mas_trainer.config` (every CLI command) must not pay for FastAPI, OpenTelemetry, torch or Ray
through a package's `__init__`."""

from __future__ import annotations

import importlib
from typing import Any, Callable

__all__ = ["lazy_exports"]


def lazy_exports(package: str, modules: dict[str, list[str]]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: each name listed under a module (module -> names)
    is imported from that module on first use."""
    where = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name in where:
            return getattr(importlib.import_module(where[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
