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

A reward that raises is a bug in user code, so it is re-raised as :class:`RewardError`, one
line naming the function, the file and line where it raised (the last frame of the traceback
inside the reward's own file), the level, the rollout and (for a turn) the call, instead of a
bare traceback from deep inside the trainer. A reward defined in an app file loaded by path is
named by that file, not by the module name the loader gave it (``_mas_app_<hash>``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mas_trainer.errors import UserError
from mas_trainer.errors import shown_path as _shown
from mas_trainer.trace.schema import LLMCall, Trajectory

if TYPE_CHECKING:
    from mas_trainer.spec import TrainSpec

__all__ = ["TrajectoryReward", "RoleReward", "TurnReward", "RewardError", "RewardSpec", "LevelValues", "evaluate_levels",
           "check_arity", "langgraph_state"]

TrajectoryReward = Callable[[dict[str, Any], Any, Trajectory], "float | None"]
RoleReward = Callable[[dict[str, Any], Sequence[LLMCall], Trajectory], "float | None"]
TurnReward = Callable[[dict[str, Any], LLMCall, Trajectory], "float | None"]


class RewardError(UserError):
    """A user reward function raised or returned something that is not a finite number."""


APP_MODULE_PREFIX = "_mas_app_"  # what `mas_trainer.apps.load_object` names a module loaded from a file path
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # mas_trainer/: its rewards are named by module


def _target(fn: Callable[..., Any]) -> Any:
    """The function whose code a reward runs: through ``functools.partial`` and decorators
    that keep ``__wrapped__``; a callable object's ``__call__``."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    with contextlib.suppress(ValueError):  # a cycle of __wrapped__
        fn = inspect.unwrap(fn)
    if getattr(fn, "__code__", None) is None and callable(fn):
        call = type(fn).__call__
        if getattr(call, "__code__", None) is not None:
            return call
    return fn


def _source_file(fn: Callable[..., Any]) -> str | None:
    code = getattr(_target(fn), "__code__", None)
    return code.co_filename if code is not None else None


def _name(fn: Callable[..., Any]) -> str:
    """``module.qualname``; just the qualname for an app loaded from a file (its module name
    is the loader's, ``_mas_app_<hash>``: the file says where it is)."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    qualname = getattr(target, "__qualname__", None) or type(target).__qualname__
    module = getattr(target, "__module__", None)
    if not module or module.startswith(APP_MODULE_PREFIX) or module == "__main__":
        return qualname
    return f"{module}.{qualname}"


_SUBJECTS = {"reward": "final_state", "role_rewards": "calls", "turn_rewards": "llm_call"}


def check_arity(what: str, fn: Callable[..., Any]) -> None:
    """Every level calls its rewards as ``fn(task, subject, trajectory)``: a function that cannot
    take three positional arguments is refused when the app is decorated, in one line naming it,
    rather than after a whole step of rollouts. `what` is the keyword it was given under
    (`reward`, `role_rewards`, `turn_rewards`)."""
    if not callable(fn):
        raise RewardError(f"{what}: {fn!r} is not callable; give a function (task, {_SUBJECTS[what]}, trajectory) -> float | None")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable without a signature to read: called as it is
        return
    try:
        signature.bind(None, None, None)
    except TypeError as exc:
        raise RewardError(f"{what} {_name(fn)}{_defined_at(fn)} takes {signature}, but is called as "
                          f"fn(task, {_SUBJECTS[what]}, trajectory) ({exc}); give it those three parameters") from None


def _ours(path: str | None) -> bool:
    """A file of mas-trainer itself (a ready-made reward): its module name says enough."""
    return path is not None and os.path.abspath(path).startswith(_PACKAGE + os.sep)


def _definition(fn: Callable[..., Any]) -> str | None:
    """``FILE:LINE`` where a user's reward with Python source is defined."""
    code = getattr(_target(fn), "__code__", None)
    if code is None or _ours(code.co_filename):
        return None
    return f"{_shown(code.co_filename)}:{code.co_firstlineno}"


def _defined_at(fn: Callable[..., Any]) -> str:
    where = _definition(fn)
    return f" (defined at {where})" if where else ""


def _raised_at(fn: Callable[..., Any], exc: BaseException) -> str:
    """`` at FILE:LINE``: the last frame of the traceback inside the reward's own file (the
    user's code, not the library it called), else its last frame, else where it is defined."""
    own = _source_file(fn)
    if _ours(own):
        return ""
    frames = traceback.extract_tb(exc.__traceback__)[1:]  # the first frame is _call's own
    mine = [f for f in frames if f.filename == own]
    if mine or frames:
        frame = (mine or frames)[-1]
        return f" at {_shown(frame.filename)}:{frame.lineno}"
    return _defined_at(fn)


def _one_line(text: str, width: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _call(fn: Callable[..., Any], where: str, *args: Any) -> float | None:
    """Run one reward, turning a raise or a non-number into a RewardError that names it."""
    try:
        value = fn(*args)
    except Exception as exc:  # user code: any exception is reported, with its cause chained
        message = _one_line(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        raise RewardError(f"reward {_name(fn)} raised {message}{_raised_at(fn, exc)} ({where})") from exc
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise RewardError(
            f"reward {_name(fn)}{_defined_at(fn)} returned {_one_line(repr(value), 80)} ({type(value).__name__}); "
            f"expected a number or None ({where})"
        ) from None
    if not math.isfinite(number):
        raise RewardError(f"reward {_name(fn)}{_defined_at(fn)} returned {number}; rewards must be finite ({where})")
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

    @classmethod
    def of(cls, declared: TrainSpec) -> RewardSpec:
        """The rewards an app declared (`trainable(reward=..., role_rewards=..., turn_rewards=...)`)."""
        return cls(declared.reward, declared.role_rewards, declared.turn_rewards)

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


_MESSAGE_TYPES = frozenset({"human", "ai", "system", "tool", "function", "chat", "remove", "AIMessageChunk",
                            "HumanMessageChunk", "SystemMessageChunk", "ToolMessageChunk", "FunctionMessageChunk",
                            "ChatMessageChunk"})


def langgraph_state(state: Any) -> Any:
    """A trajectory's final state as LangGraph returned it, for rewards: the trajectory keeps
    it as JSON (records, resumes, forks), where LangChain messages are their `model_dump`;
    here they are messages again, so a reward reads `state["messages"][-1].content` as it
    would on `graph.invoke(...)`'s result, from a live run and from a record alike. Everything
    else is left as it is."""
    if isinstance(state, list):
        return [langgraph_state(v) for v in state]
    if not isinstance(state, dict):
        return state
    if state.get("type") in _MESSAGE_TYPES and "content" in state and "additional_kwargs" in state:
        from langchain_core.messages import messages_from_dict

        try:
            return messages_from_dict([{"type": state["type"], "data": state}])[0]
        except Exception:  # a dict that only looks like a message: the reward gets it as it is
            return state
    return {k: langgraph_state(v) for k, v in state.items()}


def evaluate_levels(spec: RewardSpec, trajectory: Trajectory) -> LevelValues:
    """Call every applicable reward of ``spec`` once on ``trajectory``.

    Calls are judged in ``trajectory.llm_calls`` order (node-call order: step, branch, then start), which
    allocators such as ``turn_delta`` rely on.
    """
    task, rid = trajectory.task, trajectory.rollout_id
    values = LevelValues()
    if spec.trajectory is not None:
        values.trajectory = _call(spec.trajectory, f"trajectory level, rollout {rid}", task,
                                  langgraph_state(trajectory.final_state), trajectory)
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
