"""Rewards at trajectory, role and turn level, and allocators that make one scalar per LLM call.

Pure Python (no torch): the controller evaluates rewards and sends only scalars onward.
Ready-made rewards are in ``library`` (exact match, F1, valid JSON, code tests) and
``judge`` (an LLM judge that scores each group of rollouts relative to each other).
Importing this package is cheap: each name loads its module on first use, except the
``counterfactual`` allocator, which is imported here so that ``allocator=counterfactual``
is registered wherever the allocators are (the config checks the name).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mas_trainer._lazy import lazy_exports
from mas_trainer.rewards import counterfactual as _counterfactual  # noqa: F401  (registers allocator=counterfactual)

if TYPE_CHECKING:  # pragma: no cover
    from mas_trainer.rewards.allocators import (Allocation, Allocator, LevelWeights, allocator_names, assign_rewards, broadcast,
                                                check_allocator, get_allocator, is_dropped, register_allocator, turn_delta)
    from mas_trainer.rewards.counterfactual import COUNTERFACTUAL, CounterfactualConfig
    from mas_trainer.rewards.judge import (JudgeError, JudgeUsage, LLMJudge, Verdict, annotate_groups, render_trajectory,
                                           score_groups)
    from mas_trainer.rewards.levels import (LevelValues, RewardError, RewardSpec, RoleReward, TrajectoryReward, TurnReward,
                                            evaluate_levels)
    from mas_trainer.rewards.library import code_tests, exact_match, f1, json_valid, normalize_answer

__all__ = ["Allocation", "Allocator", "COUNTERFACTUAL", "CounterfactualConfig", "JudgeError", "JudgeUsage", "LLMJudge", "LevelValues",
           "LevelWeights", "RewardError", "RewardSpec", "RoleReward", "TrajectoryReward", "TurnReward", "Verdict", "allocator_names",
           "annotate_groups", "assign_rewards", "broadcast", "check_allocator", "code_tests", "evaluate_levels", "exact_match", "f1",
           "get_allocator", "is_dropped", "json_valid", "normalize_answer", "register_allocator", "render_trajectory",
           "score_groups", "turn_delta"]

__getattr__ = lazy_exports(__name__, {
    "mas_trainer.rewards.allocators": ["Allocation", "Allocator", "LevelWeights", "allocator_names", "assign_rewards", "broadcast",
                                       "check_allocator", "get_allocator", "is_dropped", "register_allocator", "turn_delta"],
    "mas_trainer.rewards.counterfactual": ["COUNTERFACTUAL", "CounterfactualConfig"],
    "mas_trainer.rewards.judge": ["JudgeError", "JudgeUsage", "LLMJudge", "Verdict", "annotate_groups", "render_trajectory",
                                  "score_groups"],
    "mas_trainer.rewards.levels": ["LevelValues", "RewardError", "RewardSpec", "RoleReward", "TrajectoryReward", "TurnReward",
                                   "evaluate_levels"],
    "mas_trainer.rewards.library": ["code_tests", "exact_match", "f1", "json_valid", "normalize_answer"],
})
