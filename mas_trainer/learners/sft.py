"""The supervised warm start's batches, shared by both learners (`TorchLearner.supervised`,
`PolicyWorker.warm_start`): the same seed gives the same turns in the same steps on either.

An example is (prompt ids, completion ids): the loss is the mean negative log-likelihood of
the completion tokens over a step's batch (token mean, prompt masked), one optimizer step a batch.
"""

from __future__ import annotations

import random
from typing import Sequence

__all__ = ["Example", "sft_batches", "sft_metrics"]

Example = tuple[Sequence[int], Sequence[int]]


def sft_batches(n: int, steps: int, batch_size: int, seed: int) -> list[list[int]]:
    """`steps` batches of example indices: seeded shuffled epochs, cut into batches of
    min(batch_size, n) (a policy with few turns sees each of them every step)."""
    size = min(batch_size, n)
    order: list[int] = []
    epoch, out = 0, []
    for _ in range(steps):
        while len(order) < size:
            order += random.Random(seed * 1_000_003 + epoch).sample(range(n), n)
            epoch += 1
        out.append(order[:size])
        order = order[size:]
    return out


def sft_metrics(losses: list[float], tokens: int, examples: int, grad_norms: list[float]) -> dict[str, float]:
    """The warm start's metrics: the loss of the first and of the last step's batch (each
    measured before that step's update), completion tokens trained on over all steps."""
    out = {"sft_loss_first": losses[0], "sft_loss": losses[-1], "sft_tokens": float(tokens),
           "sft_examples": float(examples), "sft_steps": float(len(losses))}
    if grad_norms:
        out["sft_grad_norm"] = sum(grad_norms) / len(grad_norms)
    return out
