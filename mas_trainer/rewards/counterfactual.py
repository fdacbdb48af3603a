"""Counterfactual turn credit: what each trained turn changed in the expected return.

A broadcast gives every turn of a rollout the rollout's reward, so an upstream role (a
planner, a query rewriter) is credited with whatever the roles after it did. Here a turn's
credit is measured instead, as VinePPO (Kazemnejad et al., 2024) does for reasoning steps:
the graph's state is saved after every superstep (LangGraph's checkpoints), K continuations
of the unchanged app are run from the checkpoint before the turn's node ran and from the one
after it finished, and

    credit(turn) = V(after) - V(before),   V(checkpoint) = mean return of its K continuations

A continuation's *return* is the trajectory-level reward of the state it ends in. The
continuations from "before" sample the turn again; those from "after" keep it; so the
difference is the change in expected return that this turn's sample made, with everything
downstream averaged out. The forking itself is the adapter's (``adapters/langgraph/forks.py``);
this module is pure: which checkpoints a rollout needs (:func:`credit_segments`), how many
continuations fit the budget (:func:`forks_per_point`), the estimate (:func:`segment_credit`)
and the allocator ``counterfactual`` that writes it, with its audit trail, as each turn's reward.

**Steps.** A node that ran in LangGraph superstep ``s`` (``langgraph_step``, ``NodeCall.step``)
finished into the checkpoint of step ``s`` and started from the one of step ``s - 1``. A node
inside a subgraph is placed at the step of its top-level enclosing node: the parent graph's
checkpoints are the ones a run can be forked from.

**The record** the forking step leaves on ``Trajectory.forks`` (and the allocator reads) is
`mas_trainer.trace.schema.Forks`: K, the credited segments, V and the returns by checkpoint
step, and the turns skipped with why.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from typing import cast

from mas_trainer.rewards.config import CounterfactualConfig
from mas_trainer.rewards.allocators import Allocation, LevelWeights, broadcast, register_allocator
from mas_trainer.rewards.levels import LevelValues
from mas_trainer.trace.schema import ForkSegment, Trajectory

__all__ = ["COUNTERFACTUAL", "CounterfactualConfig", "credit_segments", "forks_per_point", "fork_steps",
           "mean_return", "segment_credit", "counterfactual"]

COUNTERFACTUAL = "counterfactual"


def _top_level_steps(trajectory: Trajectory) -> dict[str, int | None]:
    """Node call id -> the superstep of its top-level enclosing node call (itself at top level)."""
    by_id = {n.id: n for n in trajectory.nodes}
    out: dict[str, int | None] = {}
    for node in trajectory.nodes:
        top, seen = node, set()
        while top.parent_id is not None and top.parent_id in by_id and top.id not in seen:
            seen.add(top.id)
            top = by_id[top.parent_id]
        out[node.id] = top.step
    return out


def credit_segments(trajectory: Trajectory, roles: Iterable[str] | None = None, *,
                    boundaries_only: bool = False) -> tuple[list[ForkSegment], dict[str, str]]:
    """The segments of ``trajectory``'s trained turns, in step order, and the turns left out with why.

    A turn is credited when it is trainable, of one of ``roles`` (None: any) and its node's
    superstep is known. Default: one segment per (superstep, role), i.e. per node of that role
    (parallel nodes of one superstep share the checkpoint after it, so their credits share it
    too). ``boundaries_only``: consecutive segments of one role merge into one (before its first
    step, after its last).
    """
    wanted = None if roles is None else set(roles)
    steps = _top_level_steps(trajectory)
    by_key: dict[tuple[int, str], list[str]] = {}
    skipped: dict[str, str] = {}
    for call in trajectory.llm_calls:
        if not call.trainable or (wanted is not None and call.role not in wanted):
            continue
        step = steps.get(call.node_id or "")
        if step is None:
            skipped[call.id] = "its node's superstep is unknown (a call outside any traced node)"
            continue
        by_key.setdefault((step, call.role), []).append(call.id)
    segments = [ForkSegment(role=role, before=step - 1, after=step, calls=ids) for (step, role), ids in sorted(by_key.items())]
    if not boundaries_only:
        return segments, skipped
    merged: list[ForkSegment] = []
    for seg in segments:
        last = merged[-1] if merged else None
        if last is not None and last.role == seg.role and last.after <= seg.before:
            merged[-1] = ForkSegment(role=seg.role, before=last.before, after=seg.after, calls=last.calls + seg.calls)
        else:
            merged.append(seg)
    return merged, skipped


def fork_steps(segments: Iterable[ForkSegment]) -> list[int]:
    """The checkpoint steps a rollout's segments need, ascending, each once (after one turn is before the next)."""
    return sorted({s for seg in segments for s in (seg.before, seg.after)})


def forks_per_point(points: int, k: int, budget: int | None) -> int:
    """K for a step with ``points`` checkpoints to fork from: ``k``, shrunk to fit ``budget``
    continuations in all, but at least 1 (a needed checkpoint without a continuation has no value)."""
    if budget is None or points == 0:
        return k
    return max(1, min(k, budget // points))


def mean_return(returns: Iterable[float | None]) -> float | None:
    """V of a checkpoint: the mean of its continuations' returns (None ones, dropped failures, left out)."""
    kept = [r for r in returns if r is not None]
    return statistics.fmean(kept) if kept else None


def segment_credit(segment: ForkSegment, values: Mapping[int, float | None]) -> float | None:
    """``values[after] - values[before]`` (step -> V), or None when either has no estimate."""
    before, after = values.get(segment.before), values.get(segment.after)
    return None if before is None or after is None else after - before


@register_allocator(COUNTERFACTUAL, needs_forks=True)
def counterfactual(trajectory: Trajectory, values: LevelValues, weights: LevelWeights) -> dict[str, Allocation]:
    """Each credited turn's reward is its counterfactual credit ``V(after) - V(before)`` (the
    forks measured it from the trajectory reward, so the levels are not added again); every
    other call, and every call of a rollout that was not forked (held-out rollouts, `eval`,
    `trace`), gets the broadcast reward, with the reason in its audit trail."""
    out = cast(dict[str, Allocation], broadcast(trajectory, values, weights))  # registered: typed as any Allocator
    record = trajectory.forks
    if record is None:
        for alloc in out.values():
            alloc.parts["counterfactual"] = {"skipped": "rollout not forked (only fit's training rollouts are)"}
        return out
    for call_id, why in record.skipped.items():
        if call_id in out:
            out[call_id].parts["counterfactual"] = {"skipped": why}
    step_values = {step: v.value for step, v in record.values.items()}
    for seg in record.segments:
        credit = segment_credit(seg, step_values)
        audit = {"before": step_values.get(seg.before), "after": step_values.get(seg.after),
                 "steps": [seg.before, seg.after], "k": record.k}
        for call_id in seg.calls:
            if call_id not in out:
                continue
            if credit is None:  # every continuation of one side failed and was dropped: no estimate
                out[call_id].parts["counterfactual"] = {"skipped": "no value estimate (every continuation failed)", **audit}
                continue
            out[call_id] = Allocation(credit, {"counterfactual": {"value": credit, "weight": 1.0, "contribution": credit,
                                                                  **audit}})
    return out
