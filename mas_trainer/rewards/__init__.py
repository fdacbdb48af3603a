"""Rewards at trajectory, role and turn level, and allocators that make one scalar per LLM call.

Pure Python (no torch): the controller evaluates rewards and sends only scalars onward.
"""

from mas_trainer.rewards.allocators import (
    Allocation,
    Allocator,
    LevelWeights,
    allocator_names,
    assign_rewards,
    broadcast,
    check_allocator,
    get_allocator,
    is_dropped,
    register_allocator,
    turn_delta,
)
from mas_trainer.rewards.levels import (
    LevelValues,
    RewardError,
    RewardSpec,
    RoleReward,
    TrajectoryReward,
    TurnReward,
    evaluate_levels,
)

__all__ = [
    "Allocation",
    "Allocator",
    "LevelValues",
    "LevelWeights",
    "RewardError",
    "RewardSpec",
    "RoleReward",
    "TrajectoryReward",
    "TurnReward",
    "allocator_names",
    "assign_rewards",
    "broadcast",
    "check_allocator",
    "evaluate_levels",
    "get_allocator",
    "is_dropped",
    "register_allocator",
    "turn_delta",
]
