"""The turns a policy's worker group generated, kept until the update that trains on them,
and the serving side every host shares (`Serving`: its engine, its turns, its figures).

Every worker group (embedded, verl, replicas) files each choice of an LLM call under its
`choice_id` when it is generated, and at the update takes the turns the controller's thin
records name; records naming turns it never generated are skipped with one warning (a
record from another policy, or from before a restart), never trained on.

Each turn carries the weights version (updates applied) that generated it. With
`rollout.max_staleness=1` the next step's turns are generated while an update runs, so the
update takes only its records' turns and leaves the others; a turn older than the bound is
never trained on (`TurnStore(max_staleness=...)`, `take(records, version)`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from mas_trainer.engines.base import EngineMeter, Generation, SamplingParams, choice_id

__all__ = ["BufferedTurn", "TurnStore", "Serving"]

if TYPE_CHECKING:
    from mas_trainer.algo.advantages import TurnRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BufferedTurn:
    """One choice's exact tokens, as the engine produced them."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    version: int = 0  # updates the generating weights had had


class TurnStore:
    """Turn id -> `BufferedTurn` of one policy, from generation to the update."""

    def __init__(self, policy: str, max_staleness: int = 0) -> None:
        self.policy, self.max_staleness = policy, max_staleness
        self._turns: dict[str, BufferedTurn] = {}
        self.stale = 0  # turns the last `take` refused as older than the bound

    def __len__(self) -> int:
        return len(self._turns)

    def record(self, turn_id: str | None, prompt_ids: Sequence[int], gens: Sequence[Generation], version: int = 0) -> None:
        """File the choices of one LLM call (a call without a turn id is not for training);
        `version`: the updates the weights that generated it had had (read before the call: a
        turn is never counted fresher than it is)."""
        if turn_id is None:
            return
        for i, g in enumerate(gens):
            self._turns[choice_id(turn_id, i)] = BufferedTurn(list(prompt_ids), list(g.token_ids), list(g.logprobs), version)

    def add(self, turns: Mapping[str, BufferedTurn]) -> None:
        """Turns generated elsewhere (rollout replicas), sent with the records."""
        self._turns.update(turns)

    def take(self, records: Sequence[TurnRecord], version: int = 0) -> list[tuple[TurnRecord, BufferedTurn]]:
        """(record, turn) of each record whose turn is here, in order, for an update of weights
        at `version`.

        With `max_staleness` 0 the store is empty after. Otherwise (overlapped rollouts) only the
        records' turns leave, and every turn older than `version - max_staleness` goes too: a
        record naming one is skipped (counted in `self.stale`, never trained on); the other
        turns, the next step's being generated, stay."""
        here = [r for r in records if r.turn_id in self._turns]
        if len(here) < len(records):
            log.warning("policy %s: %d of %d records name turns this worker group never generated; skipped",
                        self.policy, len(records) - len(here), len(records))
        if not self.max_staleness:
            kept, self.stale = [(r, self._turns[r.turn_id]) for r in here], 0
            self._turns.clear()
            return kept
        oldest = version - self.max_staleness
        pairs = [(r, self._turns.pop(r.turn_id)) for r in here]
        kept = [(r, t) for r, t in pairs if t.version >= oldest]
        self.stale = len(pairs) - len(kept)
        if self.stale:
            log.warning("policy %s: %d turns were generated more than rollout.max_staleness updates ago; skipped",
                        self.policy, self.stale)
        for tid in [tid for tid, t in self._turns.items() if t.version < oldest]:
            del self._turns[tid]  # nobody's record: never trainable now
        return kept

    def stale_metrics(self) -> dict[str, float]:
        """`turns/stale` of the last `take` (only where a bound is set: overlapped rollouts)."""
        return {"turns/stale": float(self.stale)} if self.max_staleness else {}

    def clear(self) -> int:
        """Forget every turn (held-out rollouts, or turns nobody trained on); how many there were."""
        n = len(self._turns)
        self._turns.clear()
        return n


class Serving:
    """A policy's engine and the turns it generated, kept for the update: the serving side of
    every host (this process, a Ray actor, verl's rank 0). `engine` is None where rollout
    replicas serve and the turns arrive with the records. `adapter`: the LoRA adapter of the
    engine's base that serves this policy (a shared base); `metered`: whether this policy
    reports the engine's figures (a shared engine's are reported once, by one of its policies)."""

    def __init__(self, engine: Any, turns: TurnStore, *, adapter: str | None = None, metered: bool = True) -> None:
        self.engine, self.turns, self.adapter = engine, turns, adapter
        self.meter = EngineMeter(engine) if engine is not None and metered else None

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams, turn_id: str | None,
                       version: int) -> list[Generation]:
        """`version`: the updates the serving weights have had, read by the caller before the call
        (the engine runs no row across an update, `run_exclusive`)."""
        if self.engine is None:
            raise RuntimeError(f"policy {self.turns.policy}: this process holds no engine (its rollout replicas serve)")
        gens = await (self.engine.generate(prompt_ids, params) if self.adapter is None else
                      self.engine.generate(prompt_ids, params, adapter=self.adapter))
        self.turns.record(turn_id, prompt_ids, gens, version)
        return gens

    def discard(self) -> int:
        """Forget stored turns (held-out rollouts, or turns nobody trained on); the engine figures
        of the next update count from here, so a resumed run reports the same ones."""
        self.figures()
        return self.turns.clear()

    def figures(self) -> dict[str, float]:
        """The engine's figures since the last read (none without an engine)."""
        return self.meter.read() if self.meter is not None else {}
