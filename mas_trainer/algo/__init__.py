"""Algorithms on a policy's turns: advantages with verl's estimators, grouped by task x role."""

from mas_trainer.algo.advantages import (
    SUPPORTED_ESTIMATORS,
    AdvantageBatch,
    AdvantageConfig,
    TurnAdvantage,
    TurnRecord,
    compute_advantages,
    compute_policy_advantages,
    turn_records,
)

__all__ = [
    "SUPPORTED_ESTIMATORS",
    "AdvantageBatch",
    "AdvantageConfig",
    "TurnAdvantage",
    "TurnRecord",
    "compute_advantages",
    "compute_policy_advantages",
    "turn_records",
]
