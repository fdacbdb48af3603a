"""Allocators: one scalar per LLM call, the audit record, failures, and user allocators."""

import json
import subprocess
import sys

import pytest

from mas_trainer.errors import UserError
from mas_trainer.rewards import (
    Allocation,
    LevelWeights,
    RewardSpec,
    allocator_names,
    assign_rewards,
    check_allocator,
    get_allocator,
    is_dropped,
    register_allocator,
)
from mas_trainer.rewards.allocators import needs_forks, rollout_reward
from mas_trainer.trace.schema import LLMCall, Trajectory


def call(cid, role):
    return LLMCall(id=cid, node_id=None, node=role, role=role, policy="p", messages=[], output_text="",
                   prompt_ids=[1], response_ids=[5, 6], response_logprobs=[0.0, 0.0], finish_reason="stop")


def traj(roles, status="ok"):
    calls = [call(f"c{i}", role) for i, role in enumerate(roles)]
    return Trajectory(rollout_id="r", task={"q": 1}, status=status, llm_calls=calls, final_state={"ok": True},
                      error="boom" if status != "ok" else None)


SCORES = {"c0": 0.0, "c1": 0.5, "c2": None, "c3": 1.0}  # per-turn running score, e.g. tests passed


def spec():
    return RewardSpec(
        trajectory=lambda task, state, t: 1.0,
        roles={"planner": lambda task, calls, t: 0.5},
        turns=lambda task, c, t: SCORES[c.id],
    )


def test_builtins_are_registered():
    assert {"broadcast", "turn_delta"} <= set(allocator_names())
    with pytest.raises(UserError, match="unknown reward allocator 'nope'; known: .*broadcast"):
        get_allocator("nope")


def test_broadcast_adds_levels_with_weights_and_records_why():
    t = assign_rewards(traj(["planner", "coder", "coder", "planner"]), spec(),
                       weights={"trajectory": 2.0, "role": 1.0, "turn": 0.5})
    r = t.rewards
    assert r.trajectory == 1.0 and r.roles == {"planner": 0.5}
    assert r.turns == {"c0": 2.5 + 0.0, "c1": 2.0 + 0.25, "c2": 2.0, "c3": 2.5 + 0.5}
    d = r.detail
    assert d["allocator"] == "broadcast" and d["weights"] == {"trajectory": 2.0, "role": 1.0, "turn": 0.5}
    assert d["calls"]["c0"]["parts"] == {
        "trajectory": {"value": 1.0, "weight": 2.0, "contribution": 2.0},
        "role": {"value": 0.5, "weight": 1.0, "contribution": 0.5},
        "turn": {"value": 0.0, "weight": 0.5, "contribution": 0.0},
    }
    assert set(d["calls"]["c2"]["parts"]) == {"trajectory"}  # coder: no role reward, turn said None
    assert d["not_applicable"] == {"trajectory": False, "roles": [], "turns": ["c2"]}
    json.loads(t.to_json())  # the audit record is written with the trajectory


def test_turn_delta_credits_improvement_in_call_order():
    t = assign_rewards(traj(["planner", "coder", "coder", "coder"]), spec(), allocator="turn_delta",
                       weights=LevelWeights(trajectory=0.0, role=0.0))
    # scores 0.0, 0.5, None, 1.0 -> deltas 0.0, 0.5, (none), 0.5 ; None does not move the score
    assert t.rewards.turns == {"c0": 0.0, "c1": 0.5, "c2": 0.0, "c3": 0.5}
    turn = t.rewards.detail["calls"]["c3"]["parts"]["turn"]
    assert turn == {"value": 0.5, "weight": 1.0, "contribution": 0.5, "score": 1.0, "previous": 0.5}
    assert sum(t.rewards.turns.values()) == 1.0  # telescopes to the last score


def test_turn_delta_per_role_and_initial():
    t = assign_rewards(traj(["planner", "coder", "coder", "planner"]), spec(), allocator="turn_delta",
                       weights={"trajectory": 0.0, "role": 0.0}, options={"per_role": True, "initial": 0.25})
    # planner: 0.0 - 0.25, then 1.0 - 0.0 ; coder: 0.5 - 0.25
    assert t.rewards.turns == {"c0": -0.25, "c1": 0.25, "c2": 0.0, "c3": 1.0}
    assert t.rewards.detail["options"] == {"per_role": True, "initial": 0.25}


