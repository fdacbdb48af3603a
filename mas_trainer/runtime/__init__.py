"""Runtime: the controller that runs apps on tasks."""

from .controller import AppRunner, Controller, RunResult

__all__ = ["Controller", "AppRunner", "RunResult"]
