"""Runs a compiled LangGraph app on one task with the tracer attached."""

from __future__ import annotations

import asyncio
from typing import Any

from langgraph.errors import GraphRecursionError
from langgraph.pregel import Pregel

from mas_trainer.runtime.controller import RunResult

from .tracer import GraphTracer
from .trainable import resolve

__all__ = ["LangGraphApp"]


class LangGraphApp:
    """The controller's view of a LangGraph app (the `AppRunner` protocol)."""

    framework = "langgraph"

    def __init__(self, obj: Any, *, base_model: str | None = None, recursion_limit: int = 50) -> None:
        self.graph: Pregel
        self.graph, self.spec = resolve(obj, base_model)
        self.recursion_limit = recursion_limit
        self._input_keys = _input_keys(self.graph)

    def graph_input(self, task: dict[str, Any]) -> Any:
        """A task's `input` field if it has one, else its fields that the graph's input schema names."""
        if "input" in task:
            return task["input"]
        if self._input_keys is None:
            return dict(task)
        return {k: v for k, v in task.items() if k in self._input_keys}

    async def run(self, task: dict[str, Any], rollout_id: str, *, timeout_s: float | None = None) -> RunResult:
        tracer = GraphTracer(rollout_id, self.spec)
        config = {
            "callbacks": [tracer],
            "metadata": {"mas_trainer_rollout_id": rollout_id},
            "recursion_limit": self.recursion_limit,
            "configurable": {"thread_id": rollout_id},
        }
        status, error, final = "ok", None, None
        try:
            final = await asyncio.wait_for(self.graph.ainvoke(self.graph_input(task), config), timeout_s)
        except asyncio.TimeoutError:
            status, error = "timeout", f"rollout exceeded {timeout_s} s"
        except GraphRecursionError as exc:
            status, error = "error", f"GraphRecursionError: {exc}".splitlines()[0]
        except Exception as exc:  # the app's own failure is data, not a crash of the caller
            status, error = "error", f"{type(exc).__name__}: {exc}".splitlines()[0]
        if final is None and status != "ok":
            final = _last_state(self.graph, config)
        nodes, tools = tracer.finish(status, error)
        return RunResult(status, error, final, nodes, tools, tracer.trace_id)


def _input_keys(graph: Pregel) -> set[str] | None:
    try:
        props = graph.get_input_jsonschema().get("properties")
    except Exception:
        return None
    return set(props) if props else None


def _last_state(graph: Pregel, config: dict) -> Any:
    """With a checkpointer, what the graph had when it failed; without, nothing."""
    if graph.checkpointer is None:
        return None
    try:
        return graph.get_state(config).values
    except Exception:
        return None
