"""Our wrapper gives exactly verl's advantages for the same inputs, grouped by task x role."""

import numpy as np
import pytest
import torch
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos

from pydantic import ValidationError

from mas_trainer.algo import AdvantageConfig, TurnRecord, compute_policy_advantages, tasks_with_spread, turn_records
from mas_trainer.errors import UserError
from mas_trainer.rewards import RewardSpec, assign_rewards
from mas_trainer.trace.schema import LLMCall, Trajectory

# Two tasks x three rollouts; the planner speaks once per rollout, the coder once or twice.
# (turn, rollout, task, role, response length, reward)
ROWS = [
    ("a0", "t0r0", 0, "planner", 3, 1.0), ("a1", "t0r0", 0, "coder", 5, 0.2), ("a2", "t0r0", 0, "coder", 2, 0.9),
    ("b0", "t0r1", 0, "planner", 4, 0.0), ("b1", "t0r1", 0, "coder", 1, 0.4),
    ("c0", "t0r2", 0, "planner", 2, 0.5), ("c1", "t0r2", 0, "coder", 3, -0.3),
    ("d0", "t1r0", 1, "planner", 5, 2.0), ("d1", "t1r0", 1, "coder", 4, 1.0),
    ("e0", "t1r1", 1, "planner", 1, 3.0), ("e1", "t1r1", 1, "coder", 2, 0.0), ("e2", "t1r1", 1, "coder", 3, 0.7),
    ("f0", "t1r2", 1, "planner", 2, 1.5), ("f1", "t1r2", 1, "coder", 6, 0.1),
]
L = 6


def records(policy="shared"):
    return [TurnRecord(t, r, task, role, policy, n, rew) for t, r, task, role, n, rew in ROWS]


def by_hand(rows=ROWS, group=lambda task, role: f"task{task}/{role}"):
    """verl inputs written out independently of the wrapper: string group ids, object array."""
    mask = torch.tensor([[1.0] * n + [0.0] * (L - n) for *_, n, _ in rows])
    rewards = torch.tensor([[0.0] * (n - 1) + [rew] + [0.0] * (L - n) for *_, n, rew in rows])
    index = np.array([group(task, role) for _, _, task, role, _, _ in rows], dtype=object)
    return rewards, mask, index


def values_for(rows=ROWS):
    gen = torch.Generator().manual_seed(0)
    return {t: torch.randn(n, generator=gen) for t, _, _, _, n, _ in rows}


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_equals_verl(norm):
    batch = compute_policy_advantages(records(), AdvantageConfig(estimator="grpo", norm_adv_by_std_in_grpo=norm))
    rewards, mask, index = by_hand()
    adv, ret = core_algos.get_adv_estimator_fn("grpo")(
        token_level_rewards=rewards, response_mask=mask, index=index, norm_adv_by_std_in_grpo=norm
    )
    torch.testing.assert_close(batch.advantages, adv)
    torch.testing.assert_close(batch.returns, ret)
    torch.testing.assert_close(batch.response_mask, mask)
    torch.testing.assert_close(batch.token_level_rewards, rewards)


@pytest.mark.parametrize("name", ["rloo", "reinforce_plus_plus_baseline"])
def test_grouped_estimators_equal_verl(name):
    batch = compute_policy_advantages(records(), AdvantageConfig(estimator=name))
    rewards, mask, index = by_hand()
    adv, ret = core_algos.get_adv_estimator_fn(name)(
        token_level_rewards=rewards, response_mask=mask, index=index, config=AlgoConfig(adv_estimator=name)
    )
    torch.testing.assert_close(batch.advantages, adv)
    torch.testing.assert_close(batch.returns, ret)


def test_reinforce_plus_plus_equals_verl():
    batch = compute_policy_advantages(records(), AdvantageConfig(estimator="reinforce_plus_plus", gamma=0.9))
    rewards, mask, _ = by_hand()
    adv, ret = core_algos.compute_reinforce_plus_plus_outcome_advantage(
        token_level_rewards=rewards, response_mask=mask, config=AlgoConfig(gamma=0.9)
    )
    torch.testing.assert_close(batch.advantages, adv)
    torch.testing.assert_close(batch.returns, ret)


