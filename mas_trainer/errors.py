"""The one error type the CLI turns into a one-line message and exit status 2."""

from __future__ import annotations

import difflib
import os
import sys
import traceback
from typing import Any, Iterable

__all__ = ["RunStopped", "UserError", "did_you_mean", "nested_too_deep", "raised_in", "shown_path", "where_lost"]


class UserError(ValueError):
    """Something the user gave is wrong; the message names it and how to fix it."""


class RunStopped(UserError):
    """The run stopped for a cause outside the user's input (a worker or its node lost): its
    committed checkpoints are kept and `fit --resume` continues from the last one (the CLI: one
    line, exit status 1)."""


def where_lost(message: str) -> str:
    """`on node IP (id 1a2b3c4d): WHY` from the text of Ray's actor-death error, as far as it says."""
    import re

    ip = re.search(r"\bip: (\S+)", message)
    node = re.search(r"Node Id: ([0-9a-f]+)", message)
    died = re.search(r"The actor (?:died|is dead) because ([^\n.]*)", message)
    how = re.search(r"the actor's node was ([^\n]*)", message)
    why = (died.group(1).strip() if died else "its process died") + (f" ({' '.join(how.group(1).split())})" if how else "")
    return f"on node {ip.group(1) if ip else 'unknown'}" + (f" (id {node.group(1)[:8]})" if node else "") + f": {why}"


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``"did you mean 'x'? "`` for the closest of `known` to a misspelt `name`, else ``""``:
    the hint every unknown-name error puts before its list of the valid names."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


def shown_path(path: str) -> str:
    """A file as a user would type it: relative to the working directory when under it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive
        return path
    return path if rel.startswith(os.pardir) else rel


def _installed(path: str) -> bool:
    """Python's own files and installed packages (not the user's code), and frozen modules."""
    if path.startswith("<"):
        return True
    roots = {os.path.abspath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    full = os.path.abspath(path)
    return "site-packages" in full.split(os.sep) or any(full.startswith(r + os.sep) for r in roots)


def raised_in(exc: BaseException, own: str | os.PathLike[str] | None = None) -> str:
    """``FILE:LINE`` of the user's code where `exc` was raised, else ``""``: where a SyntaxError
    is; else the last frame of its traceback outside Python, installed packages and mas-trainer
    (the user's file, or a module of theirs it imports), else the last frame in the file `own`."""
    if isinstance(exc, SyntaxError) and exc.filename and exc.lineno:
        return f"{shown_path(exc.filename)}:{exc.lineno}"
    frames = traceback.extract_tb(exc.__traceback__)
    ours = os.path.dirname(os.path.abspath(__file__)) + os.sep
    mine = [f for f in frames if not _installed(f.filename) and not os.path.abspath(f.filename).startswith(ours)]
    if not mine and own is not None:
        mine = [f for f in frames if os.path.abspath(f.filename) == os.path.abspath(own)]
    return f"{shown_path(mine[-1].filename)}:{mine[-1].lineno}" if mine else ""


def nested_too_deep(value: Any, limit: int) -> bool:
    """Does `value` (parsed JSON) nest lists/objects deeper than `limit`? Iterative, so hostile
    input (a request body, a trajectory file, a task) cannot hit the recursion limit here;
    containers only go on the stack, so a long flat list costs none."""
    stack: list[tuple[Any, int]] = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False
