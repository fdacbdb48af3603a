"""Rollout correction: verl's truncated importance weights between the learner's and the
engine's log-probs of the same tokens, for both learners.

The engine that sampled a turn may hold other weights than the learner that trains on it
(numerics of another kernel; or, with `rollout.max_staleness=1`, the weights of one update
before). verl's `compute_rollout_correction_and_rejection_mask` weights each token by
min(exp(learner - engine), threshold) (TIS, `rollout_is="token"`); the PPO loss multiplies its
per-token terms by those weights (`rollout_is_weights` of verl's policy losses).
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["rollout_is_weights", "padded"]


def padded(rows: Sequence[Sequence[float]], width: int | None = None) -> torch.Tensor:
    """(B, width) float32 of ragged rows, zero-padded on the right."""
    width = max((len(r) for r in rows), default=0) if width is None else width
    out = torch.zeros(len(rows), width, dtype=torch.float32)
    for b, r in enumerate(rows):
        out[b, : len(r)] = torch.as_tensor(list(r), dtype=torch.float32)
    return out


def rollout_is_weights(learner_lp: torch.Tensor, engine_lp: torch.Tensor, mask: torch.Tensor,
                       threshold: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token truncated importance weights and verl's mismatch metrics (`rollout_corr/`
    prefix dropped).

    learner_lp, engine_lp, mask: (B, T) float32, log-probs of the same response tokens under
    the learner's current weights and as the engine sampled them; mask 1 on response tokens.
    Returns weights (B, T), 0 off the mask."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    weights, _, metrics = compute_rollout_correction_and_rejection_mask(
        learner_lp, engine_lp, mask, rollout_is="token", rollout_is_threshold=threshold)
    w = weights.batch["rollout_is_weights"] if weights is not None else torch.ones_like(learner_lp)
    return w * mask, {k.removeprefix("rollout_corr/"): float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
