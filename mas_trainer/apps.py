"""Apps: load the object an APP reference names (``path/to/file.py:attr`` or
``package.module:attr``), and what a framework adapter gives the controller for each run
(`AppRunner`, `RunResult`)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Protocol

from mas_trainer.errors import UserError, did_you_mean, raised_in
from mas_trainer.spec import ResolvedSpec
from mas_trainer.trace.schema import NodeCall, ToolCall

__all__ = ["AppLoadError", "load_object", "AppRunner", "RunResult"]


class AppLoadError(UserError):
    """One line saying what is missing; the CLI prints it and exits 2."""


def load_object(ref: str) -> Any:
    if ":" not in ref:
        raise AppLoadError(f"APP must be 'path/to/file.py:attr' or 'package.module:attr', got {ref!r}")
    where, attr = ref.rsplit(":", 1)
    if not attr:
        raise AppLoadError(f"APP {ref!r} names no attribute after ':'")
    if where.endswith(".py") or "/" in where or where.startswith("."):
        path = Path(where)
        if not path.is_file():
            raise AppLoadError(f"app file not found: {where}")
        name = f"_mas_app_{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise AppLoadError(f"cannot import {where}: not a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        # the app's own folder is importable, as when its author runs `python app.py`
        sys.path.insert(0, str(path.resolve().parent))
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise AppLoadError(_import_failed(where, exc, path)) from exc
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as exc:
            raise AppLoadError(f"module not found: {where} ({exc.name} is missing)") from exc
        except Exception as exc:
            raise AppLoadError(_import_failed(where, exc, getattr(module_spec(where), "origin", None))) from exc
    obj = module
    parts = attr.split(".")
    for i, part in enumerate(parts):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            owner = "it" if i == 0 else ".".join(parts[:i])
            raise AppLoadError(f"{where} has no attribute {attr!r}; {did_you_mean(part, names)}"
                               f"{owner} defines: {', '.join(names[:20]) or 'nothing'}")
        obj = getattr(obj, part)
    return obj


def module_spec(name: str) -> Any:
    """The import spec of module `name` (None when it cannot be found)."""
    try:
        return importlib.util.find_spec(name)
    except Exception:  # a parent package that fails to import: no spec, the error says the rest
        return None


def _import_failed(where: str, exc: BaseException, own: str | Path | None) -> str:
    """One line: what the import raised and where in the user's code (FILE:LINE)."""
    at = raised_in(exc, own)
    message = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return f"importing {where} failed: {message}" + (f" (at {at})" if at else "")


@dataclass
class RunResult:
    status: str
    error: str | None
    final_state: Any
    nodes: list[NodeCall]
    tool_calls: list[ToolCall]
    trace_id: str | None


class AppRunner(Protocol):
    """What the controller needs from a framework adapter."""

    framework: str
    spec: ResolvedSpec

    async def run(self, task: dict[str, Any], rollout_id: str, *, timeout_s: float | None = None) -> RunResult: ...
