"""Token records of LLM calls, filed by rollout until the controller collects them.

Each rollout call is claimed by its call id (the chat span's id its token signs) before it
reaches an engine. A claim is held while the call runs, spent once the call is filed, and
given back if the call ends unanswered (so the OpenAI client's retry of a dropped request
still goes through); a call id claimed or spent already is refused. That makes a rollout
token good for one call, once: a token replayed from the wire names a call id the run's own
instrumentation is using, and two calls can never share a turn in the engines' buffers.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict

from mas_trainer.trace.schema import LLMCall

__all__ = ["Ledger", "Replayed"]

log = logging.getLogger(__name__)


class Replayed(Exception):
    """A rollout call whose call id was used already, or whose rollout was collected."""


class Ledger:
    """Thread-safe: the gateway files from its event loop, the controller takes from its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_rollout: dict[str, list[LLMCall]] = defaultdict(list)
        self._claims: dict[str, dict[str, bool]] = defaultdict(dict)  # rollout -> call id -> filed
        self._closed: set[str] = set()

    def claim(self, rollout_id: str, call_id: str) -> None:
        with self._lock:
            if rollout_id in self._closed:
                raise Replayed(f"rollout {rollout_id[:64]!r} was collected already; its calls are over")
            claims = self._claims[rollout_id]
            if call_id in claims:
                state = "was answered" if claims[call_id] else "is under way"
                raise Replayed(f"call {call_id[:32]!r} of rollout {rollout_id[:64]!r} {state}: a rollout token signs one call, once")
            claims[call_id] = False

    def release(self, rollout_id: str, call_id: str) -> None:
        """The call ended: its claim is given back unless it was filed."""
        with self._lock:
            claims = self._claims.get(rollout_id)
            if claims is not None and claims.get(call_id) is False:
                del claims[call_id]

    def file(self, rollout_id: str, call: LLMCall, *, claim: str | None = None) -> None:
        """File one choice of a call; `claim` (the call id) is spent with it."""
        with self._lock:
            if rollout_id not in self._closed:
                self._by_rollout[rollout_id].append(call)
                if claim is not None:
                    self._claims[rollout_id][claim] = True
                return
        # A call still running when its rollout ended (timeout, error): its trajectory is
        # already written without it, and nobody trains on it.
        log.info("llm call %s of rollout %s finished after the rollout was collected; dropped", call.id, rollout_id)

    def take(self, rollout_id: str) -> list[LLMCall]:
        """All calls of a finished rollout, in arrival order; later arrivals are dropped."""
        with self._lock:
            self._closed.add(rollout_id)
            self._claims.pop(rollout_id, None)
            return self._by_rollout.pop(rollout_id, [])
