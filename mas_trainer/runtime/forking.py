"""Counterfactual credit's forked continuations, run for a batch of training rollouts.

`fork_rollouts` runs a batch as `Session.rollouts` does, but keeps each finished rollout's
checkpointer thread (the adapter's `keeping_threads`); then, for every checkpoint its trained
turns need (before and after each turn's node: `mas_trainer/rewards/counterfactual.py`), runs
K continuations of the unchanged app from it through the same gateway and engines, scores each
with the app's trajectory reward, writes the fork record on the rollout (`Trajectory.forks`,
which the `counterfactual` allocator reads) and lets the adapter drop the threads.

**Recorded, not trained unless asked.** Each continuation has its own rollout id
(``<rollout>-cf<step>-k<j>``): the gateway files its LLM calls under that id and the
controller gathers them into the continuation's trajectory, which `fit` writes to
``trajectories/step_N_forks.jsonl``. By default no turn record is made from it (the worker
groups' buffers are cleared at each update), just as an LLM judge's calls are never trained;
with ``reward.counterfactual.train_forks`` the K continuations of one checkpoint are trained
as one group (`fork_group`).

**Cost.** Each rollout needs one checkpoint before its first credited turn plus one after each
(fewer with ``boundaries_only``), K continuations each, and a continuation costs what the rest
of the rollout from there costs. They run ``max_in_flight`` at a time, as rollouts do.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from mas_trainer.adapters.langgraph.forks import Continuations, check_forkable, checkpoints, keeping_threads
from mas_trainer.adapters.langgraph.runner import LangGraphApp
from mas_trainer.config import RewardConfig
from mas_trainer.errors import UserError
from mas_trainer.rewards.counterfactual import (
    COUNTERFACTUAL,
    CounterfactualConfig,
    Segment,
    credit_segments,
    fork_steps,
    forks_per_point,
    mean_return,
)
from mas_trainer.rewards.judge import score_groups
from mas_trainer.rewards.levels import RewardError, RewardSpec, evaluate_levels
from mas_trainer.runtime.controller import Controller
from mas_trainer.runtime.session import Session
from mas_trainer.trace.schema import Trajectory

__all__ = ["fork_rollouts", "fork_group"]


def _return(spec: RewardSpec, fork: Trajectory, on_failure: float | str) -> float | None:
    """A continuation's return: its trajectory reward; a failed one counts as reward.on_failure (or not at all: drop)."""
    if fork.status != "ok":
        return float(on_failure) if isinstance(on_failure, (int, float)) else None
    return evaluate_levels(RewardSpec(spec.trajectory), fork).trajectory


def fork_group(fork_id: str) -> tuple[str, int]:
    """(rollout id, checkpoint step) of a continuation, from its id ``<rollout>-cf<step>-k<j>``:
    the continuations of one checkpoint share it (one group when they are trained)."""
    head, _, _ = fork_id.rpartition("-k")
    rid, _, step = head.rpartition("-cf")
    return rid, int(step)


async def fork_rollouts(session: Session, tasks: list[dict[str, Any]], n: int, ids: list[str] | None, spec: RewardSpec,
                        reward: RewardConfig) -> tuple[list[Trajectory], list[Trajectory], dict[str, float]]:
    """Run the rollouts, fork each one's trained turns' checkpoints, record the forks on them.

    Returns the rollouts (``forks`` set on each one forked), the continuations (their own
    trajectories, ids ``<rollout>-cf<step>-k<j>``) and the cost as metrics: ``forks/points``
    (checkpoints forked), ``forks/runs`` (continuations: K each, see ``forks["k"]``) and
    ``time/fork_s`` (seconds from the rollouts' end to the last continuation scored)."""
    app = session.app
    if not isinstance(app, LangGraphApp):
        raise UserError(f"reward.allocator={COUNTERFACTUAL} needs a LangGraph app")
    cfg: CounterfactualConfig = reward.counterfactual
    roles = cfg.roles
    check_forkable(app, spec, roles, tasks)  # fit checked the app and its tasks before any rollout: a rare second look
    async with keeping_threads(app) as threads:
        trajs = await session.rollouts(tasks, n=n, ids=ids)
        t0 = time.perf_counter()
        plans: dict[str, tuple[list[Segment], dict[str, str], dict[int, dict[str, Any]]]] = {}
        for t in trajs:
            if t.rollout_id not in threads:
                continue
            segments, skipped = credit_segments(t, roles, boundaries_only=cfg.boundaries_only)
            if segments:
                plans[t.rollout_id] = (segments, skipped, await checkpoints(app.graph, threads[t.rollout_id]))
        points = [(rid, step) for rid, (segs, _, _) in plans.items() for step in fork_steps(segs)]
        k = forks_per_point(len(points), cfg.k, cfg.max_forks_per_step)
        starts: dict[str, dict[str, Any]] = {}
        origin: dict[str, tuple[str, int]] = {}
        for rid, step in points:
            ckpt = plans[rid][2].get(step)
            if ckpt is None:
                continue  # no checkpoint at that step (a run cut short): the segment gets no estimate
            for j in range(k):
                fid = f"{rid}-cf{step}-k{j}"
                starts[fid], origin[fid] = ckpt, (rid, step)
        by_id = {t.rollout_id: t for t in trajs}
        fork_ids = list(starts)

        def done(fork: Trajectory) -> None:
            if fork.status != "ok":  # as Session.rollouts: calls its threads still make are not its own
                session.gateway.end_rollouts([fork.rollout_id])

        controller = Controller(Continuations(app, starts), session.ledger, max_in_flight=session.max_in_flight,
                                timeout_s=session.timeout_s)
        forks = await controller.run([by_id[origin[f][0]].task for f in fork_ids], ids=fork_ids, on_done=done)
        await asyncio.to_thread(score_groups, spec, forks)  # an LLM judge ranks the continuations of one task together
        returns: dict[str, dict[int, dict[str, float | None]]] = {}
        failed: dict[str, dict[int, dict[str, str]]] = {}  # a failed one's return is on_failure's, so say it failed
        for fork in forks:
            rid, step = origin[fork.rollout_id]
            try:
                value = _return(spec, fork, reward.on_failure)
            except RewardError as exc:
                raise UserError(f"counterfactual credit: continuation {fork.rollout_id} of rollout {rid}: {exc}") from exc
            returns.setdefault(rid, {}).setdefault(step, {})[fork.rollout_id] = value
            if fork.status != "ok":
                failed.setdefault(rid, {}).setdefault(step, {})[fork.rollout_id] = fork.status
        for rid, (segments, skipped, ckpts) in plans.items():
            values = {str(step): {"checkpoint_id": ckpts.get(step, {}).get("checkpoint_id"),
                                  "value": mean_return(rets.values()), "returns": rets,
                                  "failed": failed.get(rid, {}).get(step, {})}
                      for step, rets in sorted(returns.get(rid, {}).items())}
            by_id[rid].forks = {"k": k, "segments": [s.as_json() for s in segments], "values": values, "skipped": skipped}
        seconds = time.perf_counter() - t0
    return trajs, forks, {"forks/points": float(len(points)), "forks/runs": float(len(forks)), "time/fork_s": seconds}
