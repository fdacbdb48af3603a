"""Reward functions at three levels, and their evaluation on one trajectory.

Every level is a plain callable with the same shape, ``fn(task, subject, trajectory)``,
where the middle argument is what that level judges:

=========== =================================== ===========================================
level       subject                             example
=========== =================================== ===========================================
trajectory  the app's final state               exact match of the answer with ``task``
role        that role's LLM calls, in order     a format reward for the planner's plans
turn        one LLM call (``LLMCall``)          tests passed after this edit of the coder
=========== =================================== ===========================================

Any of them may return ``None`` for "not applicable": that level then gives the call
nothing (it is not the same as 0.0, and the audit record says which it was). Role and turn
rewards are given either as one callable for every role, or as a mapping role -> callable
so that only the roles named are judged.

A reward that raises is a bug in user code, so it is re-raised as :class:`RewardError`
naming the function, the level, the rollout and (for a turn) the call, instead of a bare
traceback from deep inside the trainer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mas_trainer.errors import UserError
from mas_trainer.trace.schema import LLMCall, Trajectory

__all__ = [
    "TrajectoryReward",
    "RoleReward",
    "TurnReward",
    "RewardError",
    "RewardSpec",
    "LevelValues",
    "evaluate_levels",
]

TrajectoryReward = Callable[[dict[str, Any], Any, Trajectory], "float | None"]
RoleReward = Callable[[dict[str, Any], Sequence[LLMCall], Trajectory], "float | None"]
TurnReward = Callable[[dict[str, Any], LLMCall, Trajectory], "float | None"]


class RewardError(UserError):
    """A user reward function raised or returned something that is not a finite number."""


def _name(fn: Callable[..., Any]) -> str:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}.{qualname}" if module else qualname


def _call(fn: Callable[..., Any], where: str, *args: Any) -> float | None:
    """Run one reward, turning a raise or a non-number into a RewardError that names it."""
    try:
        value = fn(*args)
    except Exception as exc:  # user code: any exception is reported, with its cause chained
        raise RewardError(f"reward {_name(fn)} raised {type(exc).__name__}: {exc} ({where})") from exc
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise RewardError(
            f"reward {_name(fn)} returned {value!r} ({type(value).__name__}); expected a number or None ({where})"
        ) from None
    if not math.isfinite(number):
        raise RewardError(f"reward {_name(fn)} returned {number}; rewards must be finite ({where})")
    return number


def _per_role(rewards: Any, what: str) -> Callable[[str], Callable[..., Any] | None]:
    """Normalise 'one callable for all roles' and 'role -> callable' into a lookup."""
    if rewards is None:
        return lambda role: None
    if isinstance(rewards, Mapping):
        for role, fn in rewards.items():
            if not callable(fn):
                raise UserError(f"{what} reward for role {role!r} is {fn!r}, not a callable")
        return rewards.get
    if callable(rewards):
        return lambda role: rewards
    raise UserError(f"{what} rewards must be a callable or a mapping role -> callable, got {rewards!r}")


@dataclass
class RewardSpec:
    """The user's rewards, any combination of the three levels.

    ``roles`` and ``turns`` are one callable applied to every role (every call), or a
    mapping role -> callable; roles missing from the mapping are not judged at that level.
    """

    trajectory: TrajectoryReward | None = None
    roles: RoleReward | Mapping[str, RoleReward] | None = None
    turns: TurnReward | Mapping[str, TurnReward] | None = None

    def __post_init__(self) -> None:
        if self.trajectory is not None and not callable(self.trajectory):
            raise UserError(f"trajectory reward is {self.trajectory!r}, not a callable")
        self._role_fn = _per_role(self.roles, "role")
        self._turn_fn = _per_role(self.turns, "turn")

    def role_reward(self, role: str) -> RoleReward | None:
        return self._role_fn(role)

    def turn_reward(self, role: str) -> TurnReward | None:
        return self._turn_fn(role)


@dataclass
class LevelValues:
    """What each level returned for one trajectory, before any allocation.

    ``roles`` holds an entry for every role that has calls in the trajectory and a role
    reward; ``turns`` one for every call whose role has a turn reward. ``None`` values
    mean the reward said "not applicable".
    """

    trajectory: float | None = None
    roles: dict[str, float | None] = field(default_factory=dict)
    turns: dict[str, float | None] = field(default_factory=dict)


def evaluate_levels(spec: RewardSpec, trajectory: Trajectory) -> LevelValues:
    """Call every applicable reward of ``spec`` once on ``trajectory``.

    Calls are judged in ``trajectory.llm_calls`` order (the order they were made), which
    allocators such as ``turn_delta`` rely on.
    """
    task, rid = trajectory.task, trajectory.rollout_id
    values = LevelValues()
    if spec.trajectory is not None:
        values.trajectory = _call(
            spec.trajectory, f"trajectory level, rollout {rid}", task, trajectory.final_state, trajectory
        )
    by_role: dict[str, list[LLMCall]] = {}
    for call in trajectory.llm_calls:
        by_role.setdefault(call.role, []).append(call)
    for role, calls in by_role.items():
        fn = spec.role_reward(role)
        if fn is not None:
            values.roles[role] = _call(fn, f"role level, role {role!r}, rollout {rid}", task, calls, trajectory)
    for call in trajectory.llm_calls:
        turn_fn = spec.turn_reward(call.role)
        if turn_fn is not None:
            where = f"turn level, llm call {call.id} of role {call.role!r}, rollout {rid}"
            values.turns[call.id] = _call(turn_fn, where, task, call, trajectory)
    return values
