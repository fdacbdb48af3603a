"""The one error type the CLI turns into a one-line message and exit status 2."""

from __future__ import annotations

import difflib
from typing import Iterable

__all__ = ["UserError", "did_you_mean"]


class UserError(ValueError):
    """Something the user gave is wrong; the message names it and how to fix it."""


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``"did you mean 'x'? "`` for the closest of `known` to a misspelt `name`, else ``""``:
    the hint every unknown-name error puts before its list of the valid names."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""
