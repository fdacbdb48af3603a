"""Runs a compiled LangGraph app on one task with the tracer attached."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any

from langgraph._internal._config import ensure_config
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.errors import GraphRecursionError
from langgraph.pregel import Pregel

from mas_trainer.trace.schema import RunResult
from mas_trainer.errors import UserError

from .tracer import GraphTracer
from .trainable import resolve

__all__ = ["LangGraphApp"]

log = logging.getLogger(__name__)

RAISE_RECURSION_LIMIT = "rollout.recursion_limit=N (fit) or --recursion-limit N (trace, eval)"


class LangGraphApp:
    """The controller's view of a LangGraph app (the `AppRunner` protocol)."""

    framework = "langgraph"

    def __init__(self, obj: Any, *, base_model: str | None = None, recursion_limit: int | None = None,
                 recursion_limit_from: str = "recursion_limit") -> None:
        self.graph: Pregel
        self.graph, self.spec = resolve(obj, base_model)
        # None: the app's own limit stands; else the user's, named by the setting it came from
        self.recursion_limit, self.recursion_limit_from = recursion_limit, recursion_limit_from
        self._input_keys = _input_keys(self.graph)
        # rollout id -> thread id of the rollouts whose threads are kept for forking (forks.py), else None
        self.kept_threads: dict[str, str] | None = None
        self._pending_checked = False

    def check_tasks(self, tasks: list[dict[str, Any]]) -> None:
        """Refuse, in one line and before any rollout, a task the graph cannot start from: a
        graph whose state requires `messages` (MessagesState, create_react_agent) given a task
        without them would fail every rollout deep inside a node (an IndexError)."""
        builder = getattr(self.graph, "builder", None)
        required = getattr(getattr(builder, "input_schema", None), "__required_keys__", frozenset())
        if "messages" not in required:
            return
        for task in tasks:
            if "input" not in task and not task.get("messages"):
                raise UserError(f"task {json.dumps(task, default=str)[:80]} has no 'messages', which the graph's input "
                                f"({builder.input_schema.__name__}) requires: give each task its conversation, e.g. "
                                '{"messages": [{"role": "user", "content": "..."}]}, or the whole graph input as "input"')

    def effective_recursion_limit(self) -> tuple[int, str]:
        """The recursion limit each rollout runs with and whose it is: the user's when set, else the
        one the app bound (``graph.with_config(recursion_limit=N)``, as langchain's create_agent and
        deepagents do), else LangGraph's default. A limit passed at invocation replaces the bound
        one, so the runner passes one only when the user set it."""
        if self.recursion_limit is not None:
            return self.recursion_limit, self.recursion_limit_from
        bound = (self.graph.config or {}).get("recursion_limit")
        limit = ensure_config(self.graph.config)["recursion_limit"]  # merged as Pregel merges it
        return limit, ("the app's" if bound is not None and bound == limit else "LangGraph's default")

    def describe_recursion_limit(self) -> str:
        """E.g. "9999 (the app's)", for the verbs' start lines."""
        limit, source = self.effective_recursion_limit()
        return f"{limit} ({source})"

    def graph_input(self, task: dict[str, Any]) -> Any:
        """A task's `input` field if it has one, else its fields that the graph's input schema names."""
        if "input" in task:
            return task["input"]
        if self._input_keys is None:
            return dict(task)
        return {k: v for k, v in task.items() if k in self._input_keys}

    def configurable(self, task: dict[str, Any], rollout_id: str) -> tuple[dict[str, Any], bool]:
        """The run's `configurable` values and whether its checkpointer thread is the rollout's own.

        Every rollout gets a fresh `thread_id` (the rollout id plus a random suffix, so a
        rerun of the same rollout id, or another run on a persistent checkpointer, starts
        empty too), unless the task gives one: a task written as ``{"input": ..., "config":
        {"configurable": {...}}}`` passes those values to the run, `thread_id` included.
        """
        given = task.get("config") if "input" in task else None
        values = dict((given or {}).get("configurable") or {}) if isinstance(given, dict) else {}
        if values.get("thread_id") is not None:
            return values, False
        values["thread_id"] = f"{rollout_id}-{uuid.uuid4().hex[:12]}"
        return values, True

    async def run(self, task: dict[str, Any], rollout_id: str, *, timeout_s: float | None = None) -> RunResult:
        tracer = GraphTracer(rollout_id, self.spec)
        configurable, own_thread = self.configurable(task, rollout_id)
        config: dict[str, Any] = {
            "callbacks": [tracer],
            "metadata": {"mas_trainer_rollout_id": rollout_id},
            "configurable": configurable,
        }
        if self.recursion_limit is not None:
            config["recursion_limit"] = self.recursion_limit
        status, error, final = "ok", None, None
        try:
            final = await asyncio.wait_for(self.graph.ainvoke(self.graph_input(task), config), timeout_s)
        except asyncio.TimeoutError:
            status, error = "timeout", f"rollout exceeded {timeout_s} s"
        except GraphRecursionError as exc:
            status, error = "error", self._recursion_error(exc)
        except Exception as exc:  # the app's own failure is data, not a crash of the caller
            status, error = "error", f"{type(exc).__name__}: {exc}".splitlines()[0]
        if final is None and status != "ok":
            final = _last_state(self.graph, config)
        if own_thread and self.kept_threads is not None and status == "ok":
            self.kept_threads[rollout_id] = configurable["thread_id"]  # forks.py drops it after the forks ran
        elif own_thread:
            await _drop_thread(self.graph, configurable["thread_id"])
        if tracer.refused is not None:
            status, error = "error", str(tracer.refused)
        nodes, tools = tracer.finish(status, error)
        self._name_unseen_agents()
        return RunResult(status, error, final, nodes, tools, tracer.trace_id, answered=list(tracer.answered))

    def _name_unseen_agents(self) -> None:
        """After the first rollout, an agent key (`@helper`) that no call has matched is named in
        one line: a misspelt name, or an agent this task did not need (later ones may)."""
        if self._pending_checked or not self.spec.pending:
            return
        self._pending_checked = True
        unseen = self.spec.unseen_pending()
        if unseen:
            log.warning("agent key(s) %s matched no call in the first rollout (misspelt, or not run for that task); %s",
                        ", ".join(map(repr, unseen)), self.spec.describe_names())

    def _recursion_error(self, exc: GraphRecursionError) -> str:
        """One line naming the limit hit, whose it is and how to raise it (LangGraph's own text asks
        for a config key the user cannot reach); a subgraph's own limit keeps LangGraph's text."""
        limit, source = self.effective_recursion_limit()
        if f"limit of {limit} " not in str(exc):
            return f"GraphRecursionError: {exc}".splitlines()[0]
        return (f"GraphRecursionError: recursion limit {limit} ({source}) reached: the app did not finish within "
                f"{limit} supersteps; raise it with {RAISE_RECURSION_LIMIT}")


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


async def _drop_thread(graph: Pregel, thread_id: str) -> None:
    """Forget a thread this runner made once its rollout is recorded: training runs thousands
    of rollouts, and they must not pile up in an in-memory (or the user's own) checkpointer."""
    saver = graph.checkpointer
    if not isinstance(saver, BaseCheckpointSaver):
        return
    try:
        await saver.adelete_thread(thread_id)
    except NotImplementedError:
        pass
    except Exception as exc:  # a checkpointer that cannot delete keeps the thread: not fatal
        log.debug("could not delete checkpointer thread %s: %s", thread_id, exc)
