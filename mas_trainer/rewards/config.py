"""Reward settings that `mas_trainer.config` reads, torch-free and light (config: ``reward.counterfactual``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["CounterfactualConfig", "MAX_K"]

MAX_K = 256
"""Most continuations per checkpoint: VinePPO uses 9, and at K = 256 a 0/1 return's mean is known to about
±0.03 already; every one is a run of the rest of the app, for each checkpoint of each rollout."""


class CounterfactualConfig(BaseModel):
    """Counterfactual credit (config: ``reward.counterfactual``; used with ``reward.allocator=counterfactual``)."""

    model_config = ConfigDict(extra="forbid")

    roles: list[str] | None = Field(
        None, description="roles whose turns are credited by forked continuations (default: every trained role); "
        "the other turns get broadcast rewards")
    k: int = Field(4, ge=1, description=f"continuations run from each checkpoint (K); each costs one partial rollout "
                   f"(at most {MAX_K}: K forks per credited turn, each a full continuation of the app)")
    max_forks_per_step: int | None = Field(
        None, ge=1, description="budget of continuations per training step: K shrinks to fit it (never below 1, so "
        "every checkpoint a turn needs still gets one continuation); default: no budget")
    boundaries_only: bool = Field(
        False, description="fork only where the acting role changes: consecutive supersteps of one role share one "
        "credit (before its first turn, after its last), fewer checkpoints for a coarser estimate")
    train_forks: bool = Field(
        False, description="also train on the continuations' own LLM calls: the K continuations of one checkpoint are "
        "one group (same state, returns compared within it); off: they are recorded (trajectories/step_N_forks.jsonl) "
        "and scored, never trained")

    @field_validator("k")
    @classmethod
    def _k_bounded(cls, k: int) -> int:
        if k > MAX_K:
            raise ValueError(f"{k} is over the bound of {MAX_K} (K forks per credited turn: each is a full continuation of "
                             f"the app from its checkpoint, for every checkpoint of every rollout); use at most {MAX_K}, or "
                             "max_forks_per_step to budget them")
        return k