def test_gae_equals_verl():
    values = values_for()
    batch = compute_policy_advantages(records(), AdvantageConfig(estimator="gae", gamma=0.95, lam=0.9), values)
    rewards, mask, _ = by_hand()
    padded = torch.stack([torch.cat([values[t], torch.zeros(L - len(values[t]))]) for t, *_ in ROWS])
    adv, ret = core_algos.compute_gae_advantage_return(rewards, padded, mask, gamma=0.95, lam=0.9)
    torch.testing.assert_close(batch.advantages, adv)
    torch.testing.assert_close(batch.returns, ret)
    per_turn = batch.per_turn()
    assert per_turn["a1"].advantages.shape == (5,) and per_turn["a1"].weight == 1.0
    torch.testing.assert_close(per_turn["a1"].returns, ret[1, :5])


def test_gae_needs_values_for_every_turn():
    with pytest.raises(UserError, match="needs critic values"):
        compute_policy_advantages(records(), AdvantageConfig(estimator="gae"))
    values = values_for()
    del values["b1"]
    with pytest.raises(UserError, match="no critic values for turn b1"):
        compute_policy_advantages(records(), AdvantageConfig(estimator="gae"), values)


def test_groups_are_task_by_role():
    batch = compute_policy_advantages(records(), AdvantageConfig(estimator="grpo"))
    assert batch.groups == [(0, "planner"), (0, "coder"), (1, "planner"), (1, "coder")]
    assert batch.index.tolist() == [0, 1, 1, 0, 1, 0, 1, 2, 3, 2, 3, 3, 2, 3]
    # The task-0 planners, computed alone, give the same advantages: nobody else is in their group.
    planners = [i for i, row in enumerate(ROWS) if row[2] == 0 and row[3] == "planner"]
    rewards, mask, index = by_hand([ROWS[i] for i in planners])
    alone, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, index)
    torch.testing.assert_close(batch.advantages[planners], alone)
    # Grouping by task only (planners compared with coders) would give something else.
    rewards, mask, index = by_hand(group=lambda task, role: task)
    by_task, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, index)
    assert not torch.allclose(batch.advantages[planners], by_task[planners])


def test_rollout_norm_weights_each_rollout_equally():
    plain = compute_policy_advantages(records(), AdvantageConfig(estimator="rloo"))
    normed = compute_policy_advantages(records(), AdvantageConfig(estimator="rloo", rollout_norm=True))
    # 14 turns in 6 rollouts: a rollout with k turns has weight (14 / 6) / k on each.
    k = {"t0r0": 3, "t0r1": 2, "t0r2": 2, "t1r0": 2, "t1r1": 3, "t1r2": 2}
    expected = torch.tensor([(14 / 6) / k[r] for _, r, *_ in ROWS])
    torch.testing.assert_close(normed.turn_weights, expected)
    torch.testing.assert_close(normed.advantages, plain.advantages * expected[:, None])
    torch.testing.assert_close(normed.returns, plain.returns)
    assert normed.turn_weights.mean().item() == pytest.approx(1.0)
    per_rollout = {r: 0.0 for r in k}
    for (_, r, *_), w in zip(ROWS, normed.turn_weights.tolist()):
        per_rollout[r] += w
    assert all(v == pytest.approx(14 / 6) for v in per_rollout.values())


def test_a_policy_is_padded_to_its_own_longest_turn():
    batch = compute_policy_advantages(records("planner_model")[:7], AdvantageConfig(estimator="grpo"))
    assert batch.policy == "planner_model" and batch.turn_ids == [r[0] for r in ROWS[:7]]
    rewards, mask, index = by_hand(ROWS[:7])
    adv, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, index)
    torch.testing.assert_close(batch.advantages, adv[:, :5])  # longest of these turns is 5


