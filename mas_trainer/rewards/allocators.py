"""Allocators: from the three reward levels to one scalar per LLM call, with an audit trail.

An allocator is ``fn(trajectory, values, weights, **options) -> {llm_call_id: Allocation | float}``
and must give every call of the trajectory a reward. Built in:

- ``broadcast``: call reward = w_traj * R_traj + w_role * R_role(call.role) + w_turn * R_turn(call).
- ``turn_delta``: as broadcast, but the turn level is read as a running score R_i (e.g. the
  fraction of tests passing after the i-th call, as in the UnityMAS-O code workflow) and
  the call gets its improvement R_i - R_{i-1}. Options: ``initial`` (R_0, default 0.0) and
  ``per_role`` (differences within each role's own calls instead of across all calls).

A level that is not defined, or returned None, adds nothing. Register your own with
``@register_allocator("name")`` (same pattern as verl's ``register_adv_est``) or pass the
callable itself to :func:`assign_rewards`; one that reads ``Trajectory.forks`` registers with
``needs_forks=True`` (as ``counterfactual`` does), and `fit` forks its training rollouts.

:func:`assign_rewards` writes ``trajectory.rewards``: ``trajectory`` and ``roles`` are the
raw level values, ``turns`` the allocated scalar per call, and ``detail`` says for each call
which levels contributed, with which value and weight, so a user can audit every number.
Failed rollouts (status ``error``/``timeout``) are not judged (their final state is partial):
every call gets the fill reward, or the rollout is marked dropped so advantage groups skip it.
"""

from __future__ import annotations

import inspect
import statistics
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mas_trainer.errors import UserError
from mas_trainer.rewards.levels import LevelValues, RewardSpec, evaluate_levels
from mas_trainer.trace.schema import Rewards, Trajectory

__all__ = ["Allocation", "Allocator", "LevelWeights", "register_allocator", "needs_forks", "get_allocator", "allocator_names",
           "check_allocator", "broadcast", "turn_delta", "assign_rewards", "is_dropped", "rollout_reward"]


class LevelWeights(BaseModel):
    """Weights that mix the levels into one call reward (config: ``reward.weights``)."""

    model_config = ConfigDict(extra="forbid")

    trajectory: float = Field(1.0, description="weight of the trajectory reward in every call's reward")
    role: float = Field(1.0, description="weight of the call's role reward")
    turn: float = Field(1.0, description="weight of the call's own turn reward")


@dataclass
class Allocation:
    """One call's reward and, per level, how it was made (``{"value", "weight", "contribution", ...}``)."""

    reward: float
    parts: dict[str, dict[str, Any]] = field(default_factory=dict)


Allocator = Callable[..., Mapping[str, "Allocation | float"]]

_ALLOCATORS: dict[str, Allocator] = {}
_NEEDS_FORKS: set[str] = set()


def register_allocator(name: str, *, needs_forks: bool = False) -> Callable[[Allocator], Allocator]:
    """Decorator: make ``fn`` selectable as ``allocator=name``; a second, different fn is an error.
    ``needs_forks``: it reads ``Trajectory.forks``, so `fit` checks that the app can be forked
    and forks its training rollouts (loop/forking.py, config ``reward.counterfactual``)."""

    def decorator(fn: Allocator) -> Allocator:
        if name in _ALLOCATORS and _ALLOCATORS[name] is not fn:
            raise ValueError(f"allocator {name!r} is already registered: {_ALLOCATORS[name]} vs {fn}")
        _ALLOCATORS[name] = fn
        (_NEEDS_FORKS.add if needs_forks else _NEEDS_FORKS.discard)(name)
        return fn

    return decorator


def needs_forks(name: str) -> bool:
    """Whether allocator ``name`` reads forked continuations of the rollouts it rewards."""
    return name in _NEEDS_FORKS


def get_allocator(name: str) -> Allocator:
    try:
        return _ALLOCATORS[name]
    except KeyError:
        raise UserError(f"unknown reward allocator {name!r}; known: {', '.join(allocator_names())}") from None


def allocator_names() -> list[str]:
    return sorted(_ALLOCATORS)


