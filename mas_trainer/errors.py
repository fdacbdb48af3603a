"""The one error type the CLI turns into a one-line message and exit status 2."""

__all__ = ["UserError"]


class UserError(ValueError):
    """Something the user gave is wrong; the message names it and how to fix it."""