def test_failed_rollout_gets_fill_without_calling_rewards():
    def never(*a):
        raise AssertionError("rewards must not run on a failed rollout")

    t = assign_rewards(traj(["planner", "coder"], status="timeout"), RewardSpec(trajectory=never), on_failure=-1.0)
    assert t.rewards.turns == {"c0": -1.0, "c1": -1.0} and t.rewards.trajectory is None
    assert t.rewards.detail["failed"] == {"status": "timeout", "error": "boom", "fill": -1.0}
    assert not is_dropped(t)


def test_failed_rollout_can_be_dropped():
    t = assign_rewards(traj(["planner"], status="error"), spec(), on_failure="drop")
    assert is_dropped(t) and t.rewards.turns == {}
    assert not is_dropped(assign_rewards(traj(["planner"]), spec()))
    with pytest.raises(UserError, match="on_failure"):
        assign_rewards(traj(["planner"], status="error"), spec(), on_failure="zero")


def test_user_allocator_by_name_and_as_callable():
    @register_allocator("test_last_call_only")
    def last_only(trajectory, values, weights):
        last = trajectory.llm_calls[-1].id
        return {c.id: (values.trajectory if c.id == last else 0.0) for c in trajectory.llm_calls}

    t = assign_rewards(traj(["planner", "coder"]), spec(), allocator="test_last_call_only")
    assert t.rewards.turns == {"c0": 0.0, "c1": 1.0} and t.rewards.detail["allocator"] == "test_last_call_only"

    def halves(trajectory, values, weights, *, scale):
        return {c.id: Allocation(scale, {"custom": {"value": scale}}) for c in trajectory.llm_calls}

    t = assign_rewards(traj(["planner"]), spec(), allocator=halves, options={"scale": 0.5})
    assert t.rewards.turns == {"c0": 0.5}
    assert t.rewards.detail["allocator"].endswith("halves")
    assert t.rewards.detail["calls"]["c0"]["parts"] == {"custom": {"value": 0.5}}

    with pytest.raises(ValueError, match="already registered"):
        register_allocator("broadcast")(halves)
    with pytest.raises(UserError, match="gave no reward to llm call c1"):
        assign_rewards(traj(["planner", "coder"]), spec(), allocator=lambda t, v, w: {"c0": 1.0})


def test_an_allocator_declares_whether_it_needs_forks():
    assert needs_forks("counterfactual") and not needs_forks("broadcast") and not needs_forks("nope")


def test_a_rollouts_reward_is_its_trajectory_reward_else_the_mean_call_reward_and_none_when_dropped():
    assert rollout_reward(0.25, [1.0, 0.0]) == 0.25
    assert rollout_reward(None, [1.0, 0.0, 0.5]) == pytest.approx(0.5)
    assert rollout_reward(None, []) is None and rollout_reward(1.0, [1.0], dropped=True) is None


def test_check_allocator_names_valid_names_and_options():
    check_allocator("turn_delta", {"initial": 0.5, "per_role": True})
    with pytest.raises(UserError, match="unknown reward allocator 'turn_detla'; known: broadcast, .*turn_delta"):
        check_allocator("turn_detla")
    with pytest.raises(UserError, match="'turn_delta' has no option 'intial'; valid: initial, per_role"):
        check_allocator("turn_delta", {"intial": 0.5})
    with pytest.raises(UserError, match="'broadcast' has no option 'initial'; valid: none"):
        check_allocator("broadcast", {"initial": 0.5})

    @register_allocator("test_any_options")
    def anything(trajectory, values, weights, **options):
        return {}

    check_allocator("test_any_options", {"whatever": 1})  # **options: the allocator checks them itself


def test_unknown_weight_is_an_error():
    with pytest.raises(ValueError, match="tool"):
        assign_rewards(traj(["planner"]), spec(), weights={"tool": 1.0})


def test_rewards_modules_do_not_import_torch():
    code = "import sys, mas_trainer.rewards; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