def check_allocator(name: str, options: Mapping[str, Any] | None = None) -> None:
    """The allocator is registered and takes every option given, or a UserError naming the
    valid choices: a config is checked before any rollout, not at the first reward."""
    fn = get_allocator(name)
    params = list(inspect.signature(fn).parameters.values())[3:]  # after (trajectory, values, weights)
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    valid = [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    unknown = sorted(set(options or {}) - set(valid))
    if unknown:
        raise UserError(f"reward.options: allocator {name!r} has no option {unknown[0]!r}; "
                        f"valid: {', '.join(valid) if valid else 'none (leave reward.options empty)'}")


def _part(value: float, weight: float, **extra: Any) -> dict[str, Any]:
    return {"value": value, "weight": weight, "contribution": weight * value, **extra}


def _shared_parts(values: LevelValues, weights: LevelWeights, role: str) -> dict[str, dict[str, Any]]:
    """Trajectory and role parts, the same for every allocator that mixes levels linearly."""
    parts: dict[str, dict[str, Any]] = {}
    if values.trajectory is not None:
        parts["trajectory"] = _part(values.trajectory, weights.trajectory)
    role_value = values.roles.get(role)
    if role_value is not None:
        parts["role"] = _part(role_value, weights.role)
    return parts


def _total(parts: dict[str, dict[str, Any]]) -> float:
    return float(sum(p["contribution"] for p in parts.values()))


@register_allocator("broadcast")
def broadcast(trajectory: Trajectory, values: LevelValues, weights: LevelWeights) -> dict[str, Allocation]:
    """Every call gets the trajectory reward plus its own role's and its own turn's rewards."""
    out: dict[str, Allocation] = {}
    for call in trajectory.llm_calls:
        parts = _shared_parts(values, weights, call.role)
        turn_value = values.turns.get(call.id)
        if turn_value is not None:
            parts["turn"] = _part(turn_value, weights.turn)
        out[call.id] = Allocation(_total(parts), parts)
    return out


@register_allocator("turn_delta")
def turn_delta(trajectory: Trajectory, values: LevelValues, weights: LevelWeights, *, initial: float = 0.0,
               per_role: bool = False) -> dict[str, Allocation]:
    """The turn level is a running score; a call is credited with how much it moved it.

    Calls are taken in `llm_calls` order (node-call order, docs/trajectory.md). A call whose score is None (not
    applicable) gets no turn part and does not move the previous score, so the next scored
    call is compared with the last score seen. The deltas of a rollout sum to its last
    score minus ``initial``: with a trajectory reward equal to that final score, set
    ``weights.trajectory = 0`` to avoid counting it twice.
    """
    previous: dict[str, float] = {}
    out: dict[str, Allocation] = {}
    for call in trajectory.llm_calls:
        parts = _shared_parts(values, weights, call.role)
        score = values.turns.get(call.id)
        if score is not None:
            key = call.role if per_role else ""
            before = previous.get(key, initial)
            parts["turn"] = _part(score - before, weights.turn, score=score, previous=before)
            previous[key] = score
        out[call.id] = Allocation(_total(parts), parts)
    return out


def _allocator_name(fn: Allocator) -> str:
    return next((name for name, registered in _ALLOCATORS.items() if registered is fn),
                f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}")


def is_dropped(trajectory: Trajectory) -> bool:
    """True when :func:`assign_rewards` removed this failed rollout from its group."""
    return bool(trajectory.rewards.detail.get("dropped"))


def rollout_reward(trajectory: float | None, turns: Iterable[float], dropped: bool = False) -> float | None:
    """A rollout's reward as `fit`'s metrics and the viewer count it: none for a dropped rollout,
    else its trajectory-level reward, else the mean of its calls' allocated rewards."""
    if dropped:
        return None
    if trajectory is not None:
        return trajectory
    values = list(turns)
    return statistics.fmean(values) if values else None


def assign_rewards(trajectory: Trajectory, spec: RewardSpec, *, allocator: str | Allocator = "broadcast",
                   weights: LevelWeights | Mapping[str, float] | None = None, on_failure: float | Literal["drop"] = 0.0,
                   options: Mapping[str, Any] | None = None) -> Trajectory:
    """Evaluate ``spec`` on ``trajectory``, allocate, and write ``trajectory.rewards`` (in place; returned).

    ``options`` are passed to the allocator as keywords (``turn_delta``: ``initial``, ``per_role``).
    ``on_failure``: the reward every call of an ``error``/``timeout`` rollout gets, or
    ``"drop"`` to leave its calls without rewards and mark it (see :func:`is_dropped`).
    """
    fn = get_allocator(allocator) if isinstance(allocator, str) else allocator
    name = _allocator_name(fn)
    w = weights if isinstance(weights, LevelWeights) else LevelWeights(**(weights or {}))
    if trajectory.status != "ok":
        failed = {"status": trajectory.status, "error": trajectory.error}
        if on_failure == "drop":
            trajectory.rewards = Rewards(detail={"dropped": True, "failed": failed})
        elif isinstance(on_failure, (int, float)) and not isinstance(on_failure, bool):
            fill = float(on_failure)
            trajectory.rewards = Rewards(turns={c.id: fill for c in trajectory.llm_calls},
                                         detail={"failed": {**failed, "fill": fill}})
        else:
            raise UserError(f"on_failure must be a number or 'drop', got {on_failure!r}")
        return trajectory
    values = evaluate_levels(spec, trajectory)
    allocated = fn(trajectory, values, w, **dict(options or {}))
    turns: dict[str, float] = {}
    calls: dict[str, Any] = {}
    for call in trajectory.llm_calls:
        if call.id not in allocated:
            raise UserError(f"allocator {name} gave no reward to llm call {call.id} (rollout {trajectory.rollout_id})")
        item = allocated[call.id]
        alloc = item if isinstance(item, Allocation) else Allocation(float(item))
        turns[call.id] = float(alloc.reward)
        calls[call.id] = {"role": call.role, "reward": turns[call.id], "parts": alloc.parts}
    not_applicable = {"trajectory": spec.trajectory is not None and values.trajectory is None,
                      "roles": sorted(r for r, v in values.roles.items() if v is None),
                      "turns": sorted(c for c, v in values.turns.items() if v is None)}
    trajectory.rewards = Rewards(
        trajectory=values.trajectory, roles={r: v for r, v in values.roles.items() if v is not None}, turns=turns,
        detail={"allocator": name, "weights": w.model_dump(), "options": dict(options or {}),
                "not_applicable": not_applicable, "calls": calls})
    return trajectory

