"""Token records of LLM calls, filed by rollout until the controller collects them."""

from __future__ import annotations

import threading
from collections import defaultdict

from mas_trainer.trace.schema import LLMCall

__all__ = ["Ledger"]


class Ledger:
    """Thread-safe: the gateway files from its event loop, the controller takes from its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_rollout: dict[str, list[LLMCall]] = defaultdict(list)
        self._closed: set[str] = set()
        self.dropped = 0  # calls that arrived after their rollout was collected

    def file(self, rollout_id: str, call: LLMCall) -> None:
        with self._lock:
            if rollout_id in self._closed:
                self.dropped += 1
                return
            self._by_rollout[rollout_id].append(call)

    def take(self, rollout_id: str) -> list[LLMCall]:
        """All calls of a finished rollout, in arrival order; later arrivals are dropped."""
        with self._lock:
            self._closed.add(rollout_id)
            return self._by_rollout.pop(rollout_id, [])
