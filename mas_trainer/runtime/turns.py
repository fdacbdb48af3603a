"""The turns a policy's worker group generated, kept until the update that trains on them.

Every worker group (embedded, verl, replicas) files each choice of an LLM call under its
`choice_id` when it is generated, and at the update takes the turns the controller's thin
records name; records naming turns it never generated are skipped with one warning (a
record from another policy, or from before a restart), never trained on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from mas_trainer.engines.base import Generation, choice_id

__all__ = ["BufferedTurn", "TurnStore"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BufferedTurn:
    """One choice's exact tokens, as the engine produced them."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]


class TurnStore:
    """Turn id -> `BufferedTurn` of one policy, from generation to the update."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._turns: dict[str, BufferedTurn] = {}

    def __len__(self) -> int:
        return len(self._turns)

    def record(self, turn_id: str | None, prompt_ids: Sequence[int], gens: Sequence[Generation]) -> None:
        """File the choices of one LLM call (a call without a turn id is not for training)."""
        if turn_id is None:
            return
        for i, g in enumerate(gens):
            self._turns[choice_id(turn_id, i)] = BufferedTurn(list(prompt_ids), list(g.token_ids), list(g.logprobs))

    def add(self, turns: Mapping[str, BufferedTurn]) -> None:
        """Turns generated elsewhere (rollout replicas), sent with the records."""
        self._turns.update(turns)

    def take(self, records: Sequence[Any]) -> list[tuple[Any, BufferedTurn]]:
        """(record, turn) of each record whose turn is here, in order; the store is empty after."""
        kept = [(r, self._turns[r.turn_id]) for r in records if r.turn_id in self._turns]
        if len(kept) < len(records):
            log.warning("policy %s: %d of %d records name turns this worker group never generated; skipped",
                        self.policy, len(records) - len(kept), len(records))
        self._turns.clear()
        return kept

    def clear(self) -> int:
        """Forget every turn (held-out rollouts, or turns nobody trained on); how many there were."""
        n = len(self._turns)
        self._turns.clear()
        return n
