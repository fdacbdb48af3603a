"""Counterfactual credit's forked continuations, run for a batch of training rollouts.

`fork_rollouts` runs a batch as `Session.rollouts` does, but keeps each finished rollout's
checkpointer thread (the adapter's `keeping_threads`, reached through `apps.forks_of`); then, for every checkpoint its trained
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

from mas_trainer.apps import AppForks, forks_of
from mas_trainer.config import RewardConfig
from mas_trainer.errors import UserError
from mas_trainer.rewards.counterfactual import CounterfactualConfig, credit_segments, fork_steps, forks_per_point, mean_return
from mas_trainer.rewards.judge import score_groups
from mas_trainer.rewards.levels import RewardError, RewardSpec, evaluate_levels
from mas_trainer.loop.controller import Controller
from mas_trainer.loop.session import Session
from mas_trainer.trace.schema import ForkSegment, Forks, ForkValue, Trajectory

__all__ = ["fork_rollouts", "fork_group"]

_Plan = tuple[list[ForkSegment], dict[str, str], dict[int, dict[str, Any]]]  # segments, turns skipped, checkpoints by step


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
    (checkpoints forked), ``forks/runs`` (continuations: K each, see ``Forks.k``) and
    ``time/fork_s`` (seconds from the rollouts' end to the last continuation scored)."""
    app = forks_of(session.app)
    cfg: CounterfactualConfig = reward.counterfactual
    app.check(spec, cfg.roles, tasks)  # fit checked the app and its tasks before any rollout: a rare second look
    async with app.keeping_threads() as threads:
        trajs = await session.rollouts(tasks, n=n, ids=ids)
        t0 = time.perf_counter()
        plans: dict[str, _Plan] = {}
        for t in trajs:
            if t.rollout_id not in threads:
                continue
            segments, skipped = credit_segments(t, cfg.roles, boundaries_only=cfg.boundaries_only)
            if segments:
                plans[t.rollout_id] = (segments, skipped, await app.checkpoints(threads[t.rollout_id]))
        points = [(rid, step) for rid, (segs, _, _) in plans.items() for step in fork_steps(segs)]
        k = forks_per_point(len(points), cfg.k, cfg.max_forks_per_step)
        # a step without a checkpoint (a run cut short) is not forked: its segments get no estimate
        origin = {f"{rid}-cf{step}-k{j}": (rid, step) for rid, step in points if step in plans[rid][2] for j in range(k)}
        forks = await _continue(session, app, trajs, plans, origin)
        await asyncio.to_thread(score_groups, spec, forks)  # an LLM judge ranks the continuations of one task together
        values, by_id = _values(spec, forks, plans, origin, reward.on_failure), {t.rollout_id: t for t in trajs}
        for rid, (segments, skipped, _) in plans.items():
            by_id[rid].forks = Forks(k=k, segments=segments, values=values[rid], skipped=skipped)
        seconds = time.perf_counter() - t0
    return trajs, forks, {"forks/points": float(len(points)), "forks/runs": float(len(forks)), "time/fork_s": seconds}


async def _continue(session: Session, app: AppForks, trajs: list[Trajectory], plans: dict[str, _Plan],
                    origin: dict[str, tuple[str, int]]) -> list[Trajectory]:
    """Every continuation (fork id -> its rollout and step), run from its checkpoint through the session's gateway."""
    starts = {fid: plans[rid][2][step] for fid, (rid, step) in origin.items()}
    task_of = {t.rollout_id: t.task for t in trajs}

    def done(fork: Trajectory) -> None:
        if fork.status != "ok":  # as Session.rollouts: calls its threads still make are not its own
            session.gateway.end_rollouts([fork.rollout_id])

    controller = Controller(app.continuations(starts), session.ledger, max_in_flight=session.max_in_flight,
                            timeout_s=session.timeout_s)
    return await controller.run([task_of[rid] for rid, _ in origin.values()], ids=list(origin), on_done=done)


def _values(spec: RewardSpec, forks: list[Trajectory], plans: dict[str, _Plan], origin: dict[str, tuple[str, int]],
            on_failure: float | str) -> dict[str, dict[int, ForkValue]]:
    """Rollout id -> step (ascending) -> V of that checkpoint, from its continuations' returns (a
    failed one counts as on_failure's, so it is named as failed)."""
    values: dict[str, dict[int, ForkValue]] = {rid: {} for rid in plans}
    for fork in forks:
        rid, step = origin[fork.rollout_id]
        try:
            value = _return(spec, fork, on_failure)
        except RewardError as exc:
            raise UserError(f"counterfactual credit: continuation {fork.rollout_id} of rollout {rid}: {exc}") from exc
        point = values[rid].setdefault(step, ForkValue(checkpoint_id=plans[rid][2][step].get("checkpoint_id")))
        point.returns[fork.rollout_id] = value
        if fork.status != "ok":
            point.failed[fork.rollout_id] = fork.status
    for points in values.values():
        for point in points.values():
            point.value = mean_return(point.returns.values())
    return {rid: dict(sorted(points.items())) for rid, points in values.items()}