def test_estimator_is_checked_when_the_config_is_built():
    with pytest.raises(ValidationError, match="'remax' is not usable here; choose one of .*grpo"):
        AdvantageConfig(estimator="remax")
    with pytest.raises(ValidationError, match="'nope'"):
        AdvantageConfig(estimator="nope")
    assert AdvantageConfig(estimator="rloo_vectorized").estimator == "rloo_vectorized"  # any other verl estimator


def test_bad_inputs():
    with pytest.raises(ValueError, match="several policies"):
        compute_policy_advantages(records("a")[:2] + records("b")[2:])
    with pytest.raises(ValueError, match="response_length 0"):
        TurnRecord("x", "r", 0, "planner", "p", 0, 1.0)
    with pytest.raises(ValueError, match="extra"):
        AdvantageConfig(estimator="grpo", clip=0.2)


def _traj(rid, task, status="ok"):
    def call(cid, role, trainable=True, n=2):
        return LLMCall(id=cid, node_id=None, node=role, role=role, policy="p", trainable=trainable, messages=[],
                       output_text="", prompt_ids=[1], response_ids=[7] * n, response_logprobs=[0.0] * n,
                       finish_reason="stop")

    calls = [call(f"{rid}-p", "planner"), call(f"{rid}-j", "judge", trainable=False), call(f"{rid}-e", "coder", n=0)]
    return Trajectory(rollout_id=rid, task=task, status=status, llm_calls=calls, final_state={})


def test_turn_records_from_rewarded_trajectories():
    spec = RewardSpec(trajectory=lambda task, state, t: float(task["q"]))
    trajs = [assign_rewards(_traj("r0", {"q": 1}), spec), assign_rewards(_traj("r1", {"q": 1}), spec),
             assign_rewards(_traj("r2", {"q": 2}, status="error"), spec, on_failure="drop")]
    recs = turn_records(trajs)
    # frozen judge, empty response and the dropped rollout are left out; same task -> same key
    assert [r.turn_id for r in recs] == ["r0-p", "r1-p"]
    assert recs[0].task_index == recs[1].task_index and recs[0].reward == 1.0 and recs[0].response_length == 2
    assert [r.task_index for r in turn_records(trajs, task_indices=[5, 6, 7])] == [5, 6]
    with pytest.raises(UserError, match="has no reward"):
        turn_records([_traj("r9", {"q": 1})])


def test_tasks_with_spread_are_the_groups_grpo_gives_an_advantage():
    """Dynamic sampling's filter agrees with verl's GRPO: a task is kept exactly when some turn
    of it gets a non-zero advantage (a lone sample is scored against 0, and kept, as verl's DAPO
    keeps it)."""
    rows = [  # task 0: every role flat; 1: the coder differs; 2: one sample only; 3: the planner differs
        ("a", "0r0", 0, "planner", 0.5), ("b", "0r0", 0, "coder", 1.0), ("c", "0r1", 0, "planner", 0.5), ("d", "0r1", 0, "coder", 1.0),
        ("e", "1r0", 1, "planner", 0.5), ("f", "1r0", 1, "coder", 1.0), ("g", "1r1", 1, "planner", 0.5), ("h", "1r1", 1, "coder", 0.0),
        ("i", "2r0", 2, "planner", 0.9),
        ("j", "3r0", 3, "planner", 0.2), ("k", "3r1", 3, "planner", 0.7),
    ]
    recs = [TurnRecord(t, r, task, role, "p", 2, rew) for t, r, task, role, rew in rows]
    assert tasks_with_spread(recs) == {1, 2, 3}
    per_turn = compute_policy_advantages(recs, AdvantageConfig(estimator="grpo")).per_turn()
    moved = {r.task_index for r in recs if per_turn[r.turn_id].advantages.abs().sum() > 0}
    assert moved == tasks_with_spread(recs)
