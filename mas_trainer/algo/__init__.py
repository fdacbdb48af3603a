"""Algorithms on a policy's turns: advantages with verl's estimators, grouped by task x role.

Importing this package is cheap: ``AdvantageConfig`` is torch-free (``algo.config``), and
the computation (torch, verl on first use) loads when one of its names is first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mas_trainer.algo.config import AdvantageConfig

if TYPE_CHECKING:  # pragma: no cover
    from mas_trainer.algo.advantages import AdvantageBatch, TurnAdvantage, TurnRecord, compute_policy_advantages, tasks_with_spread, turn_records

__all__ = ["AdvantageBatch", "AdvantageConfig", "TurnAdvantage", "TurnRecord", "compute_policy_advantages", "tasks_with_spread",
           "turn_records"]

_LAZY = {"AdvantageBatch", "TurnAdvantage", "TurnRecord", "compute_policy_advantages", "tasks_with_spread", "turn_records"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from mas_trainer.algo import advantages

        return getattr(advantages, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
