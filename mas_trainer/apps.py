"""Apps: load the object an APP reference names (``path/to/file.py:attr`` or
``package.module:attr``), and what a framework adapter gives the core: a runner for each
rollout (`AppRunner`, `RunResult`) and, for counterfactual credit, forks (`AppForks`).
The one core module that imports the adapter: the rest asks `app_runner` and `forks_of`."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from mas_trainer.errors import UserError, did_you_mean, raised_in
from mas_trainer.spec import ResolvedSpec
from mas_trainer.trace.schema import RunResult

if TYPE_CHECKING:
    from mas_trainer.rewards.levels import RewardSpec

__all__ = ["AppLoadError", "load_object", "AppRunner", "RunResult", "AppForks", "app_runner", "forks_of"]


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


class AppRunner(Protocol):
    """What the controller needs from a framework adapter."""

    framework: str
    spec: ResolvedSpec

    async def run(self, task: dict[str, Any], rollout_id: str, *, timeout_s: float | None = None) -> RunResult: ...

    def describe_recursion_limit(self) -> str:
        """The steps a rollout may take and whose limit that is, e.g. "9999 (the app's)"."""
        ...


class AppForks(Protocol):
    """What forking rollouts needs of an adapter (loop/forking.py): `check` refuses an app or
    task that cannot be forked honestly; within `keeping_threads` finished rollouts keep their
    threads (rollout id -> thread id); a thread's `checkpoints` by superstep; `continuations`,
    the app run from them (fork rollout id -> checkpoint)."""

    def check(self, spec: RewardSpec, roles: Sequence[str] | None = None, tasks: Sequence[dict[str, Any]] = ()) -> None: ...
    def keeping_threads(self) -> AbstractAsyncContextManager[dict[str, str]]: ...
    async def checkpoints(self, thread_id: str) -> dict[int, dict[str, Any]]: ...
    def continuations(self, starts: dict[str, dict[str, Any]]) -> AppRunner: ...


def app_runner(obj: Any, *, base_model: str | None = None, recursion_limit: int | None = None,
               recursion_limit_from: str = "recursion_limit") -> AppRunner:
    """The runner of an app object (a LangGraph graph, builder or function returning one), its spec checked.
    `recursion_limit`: the user's, named `recursion_limit_from` where the verbs say which applies; None
    keeps the app's own (else its framework's default)."""
    from mas_trainer.adapters.langgraph import LangGraphApp

    return LangGraphApp(obj, base_model=base_model, recursion_limit=recursion_limit, recursion_limit_from=recursion_limit_from)


def forks_of(app: object) -> AppForks:
    """How `app`'s rollouts are forked, or a UserError for an app whose framework cannot be."""
    from mas_trainer.adapters.langgraph.forks import LangGraphForks
    from mas_trainer.adapters.langgraph.runner import LangGraphApp

    if not isinstance(app, LangGraphApp):
        raise UserError("forking rollouts (reward.allocator=counterfactual) needs a LangGraph app")
    return LangGraphForks(app)
