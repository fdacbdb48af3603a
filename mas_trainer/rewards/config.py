"""Reward settings that `mas_trainer.config` reads, torch-free and light (config: ``reward.counterfactual``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["CounterfactualConfig"]


class CounterfactualConfig(BaseModel):
    """Counterfactual credit (config: ``reward.counterfactual``; used with ``reward.allocator=counterfactual``)."""

    model_config = ConfigDict(extra="forbid")

    roles: list[str] | None = Field(
        None, description="roles whose turns are credited by forked continuations (default: every trained role); "
        "the other turns get broadcast rewards")
    k: int = Field(4, ge=1, description="continuations run from each checkpoint (K); each costs one partial rollout")
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
