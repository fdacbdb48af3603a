"""Forked continuations from LangGraph's own checkpoints, for counterfactual turn credit.

What LangGraph knows (`LangGraphForks`, reached through `mas_trainer.apps.forks_of`): which
checkpointer a rollout runs on and keeping its thread until the forks ran (`keeping_threads`),
a rollout's checkpoints by superstep (`checkpoints`), the app run from one of them
(`continuations`), and whether the app may be forked at all (`check`).
`mas_trainer/loop/forking.py` drives them for a batch of rollouts.

**Checkpointer.** The app's own, when it was compiled with one (its threads are this run's
own, fresh per rollout, and are deleted afterwards: the saver is left as it was); else a copy
of the compiled graph with an in-memory saver, used for these rollouts only (the app itself is
not changed). A graph compiled with ``checkpointer=False`` cannot be forked and is refused.

**Forking** is LangGraph's time travel: ``ainvoke(None, {"configurable": {"thread_id",
"checkpoint_id"}})`` loads that checkpoint, re-runs the tasks it had pending (the node of a
"before" checkpoint is sampled again, its saved writes are not reused) and saves the
continuation as a new branch of the thread. Sibling forks of one checkpoint run concurrently
on one thread: every checkpoint and write is keyed by its own id, so branches do not mix.
A subgraph runs inside its parent's node, so forks start from the parent graph's checkpoints.

**Not trained.** Each continuation has its own rollout id (``<rollout>-cf<step>-k<j>``): the
gateway files its LLM calls under that id, the controller records them in the continuation's
trajectory, and no turn record is ever made from it (only the batch's own rollouts are sent to
the worker groups, whose buffer is cleared at each update), as an LLM judge's calls are never trained.

**Refused**, in one line, before any rollout: an app that declares a node with outside side
effects (``trainable(..., no_fork={"send_email"})``), which every continuation would run again;
a task that names its own ``thread_id`` (its thread is the user's); no trajectory reward.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.memory import InMemorySaver

from mas_trainer.errors import UserError
from mas_trainer.rewards.counterfactual import COUNTERFACTUAL
from mas_trainer.rewards.levels import RewardSpec
from mas_trainer.trace.schema import RunResult

from .runner import LangGraphApp, _drop_thread
from .trainable import no_fork_of

__all__ = ["LangGraphForks", "Continuations"]


class LangGraphForks:
    """Forking a LangGraph app's rollouts: the `AppForks` contract of `mas_trainer/apps.py`."""

    def __init__(self, app: LangGraphApp) -> None:
        self.app = app

    def check(self, spec: RewardSpec, roles: Sequence[str] | None = None, tasks: Sequence[dict[str, Any]] = ()) -> None:
        """Refuse, in one line, an app (or task) whose rollouts cannot be forked honestly, or
        ``roles`` (``reward.counterfactual.roles``) that are not trained roles of the app."""
        app = self.app
        unforkable = sorted(no_fork_of(app.graph))
        if unforkable:
            raise UserError(f"reward.allocator={COUNTERFACTUAL} runs parts of each rollout again from its checkpoints, but the "
                            f"app declares node(s) {', '.join(map(repr, unforkable))} not forkable (no_fork: outside side "
                            "effects); choose another reward.allocator")
        if app.graph.checkpointer is False:
            raise UserError(f"reward.allocator={COUNTERFACTUAL} forks rollouts from checkpoints, but the app is compiled with "
                            "checkpointer=False; compile it with a checkpointer (or none: an in-memory one is used)")
        if spec.trajectory is None:
            raise UserError(f"reward.allocator={COUNTERFACTUAL} scores continuations with the trajectory reward, and the app "
                            "has none; give @trainable a reward=")
        known = sorted({r.role for r in map(app.spec.route, app.spec.nodes) if r.trainable})
        unknown = sorted(set(roles or ()) - set(known))
        if unknown:
            raise UserError(f"reward.counterfactual.roles names {', '.join(map(repr, unknown))}, not a trained role of the "
                            f"app; its trained roles are {', '.join(known) or 'none'}")
        for task in tasks:
            if app.configurable(task, "probe")[1] is False:
                raise UserError(f"reward.allocator={COUNTERFACTUAL}: task {str(task)[:80]} names its own thread_id; forks "
                                "run on threads this run makes and deletes, never on a user's own")

    @contextlib.asynccontextmanager
    async def keeping_threads(self) -> AsyncIterator[dict[str, str]]:
        """Within: the app runs on a checkpointed graph and keeps its finished rollouts' threads
        (rollout id -> thread id, yielded); after: those threads are deleted and the app is as before."""
        app, original = self.app, self.app.graph
        saver = original.checkpointer
        graph = original if isinstance(saver, BaseCheckpointSaver) else original.copy(update={"checkpointer": InMemorySaver()})
        app.graph, app.kept_threads = graph, {}
        kept = app.kept_threads
        try:
            yield kept
        finally:
            for thread_id in kept.values():
                await _drop_thread(graph, thread_id)
            app.graph, app.kept_threads = original, None

    async def checkpoints(self, thread_id: str) -> dict[int, dict[str, Any]]:
        """Step -> the configurable (thread_id, checkpoint_ns, checkpoint_id) of a rollout's own checkpoints."""
        out: dict[int, dict[str, Any]] = {}
        async for snap in self.app.graph.aget_state_history({"configurable": {"thread_id": thread_id}}):
            step = (snap.metadata or {}).get("step")
            if isinstance(step, int) and step not in out:  # newest first: a step saved twice keeps its latest
                out[step] = dict(snap.config["configurable"])
        return out

    def continuations(self, starts: dict[str, dict[str, Any]]) -> Continuations:
        return Continuations(self.app, starts)


class Continuations:
    """The app as the controller runs it for continuations: each fork id starts from its checkpoint."""

    framework = "langgraph"

    def __init__(self, app: LangGraphApp, starts: dict[str, dict[str, Any]]) -> None:
        self.app, self.spec, self.starts = app, app.spec, starts

    def describe_recursion_limit(self) -> str:
        return self.app.describe_recursion_limit()  # a continuation runs as its rollout did

    async def run(self, task: dict[str, Any], rollout_id: str, *, timeout_s: float | None = None) -> RunResult:
        # input None + a checkpoint_id: LangGraph's fork; a thread given in the task is not dropped by the runner
        return await self.app.run({"input": None, "config": {"configurable": self.starts[rollout_id]}}, rollout_id,
                                  timeout_s=timeout_s)
