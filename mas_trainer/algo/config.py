"""Advantage settings (config: ``advantage``, ``policies.<name>.advantage``).

Torch-free, so a config is loaded and checked in full before anything heavy starts. The
estimator name is checked against verl's ``ADV_ESTIMATOR_REGISTRY``; verl takes seconds to
import, so the common names are accepted without it and verl is asked only about the others.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["AdvantageConfig", "COMMON_ESTIMATORS", "NEEDS_MORE", "check_estimator"]

# Registered in verl and tested here: known without importing verl.
COMMON_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae")
# Registered in verl, but they need inputs a turn record does not carry: refused.
NEEDS_MORE = frozenset({"remax", "gdpo", "optimal_token_baseline", "tir_optimal_token_baseline"})


def check_estimator(name: str) -> str:
    """`name` if this project can run it with verl, else a ValueError naming the usable ones."""
    if name in COMMON_ESTIMATORS:
        return name
    try:
        from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY
    except ImportError:
        raise ValueError(f"advantage estimator {name!r} needs verl to check it (pip install verl); "
                         f"without it choose one of {', '.join(COMMON_ESTIMATORS)}") from None
    if name in ADV_ESTIMATOR_REGISTRY and name not in NEEDS_MORE:
        return name
    usable = [n for n in ADV_ESTIMATOR_REGISTRY if n not in NEEDS_MORE]
    raise ValueError(f"advantage estimator {name!r} is not usable here; choose one of {', '.join(usable)}")


class AdvantageConfig(BaseModel):
    """How one policy's advantages are computed (config: ``policies.<name>.advantage``)."""

    model_config = ConfigDict(extra="forbid")

    estimator: str = Field("grpo", description="verl estimator: grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, gae (needs the critic)")
    gamma: float = Field(1.0, description="discount (REINFORCE++, GAE)")
    lam: float = Field(1.0, description="GAE lambda")
    norm_adv_by_std_in_grpo: bool = Field(True, description="GRPO: divide by the group's std (false: Dr. GRPO)")
    epsilon: float = Field(1e-6, gt=0, description="added to std in normalisations")
    # Scale each turn's advantages by (T / R) / k: k = that rollout's turns of this policy,
    # T = turns and R = rollouts in the batch. See compute_policy_advantages.
    rollout_norm: bool = Field(False, description="weigh every rollout the same, however many turns it has")

    @field_validator("estimator")
    @classmethod
    def _usable(cls, value: str) -> str:
        return check_estimator(value)
