"""Reward levels: each callable gets the right arguments, None means not applicable,
and a failing reward is reported by name."""

import pytest

from mas_trainer.errors import UserError
from mas_trainer.rewards import LevelValues, RewardError, RewardSpec, evaluate_levels
from mas_trainer.trace.schema import LLMCall, Trajectory


def call(cid, role, text="x", n=2):
    return LLMCall(id=cid, node_id=None, node=role, role=role, policy="p", messages=[], output_text=text,
                   prompt_ids=[1], response_ids=list(range(n)), response_logprobs=[0.0] * n, finish_reason="stop")


def traj(calls, status="ok", final_state=None):
    return Trajectory(rollout_id="r1", task={"answer": 4}, status=status, llm_calls=calls,
                      final_state=final_state if final_state is not None else {"answer": 4})


def test_each_level_gets_task_subject_and_trajectory():
    t = traj([call("a", "planner", "PLAN: go"), call("b", "coder"), call("c", "planner", "no plan")])
    seen = {}

    def exact(task, state, trajectory):
        seen["traj"] = (task, state, trajectory.rollout_id)
        return float(state["answer"] == task["answer"])

    def plan_format(task, calls, trajectory):
        seen.setdefault("roles", []).append([c.id for c in calls])
        return sum(c.output_text.startswith("PLAN:") for c in calls) / len(calls)

    def length(task, c, trajectory):
        return len(c.response_ids)

    values = evaluate_levels(RewardSpec(trajectory=exact, roles={"planner": plan_format}, turns=length), t)
    assert values == LevelValues(trajectory=1.0, roles={"planner": 0.5}, turns={"a": 2.0, "b": 2.0, "c": 2.0})
    assert seen["traj"] == ({"answer": 4}, {"answer": 4}, "r1")
    assert seen["roles"] == [["a", "c"]]  # only the planner's calls, in order


def test_one_callable_for_every_role_and_turn_mapping_by_role():
    t = traj([call("a", "planner"), call("b", "coder")])
    values = evaluate_levels(
        RewardSpec(roles=lambda task, calls, tr: len(calls), turns={"coder": lambda task, c, tr: 1}), t
    )
    assert values.trajectory is None
    assert values.roles == {"planner": 1.0, "coder": 1.0}
    assert values.turns == {"b": 1.0}  # the planner has no turn reward at all


def test_none_means_not_applicable():
    t = traj([call("a", "planner"), call("b", "coder")])
    values = evaluate_levels(
        RewardSpec(trajectory=lambda *a: None, roles=lambda task, calls, tr: None,
                   turns=lambda task, c, tr: None if c.role == "planner" else 0.0), t
    )
    assert values.trajectory is None
    assert values.roles == {"planner": None, "coder": None}
    assert values.turns == {"a": None, "b": 0.0}


def test_numpy_like_and_bool_values_are_floats():
    class Number:
        def __float__(self):
            return 0.25

    t = traj([call("a", "planner")])
    values = evaluate_levels(RewardSpec(trajectory=lambda *a: True, turns=lambda *a: Number()), t)
    assert values.trajectory == 1.0 and values.turns == {"a": 0.25}


def broken_reward(task, state, trajectory):
    return state["missing"]


def test_raising_reward_names_the_function_and_where():
    with pytest.raises(RewardError) as err:
        evaluate_levels(RewardSpec(trajectory=broken_reward), traj([call("a", "planner")]))
    msg = str(err.value)
    assert "test_levels.broken_reward" in msg and "KeyError" in msg and "trajectory level" in msg and "r1" in msg
    assert isinstance(err.value.__cause__, KeyError)
    assert isinstance(err.value, UserError)


def test_raising_turn_reward_names_the_call():
    def per_turn(task, c, trajectory):
        raise RuntimeError("boom")

    with pytest.raises(RewardError, match=r"per_turn raised RuntimeError: boom .*llm call b of role 'coder'"):
        evaluate_levels(RewardSpec(turns={"coder": per_turn}), traj([call("a", "planner"), call("b", "coder")]))


@pytest.mark.parametrize("bad", ["1.0x", [1.0], float("nan"), float("inf")])
def test_non_numbers_are_errors(bad):
    with pytest.raises(RewardError, match="<lambda>"):
        evaluate_levels(RewardSpec(trajectory=lambda *a: bad), traj([call("a", "planner")]))


def test_spec_rejects_non_callables():
    with pytest.raises(UserError, match="role reward for role 'planner'"):
        RewardSpec(roles={"planner": 1.0})
    with pytest.raises(UserError, match="trajectory reward"):
        RewardSpec(trajectory="exact_match")
    with pytest.raises(UserError, match="turn rewards must be"):
        RewardSpec(turns=3)

