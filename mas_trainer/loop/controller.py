"""The centre of the star: runs the app on tasks and assembles trajectories.

Rollouts run concurrently (bounded); each is the app invoked unchanged with a tracer, and
its LLM calls are collected from the gateway's ledger when it ends.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from typing import Any, Callable, Iterable

from mas_trainer.apps import AppRunner
from mas_trainer.gateway.ledger import Ledger
from mas_trainer.trace.schema import LLMCall, NodeCall, Trajectory

__all__ = ["Controller", "state_json", "call_order", "unrecorded_calls"]


def state_json(obj: Any) -> Any:
    """Graph state as JSON: pydantic models (LangChain messages included) dumped, the rest str()."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, dict):
        return {str(k): state_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [state_json(v) for v in obj]
    dump = getattr(obj, "model_dump", None)
    if callable(dump):
        try:
            return state_json(dump(mode="json"))
        except Exception:
            pass
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("langgraph"):
        return {"type": type(obj).__name__, **state_json(vars(obj))}
    return str(obj)


_DIGITS = re.compile(r"(\d+)")


def _natural(text: str) -> list[Any]:
    """``worker@2(__pregel_push,10,False)`` after ``...,9,...``: text and numbers alternate, numbers compared as numbers."""
    return [int(part) if i % 2 else part for i, part in enumerate(_DIGITS.split(text))]


def call_order(nodes: list[NodeCall]) -> Callable[[LLMCall], tuple[Any, ...]]:
    """The sort key of a rollout's LLM calls: by what their node calls are, not by when they ran.

    A call of a node call whose `branch` is known (LangGraph's tracer records it) sorts by the
    chain of node calls it ran in, outermost first, each by (superstep, branch, attempt): one
    superstep's parallel branches (`Send`s told apart by their index) come in the same order in
    every run, however they raced; then by start time, which orders the calls one node call
    makes one after the other. Calls outside such node calls (another adapter's, whose nodes
    carry no branch; a call from a thread without the tracer's context) follow, by start time.
    """
    by_id = {n.id: n for n in nodes}
    chains: dict[str, list[tuple[int, list[Any], int]]] = {}
    for node in nodes:
        if node.branch is None:
            continue
        chain: list[tuple[int, list[Any], int]] = []
        seen: set[str] = set()
        current: NodeCall | None = node
        while current is not None and current.id not in seen:  # outward to the top-level node call
            seen.add(current.id)
            chain.append((current.step if current.step is not None else -1, _natural(current.branch or current.name),
                          current.attempt))
            current = by_id.get(current.parent_id) if current.parent_id else None
        chains[node.id] = chain[::-1]

    def key(call: LLMCall) -> tuple[Any, ...]:
        chain = chains.get(call.node_id or "")
        return (chain is None, chain or [], call.start_time or 0.0)

    return key


def unrecorded_calls(answered: list[tuple[str, str]], calls: list[LLMCall]) -> str | None:
    """One line when an LLM call the app got an answer to is missing from the rollout's calls,
    else None. Training on the rest would credit the recorded turns with what the missing ones
    did, so the rollout fails (another instrumentation or client sent the call past the gateway)."""
    recorded = {c.id for c in calls}
    missing = [(call_id, node) for call_id, node in answered if call_id not in recorded]
    if not missing:
        return None
    nodes = ", ".join(sorted({node for _, node in missing}))
    return (f"{len(missing)} of {len(answered)} LLM calls answered in this rollout were not recorded by the run's gateway "
            f"(node {nodes}): something between the app and the gateway (another OpenTelemetry instrumentation, a "
            f"client of its own) dropped the routing headers; see docs/routing.md#unrecorded-calls")


class Controller:
    def __init__(self, app: AppRunner, ledger: Ledger, *, max_in_flight: int = 64, timeout_s: float | None = 300.0) -> None:
        self.app = app
        self.ledger = ledger
        self.max_in_flight = max_in_flight
        self.timeout_s = timeout_s

    async def rollout(self, task: dict[str, Any], rollout_id: str | None = None) -> Trajectory:
        rollout_id = rollout_id or uuid.uuid4().hex
        start = time.time()
        result = await self.app.run(task, rollout_id, timeout_s=self.timeout_s)
        calls = self.ledger.take(rollout_id)
        node_names = {n.id: n.name for n in result.nodes}
        for call in calls:
            if call.node is None and call.node_id in node_names:
                call.node = node_names[call.node_id]
        status, error = result.status, result.error
        unrecorded = unrecorded_calls(result.answered, calls)
        if status == "ok" and unrecorded:
            status, error = "error", unrecorded
        return Trajectory(rollout_id=rollout_id, task=task, status=status,  # type: ignore[arg-type]
                          error=error, trace_id=result.trace_id, nodes=result.nodes,
                          llm_calls=sorted(calls, key=call_order(result.nodes)), tool_calls=result.tool_calls,
                          final_state=state_json(result.final_state), duration_s=time.time() - start)

    async def run(self, tasks: Iterable[dict[str, Any]], *, n: int = 1, ids: list[str] | None = None,
                  on_done: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
        """Run every task `n` times, at most `max_in_flight` rollouts at once, in task order.

        `ids` (one per rollout, task-major) makes rollout ids reproducible, e.g. for training."""
        sem = asyncio.Semaphore(self.max_in_flight)
        jobs = [t for t in tasks for _ in range(n)]
        if ids is not None and len(ids) != len(jobs):
            raise ValueError(f"{len(ids)} rollout ids for {len(jobs)} rollouts")
        if ids is not None and len(set(ids)) != len(ids):
            # the gateway files a call under its rollout id: two live rollouts with one id would share a trajectory
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"rollout id {dup!r} is given twice; give every rollout of one run() its own id")

        async def one(task: dict[str, Any], rollout_id: str | None) -> Trajectory:
            async with sem:
                traj = await self.rollout(task, rollout_id)
            if on_done is not None:
                on_done(traj)
            return traj

        return list(await asyncio.gather(*(one(t, ids[i] if ids else None) for i, t in enumerate(jobs))))
