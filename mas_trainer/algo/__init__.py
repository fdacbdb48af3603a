"""Algorithms on a policy's turns: advantages with verl's estimators, grouped by task x role.

Importing this package is cheap: each name loads its module on first use; ``AdvantageConfig``
is torch-free (``algo.config``), the computation (torch, verl) is in ``algo.advantages``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mas_trainer._lazy import lazy_exports

if TYPE_CHECKING:  # pragma: no cover
    from mas_trainer.algo.advantages import AdvantageBatch, TurnAdvantage, TurnRecord, compute_policy_advantages, tasks_with_spread, turn_records
    from mas_trainer.algo.config import AdvantageConfig

__all__ = ["AdvantageBatch", "AdvantageConfig", "TurnAdvantage", "TurnRecord", "compute_policy_advantages", "tasks_with_spread",
           "turn_records"]

__getattr__ = lazy_exports(__name__, {
    "mas_trainer.algo.advantages": ["AdvantageBatch", "TurnAdvantage", "TurnRecord", "compute_policy_advantages", "tasks_with_spread",
                                    "turn_records"],
    "mas_trainer.algo.config": ["AdvantageConfig"],
})
