"""Advantages per policy with verl's estimators, grouped by task x role.

The worker group of a policy holds the fat tensors of its turns; what it needs here is
the thin record of each turn (:class:`TurnRecord`: ids, response length, allocated reward).
From those it builds verl's token-level inputs, one row per turn:

- ``response_mask``: 1 on the turn's response tokens, right-padded with 0;
- ``token_level_rewards``: the turn's scalar reward on its last response token, 0 elsewhere
  (verl's outcome estimators sum a row, so this is the usual outcome-reward layout);
- ``index``: the row's group: all turns of one role in the n rollouts of one task. A
  planner is compared with planners of the same task, never with the coder next to it.

and calls ``verl.trainer.ppo.core_algos.get_adv_estimator_fn(name)`` with the arguments
that estimator takes (as verl's own ``ray_trainer.compute_advantage`` passes them).
Each turn is one row, so REINFORCE++ and GAE see a turn as an episode that ends with its
reward; GAE bootstraps from the critic's ``values`` for that turn's tokens.

verl is imported on first use (it costs seconds), never at module import.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mas_trainer.algo.config import AdvantageConfig
from mas_trainer.errors import UserError
from mas_trainer.trace.schema import Trajectory

__all__ = ["TurnRecord", "TurnAdvantage", "AdvantageBatch", "turn_records", "tasks_with_spread", "compute_policy_advantages"]


@dataclass(frozen=True)
class TurnRecord:
    """The thin record of one trainable turn, as the controller sends it to a worker group."""

    turn_id: str
    rollout_id: str
    task_index: Hashable  # equal for the n rollouts of one task
    role: str
    policy: str
    response_length: int
    reward: float

    def __post_init__(self) -> None:
        if self.response_length < 1:
            raise ValueError(f"turn {self.turn_id}: response_length {self.response_length}, need >= 1")


@dataclass
class TurnAdvantage:
    advantages: torch.Tensor  # (response_length,)
    returns: torch.Tensor  # (response_length,)
    weight: float  # rollout-norm factor already applied to advantages (1.0 without it)


@dataclass
class AdvantageBatch:
    """One policy's turns as verl sees them; row i is ``turn_ids[i]``.

    Shapes: bs = number of turns, L = longest response in the batch.
    ``response_mask``, ``token_level_rewards``, ``advantages``, ``returns``: (bs, L) float32;
    ``index``: (bs,) int64 group number; ``groups[index[i]]`` is its (task_index, role);
    ``turn_weights``: (bs,) the rollout-norm factor (ones without it).
    """

    policy: str
    estimator: str
    turn_ids: list[str]
    groups: list[tuple[Hashable, str]]
    index: np.ndarray
    response_mask: torch.Tensor
    token_level_rewards: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    turn_weights: torch.Tensor

    def per_turn(self) -> dict[str, TurnAdvantage]:
        """Unpadded advantages and returns of each turn, keyed by turn id."""
        lengths = self.response_mask.sum(dim=-1).long().tolist()
        return {
            tid: TurnAdvantage(self.advantages[i, :n].clone(), self.returns[i, :n].clone(), float(self.turn_weights[i]))
            for i, (tid, n) in enumerate(zip(self.turn_ids, lengths, strict=True))
        }


def turn_records(
    trajectories: Sequence[Trajectory], task_indices: Sequence[Hashable] | None = None
) -> list[TurnRecord]:
    """Thin records of the trainable, rewarded turns of ``trajectories``.

    ``task_indices[i]`` names the task of ``trajectories[i]``; by default the task itself
    (its JSON) is the key, so identical tasks share a group. Rollouts dropped by the reward
    stage and frozen calls are left out, as are calls with no response tokens (nothing to
    train; the engine produced no ids). A kept call without an allocated reward is an error.
    """
    if task_indices is not None and len(task_indices) != len(trajectories):
        raise ValueError(f"{len(task_indices)} task indices for {len(trajectories)} trajectories")
    out: list[TurnRecord] = []
    for i, traj in enumerate(trajectories):
        if traj.rewards.detail.get("dropped"):
            continue
        task = task_indices[i] if task_indices is not None else json.dumps(traj.task, sort_keys=True, default=str)
        for call in traj.llm_calls:
            if not call.trainable or not call.response_ids:
                continue
            if call.id not in traj.rewards.turns:
                raise UserError(
                    f"llm call {call.id} of rollout {traj.rollout_id} has no reward; run assign_rewards first"
                )
            out.append(
                TurnRecord(call.id, traj.rollout_id, task, call.role, call.policy, len(call.response_ids),
                           traj.rewards.turns[call.id])
            )
    return out


def tasks_with_spread(records: Sequence[TurnRecord]) -> set[Hashable]:
    """Task keys whose turns of some role got different rewards, or whose role has a single
    turn: the groups that a group baseline can give a non-zero advantage (verl's GRPO scores a
    lone turn against 0). Dynamic sampling keeps only these, by verl's DAPO rule (std > 0 or
    one sample)."""
    rewards: dict[tuple[Hashable, str], list[float]] = {}
    for r in records:
        rewards.setdefault((r.task_index, r.role), []).append(r.reward)
    return {task for (task, _), values in rewards.items() if len(values) == 1 or len(set(values)) > 1}


def _rollout_weights(records: Sequence[TurnRecord]) -> torch.Tensor:
    per_rollout = Counter(r.rollout_id for r in records)
    scale = len(records) / len(per_rollout)
    return torch.tensor([scale / per_rollout[r.rollout_id] for r in records], dtype=torch.float32)


def _call_verl(name: str, cfg: AdvantageConfig, rewards: torch.Tensor, mask: torch.Tensor, index: np.ndarray,
               values: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    fn = get_adv_estimator_fn(name)
    if name == "gae":
        return fn(token_level_rewards=rewards, values=values, response_mask=mask, gamma=cfg.gamma, lam=cfg.lam)
    algo = AlgoConfig(gamma=cfg.gamma, lam=cfg.lam, adv_estimator=name,
                      norm_adv_by_std_in_grpo=cfg.norm_adv_by_std_in_grpo)
    kwargs: dict[str, Any] = {"token_level_rewards": rewards, "response_mask": mask, "index": index, "config": algo}
    if name in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        kwargs["epsilon"] = cfg.epsilon
    if name == "grpo":
        kwargs["norm_adv_by_std_in_grpo"] = cfg.norm_adv_by_std_in_grpo
    return fn(**kwargs)


def compute_policy_advantages(
    records: Sequence[TurnRecord],
    config: AdvantageConfig | None = None,
    values: Mapping[str, Sequence[float] | torch.Tensor] | None = None,
) -> AdvantageBatch:
    """Advantages of one policy's turns with ``config.estimator`` from verl.

    Args:
        records: the policy's turns, any order (rows keep it); all with one ``policy``.
        config: estimator and its parameters.
        values: for ``gae`` only: turn id -> critic values of its response tokens, (response_length,).

    Rollout normalisation (``config.rollout_norm``): a rollout in which this policy made
    k turns would otherwise weigh k times as much in the loss as a rollout with one turn.
    Each turn's advantages (not its returns, which are the critic's targets) are multiplied
    by w = (T / R) / k, T = turns and R = distinct rollouts in ``records``: the turns of
    every rollout then weigh the same in total, and the mean weight stays 1 so the loss
    scale (and the effective learning rate) does not change. Scaling the advantage of a
    turn by w > 0 scales its PPO-clip term by exactly w. It does not undo the length
    weighting of a ``token-mean`` loss, which counts tokens, not turns.

    Returns:
        :class:`AdvantageBatch` with (bs, L) tensors; ``per_turn()`` for each turn's slice.
    """
    cfg = config or AdvantageConfig()
    if not records:
        raise ValueError("no turns to compute advantages for")
    policies = {r.policy for r in records}
    if len(policies) > 1:
        raise ValueError(f"compute_policy_advantages got turns of several policies: {sorted(policies)}")
    name = cfg.estimator  # usable: AdvantageConfig checked it (check_estimator)
    bs, length = len(records), max(r.response_length for r in records)
    mask = torch.zeros(bs, length, dtype=torch.float32)
    rewards = torch.zeros(bs, length, dtype=torch.float32)
    group_of: dict[tuple[Hashable, str], int] = {}
    index = np.empty(bs, dtype=np.int64)
    for i, r in enumerate(records):
        mask[i, : r.response_length] = 1.0
        rewards[i, r.response_length - 1] = float(r.reward)
        index[i] = group_of.setdefault((r.task_index, r.role), len(group_of))

    value_tensor = None
    if name == "gae":
        value_tensor = _values(records, values, length)

    advantages, returns = _call_verl(name, cfg, rewards, mask, index, value_tensor)
    weights = _rollout_weights(records) if cfg.rollout_norm else torch.ones(bs, dtype=torch.float32)
    if cfg.rollout_norm:
        advantages = advantages * weights.unsqueeze(-1)
    return AdvantageBatch(
        policy=next(iter(policies)), estimator=name, turn_ids=[r.turn_id for r in records],
        groups=list(group_of), index=index, response_mask=mask, token_level_rewards=rewards,
        advantages=advantages, returns=returns, turn_weights=weights,
    )


def _values(records: Sequence[TurnRecord], values: Mapping[str, Any] | None, length: int) -> torch.Tensor:
    """Critic values padded to (bs, L); GAE cannot run without them."""
    if values is None:
        raise UserError("estimator 'gae' needs critic values for every turn (values={turn_id: per-token values})")
    out = torch.zeros(len(records), length, dtype=torch.float32)
    for i, r in enumerate(records):
        if r.turn_id not in values:
            raise UserError(f"estimator 'gae': no critic values for turn {r.turn_id}")
        v = torch.as_tensor(values[r.turn_id], dtype=torch.float32).reshape(-1)
        if v.numel() != r.response_length:
            raise ValueError(f"turn {r.turn_id}: {v.numel()} values for {r.response_length} response tokens")
        out[i, : r.response_length] = v
    return out
