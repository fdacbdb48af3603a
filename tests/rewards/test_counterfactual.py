"""The counterfactual credit estimator as pure functions (rewards/counterfactual.py): which
checkpoints a rollout needs, K under a budget, the credit and its audit trail."""

import pytest

from mas_trainer.rewards import RewardSpec, assign_rewards
from mas_trainer.rewards.counterfactual import (
    credit_segments,
    fork_steps,
    forks_per_point,
    mean_return,
    segment_credit,
)
from mas_trainer.trace.schema import ForkSegment, Forks, LLMCall, NodeCall, Trajectory


def _seg(role, before, after, calls):
    return ForkSegment(role=role, before=before, after=after, calls=list(calls))


def _call(cid, node_id, role, trainable=True):
    return LLMCall(id=cid, node_id=node_id, node=None, role=role, policy="p", trainable=trainable, messages=[],
                   output_text="x", prompt_ids=[1], response_ids=[2], response_logprobs=[-0.1], finish_reason="stop")


def _traj():
    """plan (step 1), plan again (step 2), a subgraph node `team` (step 3) holding the coder's
    call, a frozen reviewer (step 4)."""
    nodes = [NodeCall(id="n1", name="plan", step=1, parent_id=None, status="ok"),
             NodeCall(id="n2", name="plan", step=2, parent_id=None, status="ok"),
             NodeCall(id="n3", name="team", step=3, parent_id=None, status="ok"),
             NodeCall(id="n3a", name="team:code", step=1, parent_id="n3", status="ok"),
             NodeCall(id="n4", name="review", step=4, parent_id=None, status="ok")]
    calls = [_call("c1", "n1", "planner"), _call("c2", "n2", "planner"), _call("c3", "n3a", "coder"),
             _call("c4", "n4", "reviewer", trainable=False), _call("c5", None, "planner")]
    return Trajectory(rollout_id="r", task={}, status="ok", nodes=nodes, llm_calls=calls)


def test_segments_are_placed_at_the_top_level_step_and_skip_what_cannot_be_placed():
    segments, skipped = credit_segments(_traj())
    assert segments == [_seg("planner", 0, 1, ("c1",)), _seg("planner", 1, 2, ("c2",)),
                        _seg("coder", 2, 3, ("c3",))]  # the coder's subgraph step 1 is its parent's step 3
    assert set(skipped) == {"c5"} and "superstep" in skipped["c5"]  # the frozen c4 is not credited at all
    assert fork_steps(segments) == [0, 1, 2, 3]


def test_boundaries_only_merges_a_roles_consecutive_steps_and_roles_filter():
    segments, _ = credit_segments(_traj(), boundaries_only=True)
    assert segments == [_seg("planner", 0, 2, ("c1", "c2")), _seg("coder", 2, 3, ("c3",))]
    assert fork_steps(segments) == [0, 2, 3]
    only, _ = credit_segments(_traj(), roles=["coder"])
    assert only == [_seg("coder", 2, 3, ("c3",))]


def test_k_shrinks_to_the_budget_but_never_below_one():
    assert forks_per_point(10, 4, None) == 4
    assert forks_per_point(10, 4, 25) == 2
    assert forks_per_point(10, 4, 3) == 1
    assert forks_per_point(0, 4, 3) == 4


def test_credit_is_the_change_in_mean_return():
    assert mean_return([1.0, 0.0, None, 0.5]) == pytest.approx(0.5)
    assert mean_return([None]) is None
    seg = _seg("planner", 0, 1, ("c1",))
    assert segment_credit(seg, {0: 0.25, 1: 1.0}) == pytest.approx(0.75)
    assert segment_credit(seg, {0: 0.25, 1: None}) is None


def test_allocator_writes_credit_with_its_audit_trail_and_broadcasts_the_rest():
    t = _traj()
    t.forks = Forks.model_validate(  # as JSON writes it: steps are strings
        {"k": 2, "segments": [{"role": "planner", "before": 0, "after": 1, "calls": ["c1"]},
                              {"role": "coder", "before": 2, "after": 3, "calls": ["c3"]}],
         "values": {"0": {"value": 0.5}, "1": {"value": 0.75}, "2": {"value": 0.5}, "3": {"value": None}},
         "skipped": {"c5": "its node's superstep is unknown"}})
    spec = RewardSpec(lambda task, state, traj: 1.0)
    assign_rewards(t, spec, allocator="counterfactual")
    calls = t.rewards.detail["calls"]
    assert t.rewards.turns["c1"] == pytest.approx(0.25)
    assert calls["c1"]["parts"] == {"counterfactual": {"value": 0.25, "weight": 1.0, "contribution": 0.25, "before": 0.5,
                                                       "after": 0.75, "steps": [0, 1], "k": 2}}
    # no estimate after the coder (every continuation failed and was dropped): broadcast, and why
    assert t.rewards.turns["c3"] == 1.0 and "no value estimate" in calls["c3"]["parts"]["counterfactual"]["skipped"]
    assert t.rewards.turns["c2"] == 1.0 and t.rewards.turns["c4"] == 1.0  # not in a segment: broadcast
    assert calls["c5"]["parts"]["counterfactual"] == {"skipped": "its node's superstep is unknown"}


def test_a_rollout_that_was_not_forked_gets_broadcast_rewards_and_says_so():
    t = _traj()
    assign_rewards(t, RewardSpec(lambda task, state, traj: 0.5), allocator="counterfactual")
    assert set(t.rewards.turns.values()) == {0.5}
    assert "not forked" in t.rewards.detail["calls"]["c1"]["parts"]["counterfactual"]["skipped"]


def test_k_is_bounded_with_what_each_fork_costs():
    """k=1000000 once grew a run to 5.9 GB in 4 minutes building its continuations: refused when
    the config loads, in one line naming the cost, the bound itself still allowed."""
    from mas_trainer.config import ConfigError, load_config
    from mas_trainer.rewards.config import CounterfactualConfig

    with pytest.raises(ConfigError, match=r"^config key 'reward.counterfactual.k': 1000000 is over the bound of 256 "
                       r"\(K forks per credited turn: each is a full continuation of the app .*\); use at most 256") as err:
        load_config(overrides=["reward.allocator=counterfactual", "reward.counterfactual.k=1000000"])
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="over the bound"):
        CounterfactualConfig(k=257)  # built in Python too, not only from a config file
    assert load_config(overrides=["reward.counterfactual.k=256"]).reward.counterfactual.k == 256
